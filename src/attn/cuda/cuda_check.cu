// The GPU check (scripts/gpu-check.sh, docs/cuda.md): the CUDA kernel against the CPU scalar
// reference on a device, a CUDA graph replay of one step, and the benchmark. It needs no test
// framework and no third-party library, so that a bare GPU machine builds it with nvcc alone.
//
//   witcert_cuda_check --test  [--json FILE]   exit 0: every check passed; 1: a failure; 77: no device
//   witcert_cuda_check --bench [--json FILE] [--quick | --full]
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <bit>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <memory>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

#include "attn/cuda/attention.h"
#include "attn/cuda/mirror.h"
#include "attn/cuda/test_stores.h"
#include "quant/dither_int8.h"

namespace witcert::cuda {
namespace {

constexpr int kNoDevice = 77;  // ctest's SKIP_RETURN_CODE

void check(cudaError_t e, const char* what) {
  if (e != cudaSuccess) throw std::runtime_error(std::string(what) + ": " + cudaGetErrorString(e));
}

// Device copies of host arrays, freed together.
class Device {
 public:
  Device() = default;
  Device(const Device&) = delete;
  Device& operator=(const Device&) = delete;
  ~Device() {
    for (void* p : owned_) cudaFree(p);
  }
  void* alloc(std::size_t bytes) {
    void* p = nullptr;
    check(cudaMalloc(&p, std::max<std::size_t>(bytes, 16)), "cudaMalloc");
    owned_.push_back(p);
    return p;
  }
  template <class T>
  const T* copy(const std::vector<T>& v) {
    if (v.empty()) return nullptr;
    void* p = alloc(v.size() * sizeof(T));
    check(cudaMemcpy(p, v.data(), v.size() * sizeof(T), cudaMemcpyHostToDevice), "cudaMemcpy");
    return static_cast<const T*>(p);
  }
  PoolView pool(const HostPool& h) {
    PoolView p = h.shape;
    p.k.rows = copy(h.k_rows), p.v.rows = copy(h.v_rows);
    p.k.meta = copy(h.k_meta), p.v.meta = copy(h.v_meta);
    p.k.packed = copy(h.k_packed), p.v.packed = copy(h.v_packed);
    p.k.codes = copy(h.k_codes), p.v.codes = copy(h.v_codes);
    p.k.outliers = copy(h.k_outliers);
    p.page_counter = copy(h.page_counter), p.slot_counter = copy(h.slot_counter);
    return p;
  }
  BatchView batch(const HostBatch& h) {
    BatchView b = h.shape;
    b.n_ctx = copy(h.n_ctx), b.page_table = copy(h.page_table), b.shared_end = copy(h.shared_end);
    b.k_packed_rows = copy(h.k_packed_rows), b.v_packed_rows = copy(h.v_packed_rows);
    b.outlier_rank = copy(h.outlier_rank), b.kappa = copy(h.kappa), b.sm = copy(h.sm), b.q = copy(h.q);
    return b;
  }

 private:
  std::vector<void*> owned_;
};

// A step's results read back.
struct StepRun {
  std::vector<float> out;
  std::vector<HeadReport> reports;
  MeterSummary summary;
};

// One step on the device, launched directly or captured in a CUDA graph and replayed twice.
StepRun run_step(const PoolView& pool, const BatchView& batch, const StepConfig& config, bool graph) {
  const int heads = batch.batch * pool.kv_heads * batch.group;
  Device dev;
  const Workspace ws = carve_workspace(dev.alloc(workspace_bytes(batch.batch, pool.kv_heads * batch.group, config.splits, pool.d)),
                                       batch.batch, pool.kv_heads * batch.group, config.splits, pool.d);
  MeterSummary* pinned = nullptr;
  check(cudaMallocHost(&pinned, sizeof(MeterSummary)), "cudaMallocHost");
  check(set_up_kernels(batch.group, pool.d, pool.bands), "set_up_kernels");
  cudaStream_t stream;
  check(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "cudaStreamCreate");
  if (graph) {
    cudaGraph_t g;
    cudaGraphExec_t exec;
    check(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal), "cudaStreamBeginCapture");
    check(attend_step(pool, batch, config, ws, pinned, stream), "attend_step (captured)");
    check(cudaStreamEndCapture(stream, &g), "cudaStreamEndCapture");
    check(cudaGraphInstantiate(&exec, g, 0), "cudaGraphInstantiate");
    for (int replay = 0; replay < 2; ++replay) check(cudaGraphLaunch(exec, stream), "cudaGraphLaunch");
    check(cudaStreamSynchronize(stream), "graph replay");
    cudaGraphExecDestroy(exec);
    cudaGraphDestroy(g);
  } else {
    check(attend_step(pool, batch, config, ws, pinned, stream), "attend_step");
    check(cudaStreamSynchronize(stream), "step");
  }
  StepRun r;
  r.out.resize(static_cast<std::size_t>(heads) * pool.d);
  r.reports.resize(heads);
  check(cudaMemcpy(r.out.data(), ws.buffers.out, r.out.size() * sizeof(float), cudaMemcpyDeviceToHost), "read output");
  check(cudaMemcpy(r.reports.data(), ws.buffers.reports, r.reports.size() * sizeof(HeadReport), cudaMemcpyDeviceToHost), "read reports");
  r.summary = *pinned;
  cudaFreeHost(pinned);
  cudaStreamDestroy(stream);
  return r;
}

// Failures counted and the first few printed.
struct Checks {
  long passed = 0, failed = 0;
  long violations = 0;  // meter below the true TV
  double worst_out = 0.0, worst_meter = 0.0;
  void expect(bool ok, const std::string& what) {
    if (ok) {
      ++passed;
      return;
    }
    if (++failed <= 40) std::printf("FAIL %s\n", what.c_str());
  }
};

bool near(double got, double want, double rel) { return got == want || std::fabs(got - want) <= rel * std::fabs(want); }

double output_error(const float* got, const std::vector<float>& want) {
  double scale = 0.0, err = 0.0;
  for (float x : want) scale = std::max(scale, static_cast<double>(std::fabs(x)));
  for (std::size_t i = 0; i < want.size(); ++i) err = std::max(err, std::fabs(static_cast<double>(got[i]) - want[i]));
  return std::isnan(err) ? INFINITY : err / std::max(scale, 1e-30);
}

// A batch of sequences of different lengths over one pool configuration, mirrored with shuffled
// pages, and the scalar reference's output, report and true TV of every query head.
struct Scenario {
  int layers = 2, kv_heads = 2, group = 4, d = 64, layer = 1;
  std::vector<std::unique_ptr<cache::KvStore>> stores;
  std::vector<std::vector<float>> q;
  HostPool pool;
  HostBatch batch;
  std::vector<std::vector<float>> want_out;
  std::vector<attn::HeadResult> want;
  std::vector<double> tv;

  Scenario(const testing::Formats& f, int page, const std::vector<std::int64_t>& lengths, int kv_heads_, int group_, int d_,
           std::uint64_t seed)
      : kv_heads(kv_heads_), group(group_), d(d_) {
    const std::int64_t capacity = *std::max_element(lengths.begin(), lengths.end());
    const cache::CacheConfig cfg = testing::config(f, layers, kv_heads, d, capacity, page, seed);
    std::vector<const cache::KvStore*> ptrs;
    for (std::size_t s = 0; s < lengths.size(); ++s) {
      stores.push_back(testing::filled_store(cfg, lengths[s], seed + 100 * s));
      ptrs.push_back(stores.back().get());
      q.push_back(testing::queries(kv_heads * group, d, seed + 7 * s));
    }
    const double delta = testing::step_delta_loc(layers, kv_heads * group);
    mirror(ptrs, lengths, layer, group, q, delta, seed, pool, batch);
    for (std::size_t s = 0; s < lengths.size(); ++s)
      for (int kv = 0; kv < kv_heads; ++kv) {
        const float* qk = q[s].data() + static_cast<std::size_t>(kv) * group * d;
        const auto partials = testing::reference_partials(*stores[s], layer, kv, qk, group, lengths[s], delta);
        cache::KvStore::Reader reader(*stores[s], layer, kv);
        for (int h = 0; h < group; ++h) {
          want_out.emplace_back(d);
          want.push_back(attn::finish(partials[h], d, want_out.back().data()));
          tv.push_back(attn::true_tv(reader, qk + h * d, d, lengths[s]));
        }
      }
  }
};

void compare(const Scenario& sc, const StepRun& run, bool meter, const std::string& label, Checks& checks) {
  for (std::size_t head = 0; head < sc.want.size(); ++head) {
    const std::string at = label + " head " + std::to_string(head);
    const double err = output_error(&run.out[head * sc.d], sc.want_out[head]);
    checks.worst_out = std::max(checks.worst_out, err);
    checks.expect(err <= (meter ? 1e-5 : 1e-4), at + ": output off by " + std::to_string(err) + " relative");
    if (!meter) continue;
    const HeadReport& r = run.reports[head];
    const attn::HeadResult& w = sc.want[head];
    if (w.meter > 0.0) checks.worst_meter = std::max(checks.worst_meter, std::fabs(r.meter - w.meter) / w.meter);
    checks.expect(near(r.meter, w.meter, 1e-6), at + ": meter " + std::to_string(r.meter) + " vs " + std::to_string(w.meter));
    checks.expect(near(r.eform_raw, w.eform_raw, 1e-6), at + ": e-form " + std::to_string(r.eform_raw) + " vs " + std::to_string(w.eform_raw));
    checks.expect(near(r.v_meter, w.v_meter, 1e-6), at + ": V meter " + std::to_string(r.v_meter) + " vs " + std::to_string(w.v_meter));
    if (!(r.meter >= sc.tv[head])) ++checks.violations;
    checks.expect(r.meter >= sc.tv[head], at + ": meter " + std::to_string(r.meter) + " below the true TV " + std::to_string(sc.tv[head]));
  }
}

// The summary the device reduced is the host's reduction of the reports it copied.
void check_summary(const StepRun& run, const StepConfig& config, const std::string& label, Checks& checks) {
  MeterSummary s;
  s.heads = static_cast<unsigned>(run.reports.size());
  for (const HeadReport& r : run.reports) {
    s.k_covered += r.meter <= config.tau_k;
    s.v_covered += r.v_meter <= config.tau_v;
    s.no_guarantee += !is_finite(r.eform_raw);
    s.meter_max = std::max(s.meter_max, r.meter);
    s.v_meter_max = std::max(s.v_meter_max, r.v_meter);
    s.eform_max = std::max(s.eform_max, r.eform_raw);
  }
  checks.expect(std::memcmp(&s, &run.summary, sizeof s) == 0, label + ": the device summary differs from the reports'");
}

__global__ void dither_kernel(const std::uint64_t* seeds, const std::uint32_t* words, int n, float* xi) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= n) return;
  dither_quad(seeds[i], words[4 * i], words[4 * i + 1], words[4 * i + 2], words[4 * i + 3], xi + 4 * i);
}

// ξ drawn on the device, bit for bit quant::dither_values's.
void check_dither_stream(Checks& checks) {
  const int n = 1 << 16;
  std::mt19937_64 rng(17);
  std::vector<std::uint64_t> seeds(n);
  std::vector<std::uint32_t> words(4 * n);
  for (int i = 0; i < n; ++i) {
    seeds[i] = rng();
    words[4 * i] = static_cast<std::uint32_t>(rng() % 80);                                   // layer
    words[4 * i + 1] = static_cast<std::uint32_t>(rng() % 64);                               // kv head
    words[4 * i + 2] = static_cast<std::uint32_t>(rng()) | (i % 2 ? 0x80000000u : 0u);       // counter
    words[4 * i + 3] = static_cast<std::uint32_t>(rng() % 64);                               // channel quad
  }
  Device dev;
  float* xi = static_cast<float*>(dev.alloc(4 * n * sizeof(float)));
  dither_kernel<<<(n + 255) / 256, 256>>>(dev.copy(seeds), dev.copy(words), n, xi);
  check(cudaGetLastError(), "dither_kernel");
  std::vector<float> got(4 * n), cpu(256);
  check(cudaMemcpy(got.data(), xi, got.size() * sizeof(float), cudaMemcpyDeviceToHost), "read ξ");
  long bad = 0;
  for (int i = 0; i < n; ++i) {
    quant::dither_values({seeds[i], words[4 * i], words[4 * i + 1]}, words[4 * i + 2], cpu);
    for (int e = 0; e < 4; ++e)
      bad += std::bit_cast<std::uint32_t>(got[4 * i + e]) != std::bit_cast<std::uint32_t>(cpu[4 * words[4 * i + 3] + e]);
  }
  checks.expect(bad == 0, "dither stream: " + std::to_string(bad) + " values differ from the CPU's");
}

int run_tests(const char* json) {
  Checks checks;
  check_dither_stream(checks);
  struct Shape {
    int kv_heads, group, d;
    std::vector<std::int64_t> lengths;
  };
  const std::vector<Shape> shapes = {{2, 4, 64, {1, 45, 160, 1000, 2049}}, {1, 8, 128, {17, 700}}};
  long cases = 0;
  for (const Shape& shape : shapes)
    for (const testing::Formats& f : testing::kernel_formats()) {
      if (shape.d == 128 && f.k != f.v) continue;  // the wider shape: each format on both sides
      for (int page : {1, 16}) {
        Scenario sc(f, page, shape.lengths, shape.kv_heads, shape.group, shape.d, 31 + cases);
        Device dev;
        const PoolView pool = dev.pool(sc.pool);
        const BatchView batch = dev.batch(sc.batch);
        for (int splits : {1, 4, 16}) {
          const std::string label = f.name() + " d=" + std::to_string(shape.d) + " group=" + std::to_string(shape.group) +
                                    " page=" + std::to_string(page) + " splits=" + std::to_string(splits);
          StepConfig config;
          config.splits = splits;
          const StepRun run = run_step(pool, batch, config, false);
          compare(sc, run, true, label, checks);
          check_summary(run, config, label, checks);
          if (splits == 4) {
            const StepRun replay = run_step(pool, batch, config, true);
            checks.expect(replay.out == run.out && std::memcmp(replay.reports.data(), run.reports.data(),
                                                               run.reports.size() * sizeof(HeadReport)) == 0 &&
                              std::memcmp(&replay.summary, &run.summary, sizeof(MeterSummary)) == 0,
                          label + ": the CUDA graph's replay differs from the direct launch");
            config.meter = false;
            compare(sc, run_step(pool, batch, config, false), false, label + " (meter off)", checks);
          }
          ++cases;
        }
      }
    }
  std::printf("%ld step cases, %ld checks passed, %ld failed; %ld soundness violations; worst output error %.3g, worst meter error %.3g\n",
              cases, checks.passed, checks.failed, checks.violations, checks.worst_out, checks.worst_meter);
  if (json != nullptr) {
    if (FILE* f = std::fopen(json, "w")) {
      std::fprintf(f,
                   "{\"cases\": %ld, \"passed\": %ld, \"failed\": %ld, \"soundness_violations\": %ld, "
                   "\"worst_output_rel_error\": %.6g, \"worst_meter_rel_error\": %.6g}\n",
                   cases, checks.passed, checks.failed, checks.violations, checks.worst_out, checks.worst_meter);
      std::fclose(f);
    }
  }
  return checks.failed == 0 ? 0 : 1;
}

// --- benchmark ---

__device__ std::uint32_t mix(std::uint64_t x) {
  x ^= x >> 33;
  x *= 0xff51afd7ed558ccdull;
  x ^= x >> 33;
  x *= 0xc4ceb9fe1a85ec53ull;
  return static_cast<std::uint32_t>(x ^ (x >> 33));
}

__global__ void fill_bytes(std::uint8_t* p, std::size_t n, std::uint32_t seed) {
  for (std::size_t i = blockIdx.x * static_cast<std::size_t>(blockDim.x) + threadIdx.x; i < n; i += static_cast<std::size_t>(gridDim.x) * blockDim.x)
    p[i] = static_cast<std::uint8_t>(mix(i * 0x9E3779B97F4A7C15ull + seed));
}

// fp16 values of magnitude in [lo, lo·2), random signs unless positive.
__global__ void fill_halves(std::uint16_t* p, std::size_t n, std::size_t stride, std::uint32_t seed, float lo, bool positive) {
  for (std::size_t i = blockIdx.x * static_cast<std::size_t>(blockDim.x) + threadIdx.x; i < n; i += static_cast<std::size_t>(gridDim.x) * blockDim.x) {
    const std::uint32_t r = mix(i * 0x9E3779B97F4A7C15ull + seed);
    float v = lo * (1.0f + static_cast<float>(r >> 8) * 0x1p-24f);
    if (!positive && (r & 1)) v = -v;
    p[i * stride] = __half_as_ushort(__float2half_rn(v));
  }
}

void fill(void* p, std::size_t bytes, std::uint32_t seed) {
  fill_bytes<<<1024, 256>>>(static_cast<std::uint8_t*>(p), bytes, seed);
}
void fill_f16(void* p, std::size_t n, std::size_t stride, std::uint32_t seed, float lo, bool positive) {
  fill_halves<<<1024, 256>>>(static_cast<std::uint16_t*>(p), n, stride, seed, lo, positive);
}

struct BenchShape {
  int batch, d, kv_heads, group;
  long long S;
};

// A pool of `batch` sequences of S positions each for one layer, filled on the device with random
// packed bytes and sane scales; returns the bytes a step reads.
std::size_t bench_pool(Device& dev, const BenchShape& sh, Format kf, Format vf, PoolView& pool, BatchView& batch) {
  const int P = 16, d = sh.d, m2 = 8;
  const long long pages_per_seq = (sh.S + P - 1) / P;
  pool = PoolView{};
  pool.d = d, pool.page_size = P, pool.kv_heads = sh.kv_heads, pool.bands = 16, pool.outlier_values = m2;
  pool.pages = sh.batch * pages_per_seq;
  pool.seed = 0x5EED;
  const std::size_t slots = static_cast<std::size_t>(sh.kv_heads) * pool.pages * P;
  std::size_t read = 0;
  for (int side = 0; side < 2; ++side) {
    const Format f = side == 0 ? kf : vf;
    SideView& v = side == 0 ? pool.k : pool.v;
    v.format = f;
    const std::size_t tokens = static_cast<std::size_t>(sh.batch) * sh.S * sh.kv_heads;
    if (f == Format::fp16) {
      void* rows = dev.alloc(slots * d * 2);
      fill_f16(rows, slots * d, 1, 11 + side, 0.25f, false);
      v.rows = static_cast<const std::uint16_t*>(rows);
      read += tokens * d * 2;
    } else if (f == Format::dither_int8) {
      void* codes = dev.alloc(slots * d);
      fill(codes, slots * d, 21 + side);
      v.codes = static_cast<const std::int8_t*>(codes);
      v.meta_per_token = d / kGroup;
      void* meta = dev.alloc(slots * v.meta_per_token * 2);
      fill_f16(meta, slots * v.meta_per_token, 1, 31 + side, 0.01f, true);
      v.meta = static_cast<const std::uint16_t*>(meta);
      read += tokens * (d + 2 * v.meta_per_token);
      if (side == 0) {
        void* out = dev.alloc(slots * m2 * 2);
        fill_f16(out, slots * m2, 1, 41, 2.0f, false);
        v.outliers = static_cast<const std::uint16_t*>(out);
        read += tokens * m2 * 2;
      }
    } else {
      v.row_bytes = packed_row_bytes(f, d);
      void* packed = dev.alloc(slots * v.row_bytes);
      fill(packed, slots * v.row_bytes, 51 + side);
      if (f == Format::q8_0) fill_f16(packed, slots * d / 32, 17, 61 + side, 0.01f, true);  // each block's scale
      v.packed = static_cast<const std::uint8_t*>(packed);
      v.meta_per_token = side == 0 ? pool.bands : 1;
      void* meta = dev.alloc(slots * v.meta_per_token * 2);
      fill_f16(meta, slots * v.meta_per_token, 1, 71 + side, 0.001f, true);
      v.meta = static_cast<const std::uint16_t*>(meta);
      read += tokens * (v.row_bytes + 2 * v.meta_per_token);
    }
  }
  std::vector<std::uint32_t> counters(pool.pages);
  for (std::size_t i = 0; i < counters.size(); ++i) counters[i] = static_cast<std::uint32_t>(i * P);
  pool.slot_counter = dev.copy(counters);
  for (std::uint32_t& c : counters) c = (c / P) | 0x80000000u;
  pool.page_counter = dev.copy(counters);

  HostBatch h;
  batch = BatchView{};
  batch.batch = sh.batch, batch.layer = 0, batch.streams = sh.kv_heads, batch.group = sh.group;
  batch.max_pages = static_cast<int>(pages_per_seq);
  h.n_ctx.assign(sh.batch, static_cast<std::int32_t>(sh.S));
  std::vector<std::int32_t> order(pool.pages);
  for (std::size_t i = 0; i < order.size(); ++i) order[i] = static_cast<std::int32_t>(i);
  std::shuffle(order.begin(), order.end(), std::mt19937_64(5));  // pages scattered as a real pool's
  h.page_table = order;
  h.shared_end.assign(sh.batch, 0);
  h.k_packed_rows.assign(static_cast<std::size_t>(sh.batch) * sh.kv_heads * pages_per_seq, static_cast<std::int16_t>(P));
  h.v_packed_rows = h.k_packed_rows;
  h.outlier_rank.assign(static_cast<std::size_t>(sh.batch) * sh.kv_heads * d, -1);
  for (std::size_t s = 0; s < h.outlier_rank.size(); s += d)
    for (int j = 0; j < m2; ++j) h.outlier_rank[s + j] = static_cast<std::int8_t>(j);
  h.kappa.assign(static_cast<std::size_t>(sh.batch) * sh.kv_heads, subgaussian_kappa(static_cast<long>(sh.S), 1e-7, d - m2));
  h.sm.assign(sh.batch, 1.0 / std::sqrt(static_cast<double>(d)));
  h.q = testing::queries(sh.batch * sh.kv_heads * sh.group, d, 3);
  batch.n_ctx = dev.copy(h.n_ctx), batch.page_table = dev.copy(h.page_table), batch.shared_end = dev.copy(h.shared_end);
  batch.k_packed_rows = dev.copy(h.k_packed_rows), batch.v_packed_rows = dev.copy(h.v_packed_rows);
  batch.outlier_rank = dev.copy(h.outlier_rank), batch.kappa = dev.copy(h.kappa), batch.sm = dev.copy(h.sm), batch.q = dev.copy(h.q);
  check(cudaDeviceSynchronize(), "bench fill");
  return read;
}

// Milliseconds per call of fn on `stream`: warm-up, then as many calls as fit in about half a second.
template <class Fn>
double time_ms(cudaStream_t stream, Fn fn) {
  cudaEvent_t a, b;
  check(cudaEventCreate(&a), "event");
  check(cudaEventCreate(&b), "event");
  fn();
  check(cudaEventRecord(a, stream), "event");
  fn();
  check(cudaEventRecord(b, stream), "event");
  check(cudaEventSynchronize(b), "first timing");
  float first = 0.0f;
  cudaEventElapsedTime(&first, a, b);
  const int reps = std::clamp(static_cast<int>(500.0f / std::max(first, 1e-3f)), 3, 200);
  check(cudaEventRecord(a, stream), "event");
  for (int i = 0; i < reps; ++i) fn();
  check(cudaEventRecord(b, stream), "event");
  check(cudaEventSynchronize(b), "timing");
  float ms = 0.0f;
  cudaEventElapsedTime(&ms, a, b);
  cudaEventDestroy(a);
  cudaEventDestroy(b);
  return ms / reps;
}

const char* format_name(Format f) {
  switch (f) {
    case Format::fp16: return "fp16";
    case Format::dither_int8: return "dither-int8";
    case Format::q8_0: return "q8_0";
    case Format::q4_0: return "q4_0";
    case Format::fp8_e4m3: return "fp8-e4m3";
  }
  return "?";
}

int run_bench(const char* json, bool quick, bool full) {
  cudaDeviceProp prop;
  check(cudaGetDeviceProperties(&prop, 0), "cudaGetDeviceProperties");
  cudaStream_t stream;
  check(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "cudaStreamCreate");
  // The copy bandwidth a kernel that reads the cache once can aim at: a device-to-device copy
  // moves each byte twice (read and write).
  double copy_gbps = 0.0;
  {
    Device dev;
    const std::size_t bytes = std::size_t{1} << 30;
    void* a = dev.alloc(bytes);
    void* b = dev.alloc(bytes);
    const double ms = time_ms(stream, [&] { check(cudaMemcpyAsync(b, a, bytes, cudaMemcpyDeviceToDevice, stream), "copy"); });
    copy_gbps = 2.0 * bytes / (ms * 1e6);
  }
  std::printf("device %s, %d SMs; device-to-device copy %.0f GB/s (read + write)\n", prop.name, prop.multiProcessorCount, copy_gbps);
  struct Variant {
    Format k, v;
    bool meter;
  };
  const Variant variants[] = {{Format::fp16, Format::fp16, false},
                              {Format::dither_int8, Format::dither_int8, true},
                              {Format::dither_int8, Format::dither_int8, false},
                              {Format::q8_0, Format::q8_0, true}};
  // 32 query heads; --full: the issue's whole matrix, shapes whose fp16 cache fits in 40 % of the
  // device's memory.
  std::vector<BenchShape> shapes;
  const std::vector<int> batches = full ? std::vector<int>{1, 8, 64} : std::vector<int>{1, 64};
  const std::vector<long long> lengths = quick  ? std::vector<long long>{4096}
                                         : full ? std::vector<long long>{4096, 32768, 131072}
                                                : std::vector<long long>{4096, 32768};
  const std::vector<int> groups = full ? std::vector<int>{4, 8} : std::vector<int>{4};
  for (int b : batches)
    for (long long S : lengths)
      for (int d : {64, 128})
        for (int group : groups) {
          const double fp16_bytes = 2.0 * b * S * (32 / group) * d * 2;
          if (fp16_bytes <= 0.4 * static_cast<double>(prop.totalGlobalMem)) shapes.push_back({b, d, 32 / group, group, S});
        }
  FILE* out = json != nullptr ? std::fopen(json, "w") : nullptr;
  if (out) std::fprintf(out, "{\"device\": \"%s\", \"copy_gbps\": %.1f, \"runs\": [\n", prop.name, copy_gbps);
  bool first = true;
  for (const BenchShape& sh : shapes)
    for (const Variant& var : variants) {
      Device dev;
      PoolView pool;
      BatchView batch;
      const std::size_t bytes = bench_pool(dev, sh, var.k, var.v, pool, batch);
      StepConfig config;
      config.meter = var.meter;
      config.splits = default_splits(sh.batch, sh.kv_heads, sh.S, prop.multiProcessorCount);
      const int q_heads = sh.kv_heads * sh.group;
      const Workspace ws = carve_workspace(dev.alloc(workspace_bytes(sh.batch, q_heads, config.splits, sh.d)), sh.batch, q_heads,
                                           config.splits, sh.d);
      check(set_up_kernels(sh.group, sh.d, pool.bands), "set_up_kernels");
      const double ms = time_ms(stream, [&] { check(attend_step(pool, batch, config, ws, nullptr, stream), "attend_step"); });
      const double gbps = bytes / (ms * 1e6);
      std::printf("%-12s meter %-3s B=%-3d S=%-6lld d=%-4d GQA %d:1 splits %-3d %9.3f ms  %7.0f GB/s  %5.1f%% of copy\n",
                  format_name(var.k), var.meter ? "on" : "off", sh.batch, sh.S, sh.d, sh.group, config.splits, ms, gbps,
                  100.0 * gbps / copy_gbps);
      if (out) {
        std::fprintf(out,
                     "%s  {\"format\": \"%s\", \"meter\": %s, \"batch\": %d, \"S\": %lld, \"d\": %d, \"q_heads\": %d, \"kv_heads\": %d, "
                     "\"splits\": %d, \"ms\": %.5f, \"bytes\": %zu, \"gbps\": %.1f}",
                     first ? "" : ",\n", format_name(var.k), var.meter ? "true" : "false", sh.batch, sh.S, sh.d, q_heads, sh.kv_heads,
                     config.splits, ms, bytes, gbps);
        first = false;
      }
    }
  if (out) {
    std::fprintf(out, "\n]}\n");
    std::fclose(out);
  }
  cudaStreamDestroy(stream);
  return 0;
}

}  // namespace
}  // namespace witcert::cuda

int main(int argc, char** argv) {
  bool test = false, bench = false, quick = false, full = false;
  const char* json = nullptr;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--test") test = true;
    else if (a == "--bench") bench = true;
    else if (a == "--quick") quick = true;
    else if (a == "--full") full = true;
    else if (a == "--json" && i + 1 < argc) json = argv[++i];
    else {
      std::fprintf(stderr, "usage: %s --test|--bench [--json FILE] [--quick | --full]\n", argv[0]);
      return 2;
    }
  }
  if (test == bench) {
    std::fprintf(stderr, "usage: %s --test|--bench [--json FILE] [--quick | --full]\n", argv[0]);
    return 2;
  }
  int devices = 0;
  const cudaError_t e = cudaGetDeviceCount(&devices);
  if (e != cudaSuccess || devices == 0) {
    std::printf("SKIPPED: no CUDA device (cudaGetDeviceCount: %s, %d devices); the GPU checks need one\n",
                e != cudaSuccess ? cudaGetErrorString(e) : "no error", devices);
    return witcert::cuda::kNoDevice;
  }
  try {
    return test ? witcert::cuda::run_tests(json) : witcert::cuda::run_bench(json, quick, full);
  } catch (const std::exception& ex) {
    std::fprintf(stderr, "error: %s\n", ex.what());
    return 1;
  }
}
