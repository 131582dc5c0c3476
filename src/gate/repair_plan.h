// Which pages a triggered gate promotes (§6.3.5). Head granularity takes every unpromoted page of
// the (layer, KV head), request granularity every page of the request; block granularity plans
// with p̃ held fixed: K pages by decreasing term of A until every head's ½(A² − 1) would be within
// τ_K, then V pages by decreasing term of Σ p̃_t ρ^v_t until every head's V meter would be within
// τ_V (a page taken for one side lowers the other's sum too).
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "attn/certified_attention.h"
#include "cache/kv_store.h"
#include "gate/policy.h"

namespace witcert::gate {

// Narrows `order` (the unpromoted pages of [0, ctx.S)) to the block plan for the group's step, at
// least one page; false when no plan can be made (a non-finite term), leaving every page in it.
bool plan_blocks(cache::KvStore::Reader& reader, const float* q, int head_dim, const attn::BoundContext& ctx,
                 const Policy& policy, std::span<const attn::HeadPartial> partials,
                 std::span<const attn::HeadResult> results, std::vector<std::int64_t>& order);

}  // namespace witcert::gate
