// The CUDA certified decode attention (docs/cuda.md): one launch sequence per decode step of one
// layer computes, for every sequence of the batch and every query head, the output and the meter
// over the pool's packed pages, with no host synchronisation and no allocation, so that a step can
// be captured in a CUDA graph.
//
//   split kernel   grid (splits, KV heads, batch): SplitBlock over a split's positions, the GQA
//                  group's query heads sharing each decoded K/V tile;
//   merge kernel   grid (batch · query heads): the split partials under LSE weights, the output and
//                  the head's meters (attention::finish);
//   summary kernel one block: the step's meter summary, copied to pinned host memory on the stream.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>

#include "attention/cuda/split_block.h"

namespace witcert::cuda {

// What the host reads of a step without waiting for it: coverage counts and maxima over the
// batch's query heads.
struct MeterSummary {
  unsigned heads = 0;
  unsigned k_covered = 0;     // meter ≤ τ_K
  unsigned v_covered = 0;     // V meter ≤ τ_V
  unsigned no_guarantee = 0;  // meter 1 with a non-finite raw score
  double meter_max = 0.0, v_meter_max = 0.0, eform_max = 0.0;
};

struct StepConfig {
  int splits = 1;
  bool meter = true;  // off: the uncertified kernel (float logits, no c_t), the fp16 baseline
  double tau_k = 0.2, tau_v = 0.05;
};

// The step's device buffers, carved by the caller from one allocation of workspace_bytes().
struct Workspace {
  StepBuffers buffers;
  MeterSummary* summary = nullptr;  // device
};

std::size_t workspace_bytes(int batch, int q_heads, int splits, int d);
// Views into `device_base` (at least workspace_bytes() bytes, 256-byte aligned).
Workspace carve_workspace(void* device_base, int batch, int q_heads, int splits, int d);

// A split count that gives the device at least two blocks per multiprocessor for the longest
// sequence, in whole tiles.
int default_splits(int batch, int kv_heads, long long max_ctx, int multiprocessors);

// Lets the split kernel take the shared memory of a group of `group` heads of d values (above the
// default 48 KiB); once per shape, before attend_step and outside any stream capture.
cudaError_t set_up_kernels(int group, int d, int bands);

// Enqueues one step on `stream` (after set_up_kernels for its shape): pool and batch hold device
// pointers; host_summary (pinned memory, or null) receives the summary when the stream reaches it.
// Returns the first launch error.
cudaError_t attend_step(const PoolView& pool, const BatchView& batch, const StepConfig& config, const Workspace& ws,
                        MeterSummary* host_summary, cudaStream_t stream);

}  // namespace witcert::cuda
