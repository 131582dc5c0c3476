#include "attention/cuda/attention.h"

namespace witcert::cuda {
namespace {

std::size_t align256(std::size_t n) { return (n + 255) / 256 * 256; }

template <bool Meter>
__global__ void split_kernel(PoolView pool, BatchView batch, StepBuffers out, int splits) {
  extern __shared__ __align__(16) unsigned char shared[];
  Shared s;
  carve(shared, batch.group, pool.d, pool.bands, &s);
  SplitBlock<Meter> b(pool, batch, out, s, blockIdx.z, blockIdx.y, blockIdx.x, splits);
  const int tid = threadIdx.x;
  b.begin(tid);
  __syncthreads();
  if constexpr (Meter) {
    b.norms(tid);
    __syncthreads();
  }
  while (b.more_tiles()) {
    b.locate(tid);
    __syncthreads();
    b.decode(tid);
    __syncthreads();
    b.logits(tid);
    __syncthreads();
    b.maxima(tid);
    __syncthreads();
    b.weights(tid);
    __syncthreads();
    b.accumulate(tid);
    __syncthreads();
    b.next_tile();
  }
  b.end(tid);
}

__global__ void merge_kernel(StepBuffers out, int splits, int d) {
  extern __shared__ __align__(16) unsigned char shared[];
  MergeBlock m;
  m.out = out;
  m.splits = splits;
  m.d = d;
  m.head = blockIdx.x;
  m.merged = reinterpret_cast<HeadState*>(shared);
  m.factors = reinterpret_cast<double*>(shared + align16(sizeof(HeadState)));
  m.states(threadIdx.x);
  __syncthreads();
  m.channels(threadIdx.x, blockDim.x);
}

// One thread: a step has at most a few thousand query heads, and the summary is a few bytes.
__global__ void summary_kernel(const HeadReport* reports, int heads, double tau_k, double tau_v, MeterSummary* summary) {
  if (threadIdx.x != 0 || blockIdx.x != 0) return;
  MeterSummary s;
  s.heads = static_cast<unsigned>(heads);
  for (int i = 0; i < heads; ++i) {
    const HeadReport& r = reports[i];
    s.k_covered += r.meter <= tau_k;
    s.v_covered += r.v_meter <= tau_v;
    s.no_guarantee += !is_finite(r.eform_raw);
    s.meter_max = max_of(s.meter_max, r.meter);
    s.v_meter_max = max_of(s.v_meter_max, r.v_meter);
    s.eform_max = max_of(s.eform_max, r.eform_raw);
  }
  *summary = s;
}

struct Sizes {
  std::size_t states, acc, out, reports, summary;
};

Sizes sizes(int batch, int q_heads, int splits, int d) {
  const std::size_t heads = static_cast<std::size_t>(batch) * q_heads;
  return {align256(heads * splits * sizeof(HeadState)), align256(heads * splits * d * sizeof(double)),
          align256(heads * d * sizeof(float)), align256(heads * sizeof(HeadReport)), align256(sizeof(MeterSummary))};
}

}  // namespace

std::size_t workspace_bytes(int batch, int q_heads, int splits, int d) {
  const Sizes s = sizes(batch, q_heads, splits, d);
  return s.states + s.acc + s.out + s.reports + s.summary;
}

Workspace carve_workspace(void* device_base, int batch, int q_heads, int splits, int d) {
  const Sizes s = sizes(batch, q_heads, splits, d);
  auto* p = static_cast<unsigned char*>(device_base);
  Workspace w;
  w.buffers.states = reinterpret_cast<HeadState*>(p);
  w.buffers.acc = reinterpret_cast<double*>(p += s.states);
  w.buffers.out = reinterpret_cast<float*>(p += s.acc);
  w.buffers.reports = reinterpret_cast<HeadReport*>(p += s.out);
  w.summary = reinterpret_cast<MeterSummary*>(p += s.reports);
  return w;
}

int default_splits(int batch, int kv_heads, long long max_ctx, int multiprocessors) {
  const long long blocks = static_cast<long long>(batch) * kv_heads;
  const long long want = (2LL * multiprocessors + blocks - 1) / blocks;
  const long long tiles = (max_ctx + kTile - 1) / kTile;
  const long long splits = want < tiles ? want : tiles;
  return static_cast<int>(splits < 1 ? 1 : (splits > 256 ? 256 : splits));
}

cudaError_t set_up_kernels(int group, int d, int bands) {
  const int bytes = static_cast<int>(shared_bytes(group, d, bands));
  if (cudaError_t e = cudaFuncSetAttribute(split_kernel<true>, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes); e != cudaSuccess)
    return e;
  return cudaFuncSetAttribute(split_kernel<false>, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes);
}

cudaError_t attend_step(const PoolView& pool, const BatchView& batch, const StepConfig& config, const Workspace& ws,
                        MeterSummary* host_summary, cudaStream_t stream) {
  if (batch.group < 1 || batch.group > kMaxGroup || pool.d % kGroup != 0 || pool.d > kMaxHeadDim || config.splits < 1)
    return cudaErrorInvalidValue;
  const std::size_t bytes = shared_bytes(batch.group, pool.d, pool.bands);
  const dim3 grid(config.splits, pool.kv_heads, batch.batch);
  const int threads = block_threads(batch.group);
  if (config.meter)
    split_kernel<true><<<grid, threads, bytes, stream>>>(pool, batch, ws.buffers, config.splits);
  else
    split_kernel<false><<<grid, threads, bytes, stream>>>(pool, batch, ws.buffers, config.splits);
  if (cudaError_t e = cudaGetLastError(); e != cudaSuccess) return e;
  const int heads = batch.batch * pool.kv_heads * batch.group;
  const std::size_t merge_bytes = align16(sizeof(HeadState)) + 2 * sizeof(double) * config.splits;
  merge_kernel<<<heads, 128, merge_bytes, stream>>>(ws.buffers, config.splits, pool.d);
  if (cudaError_t e = cudaGetLastError(); e != cudaSuccess) return e;
  summary_kernel<<<1, 32, 0, stream>>>(ws.buffers.reports, heads, config.tau_k, config.tau_v, ws.summary);
  if (cudaError_t e = cudaGetLastError(); e != cudaSuccess) return e;
  if (host_summary != nullptr)
    return cudaMemcpyAsync(host_summary, ws.summary, sizeof(MeterSummary), cudaMemcpyDeviceToHost, stream);
  return cudaSuccess;
}

}  // namespace witcert::cuda
