// The benchmark of the GPU check (scripts/gpu-check.sh, docs/cuda.md): one decode step of one layer
// per format and shape on pools filled on the device, timed with CUDA events, against a measured
// device-to-device copy bandwidth.
#include "attention/cuda/cuda_bench.h"

#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <random>
#include <vector>

#include "attention/cuda/attention.h"
#include "attention/cuda/device_buffers.h"
#include "attention/cuda/test_stores.h"

namespace witcert::cuda {
namespace {

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

}  // namespace

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

}  // namespace witcert::cuda
