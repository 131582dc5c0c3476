// The GPU check (scripts/gpu-check.sh, docs/cuda.md): the CUDA kernel against the CPU scalar
// reference on a device, a CUDA graph replay of one step, and the benchmark (cuda_bench.cu). It
// needs no test framework and no third-party library, so that a bare GPU machine builds it with
// nvcc alone.
//
//   witcert_cuda_check --test  [--json FILE]   exit 0: every check passed; 1: a failure; 77: no device
//   witcert_cuda_check --bench [--json FILE] [--quick | --full]
#include <cuda_runtime.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <memory>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

#include "attention/cuda/attention.h"
#include "attention/cuda/cuda_bench.h"
#include "attention/cuda/device_buffers.h"
#include "attention/cuda/mirror.h"
#include "attention/cuda/test_stores.h"
#include "formats/dither/dither.h"

namespace witcert::cuda {
namespace {

constexpr int kNoDevice = 77;  // ctest's SKIP_RETURN_CODE

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
  std::vector<std::unique_ptr<kvcache::KvStore>> stores;
  std::vector<std::vector<float>> q;
  HostPool pool;
  HostBatch batch;
  std::vector<std::vector<float>> want_out;
  std::vector<attention::HeadResult> want;
  std::vector<double> tv;

  Scenario(const testing::Formats& f, int page, const std::vector<std::int64_t>& lengths, int kv_heads_, int group_, int d_,
           std::uint64_t seed)
      : kv_heads(kv_heads_), group(group_), d(d_) {
    const std::int64_t capacity = *std::max_element(lengths.begin(), lengths.end());
    const kvcache::CacheConfig cfg = testing::config(f, layers, kv_heads, d, capacity, page, seed);
    std::vector<const kvcache::KvStore*> ptrs;
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
        kvcache::KvStore::Reader reader(*stores[s], layer, kv);
        for (int h = 0; h < group; ++h) {
          want_out.emplace_back(d);
          want.push_back(attention::finish(partials[h], d, want_out.back().data()));
          tv.push_back(attention::true_tv(reader, qk + h * d, d, 0, lengths[s]));
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
    const attention::HeadResult& w = sc.want[head];
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

// ξ drawn on the device, bit for bit formats::dither_values's.
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
    formats::dither_values({seeds[i], words[4 * i], words[4 * i + 1]}, words[4 * i + 2], cpu);
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
