// A pool in the CUDA kernel's layout (pool_view.h), filled from the CPU pool's sequences: every
// logical page a sequence has written, of every (layer, KV head), copied from its KvStore's raw
// pages to a page of the mirror in a shuffled order. The host tests read it with the shared
// per-token math; the GPU tests upload it. Writing tokens on the device is not part of this.
#pragma once

#include <cstdint>
#include <vector>

#include "attention/cuda/pool_view.h"
#include "kvcache/kv_store.h"

namespace witcert::cuda {

// The arrays of a PoolView and a BatchView, owned on the host.
struct HostPool {
  PoolView shape;  // sizes and formats; pointers unset
  std::vector<std::uint16_t> k_rows, v_rows, k_meta, v_meta, k_outliers;
  std::vector<std::uint8_t> k_packed, v_packed;
  std::vector<std::int8_t> k_codes, v_codes;
  std::vector<std::uint32_t> page_counter, slot_counter;
  PoolView view() const;
};

struct HostBatch {
  BatchView shape;
  std::vector<std::int32_t> n_ctx, page_table, shared_end;
  std::vector<std::int16_t> k_packed_rows, v_packed_rows;
  std::vector<std::int8_t> outlier_rank;
  std::vector<double> kappa, sm;
  std::vector<float> q;
  BatchView view() const;
};

// The format a CUDA kernel runs for one side of a store; throws std::invalid_argument for one it
// does not have (the registry's other schemes, dither-int8 keys without dither).
Format cuda_format(const kvcache::KvStore& store, formats::KvSide side);

// tail + bias of cert::subgaussian_radius for S tokens, δ_loc and D non-outlier channels, in the same
// operations, so that u_t = ς_t·κ·margin reproduces it.
double subgaussian_kappa(long S, double delta_loc, int non_outlier_channels);

// The mirror of `stores` (one sequence each, all of the same configuration) for a decode step of
// `layer`: sequence s attends positions [0, n_ctx[s]) with queries q[s] (kv_heads·group × d floats
// each) and Lemma 2's budget delta_loc. shuffle_seed orders the mirror's pages.
void mirror(const std::vector<const kvcache::KvStore*>& stores, const std::vector<std::int64_t>& n_ctx, int layer, int group,
            const std::vector<std::vector<float>>& q, double delta_loc, std::uint64_t shuffle_seed, HostPool& pool,
            HostBatch& batch);

}  // namespace witcert::cuda
