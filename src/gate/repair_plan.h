// Which pages a triggered gate promotes (§6.3.5). Head granularity takes every unpromoted page of
// the (layer, KV head), request granularity every page of the request; block granularity plans
// with p̃ held fixed: K pages by decreasing term of A until every head's ½(A² − 1) would be within
// τ_K, then V pages by decreasing term of Σ p̃_t ρ^v_t until every head's V meter would be within
// τ_V (a page taken for one side lowers the other's sum too).
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "attention/reference/certified_attention.h"
#include "gate/policy.h"
#include "kvcache/kv_store.h"

namespace witcert::gate {

// Narrows `order` (the unpromoted pages of the step's range [begin, end)) to the block plan for the
// group's step, at least one page; false when no plan can be made (a non-finite term), leaving
// every page in it.
bool plan_blocks(kvcache::KvStore::Reader& reader, const float* q, int head_dim, std::int64_t begin, std::int64_t end,
                 const attention::BoundContext& ctx, const Policy& policy, std::span<const attention::HeadPartial> partials,
                 std::span<const attention::HeadResult> results, std::vector<std::int64_t>& order);

}  // namespace witcert::gate
