// The weight matrix product of the forward pass: Y = X · Wᵀ with W stored in a GGML type and
// activations kept in float (no activation quantization), so the engine tracks a scalar float
// reference to ~1e-5 relative.
#pragma once

#include <cstdint>

#include "base/thread_pool.h"
#include "formats/ggml/ggml_types.h"

namespace witcert::model {

// Row-major: row r is ggml_row_bytes(type, cols) bytes at data + r·row_bytes. In GGUF terms
// ne[0] = cols, ne[1] = rows.
struct WeightMatrix {
  formats::GgmlType type;
  const void* data;
  std::int64_t rows, cols;
};

// Y[t, r] = Σ_i W[r, i] · X[t, i] for t < tokens: X is tokens × cols floats, Y is tokens × rows
// floats. Rows are split across the pool's threads. Throws std::invalid_argument for a type
// without dequantization or cols not a whole number of blocks.
void matmul(const WeightMatrix& w, const float* x, std::int64_t tokens, float* y, ThreadPool& pool);

// The scalar reference of matmul: each row dequantized as llama.cpp does, products accumulated
// in double.
void matmul_reference(const WeightMatrix& w, const float* x, std::int64_t tokens, float* y);

// Row `row` of the matrix (an embedding table: the token id's vector) as cols floats. Throws
// std::out_of_range for a row outside [0, rows).
void embedding_row(const WeightMatrix& w, std::int64_t row, float* out);

}  // namespace witcert::model
