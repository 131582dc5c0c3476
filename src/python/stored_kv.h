// What an engine's paged cache stored, read back per slot: the keys and values of vLLM's CPU cache in
// each of its layouts and element types (python/witcert/vllm/layouts.py is the reference these
// readers are tested against, element for element).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

namespace witcert::python {

// The order of a (block, KV head)'s elements: keys then values, each block_size × head_dim.
enum class StoredLayout {
  vec,  // keys [head_dim][block_size], values [block_size][head_dim]
  amx,  // keys [block_size/16][head_dim/2][16][2], values [head_dim/16][block_size/2][16][2]
};
// One stored element: the model's float32, float16 or bfloat16, or one byte of fp8.
enum class StoredElement { f32, f16, bf16, e4m3, e5m2 };

// Throws std::invalid_argument naming the unknown name.
StoredLayout stored_layout(const std::string& name);
StoredElement stored_element(const std::string& name);
std::size_t element_bytes(StoredElement e);

struct StoredShape {
  std::int64_t blocks, kv_heads, block_size, head_dim;
};

// The exact value of one stored element (fp8 and the 16-bit floats widen exactly to float).
float stored_value(const std::uint8_t* p, StoredElement e);

// Keys and values of `slot` (block slot / block_size, offset slot % block_size) for every KV head,
// times k_scale and v_scale: k and v receive kv_heads × head_dim floats each. The caller checks the
// slot is within the cache and the shape suits the layout (amx: multiples of 16).
void read_stored(const std::uint8_t* cache, const StoredShape& s, StoredLayout layout, StoredElement e,
                 std::int64_t slot, float k_scale, float v_scale, float* k, float* v);

}  // namespace witcert::python
