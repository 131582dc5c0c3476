#include "quant/ggml_types.h"

#include <stdexcept>
#include <string>

namespace witcert::quant {
namespace {

constexpr GgmlTypeInfo kTypes[] = {
    {GgmlType::F32, "F32", 1, 4, true},        {GgmlType::F16, "F16", 1, 2, true},
    {GgmlType::Q4_0, "Q4_0", 32, 18, true},    {GgmlType::Q4_1, "Q4_1", 32, 20, true},
    {GgmlType::Q5_0, "Q5_0", 32, 22, true},    {GgmlType::Q5_1, "Q5_1", 32, 24, true},
    {GgmlType::Q8_0, "Q8_0", 32, 34, true},    {GgmlType::Q8_1, "Q8_1", 32, 36, false},
    {GgmlType::Q2_K, "Q2_K", 256, 84, false},  {GgmlType::Q3_K, "Q3_K", 256, 110, false},
    {GgmlType::Q4_K, "Q4_K", 256, 144, true},  {GgmlType::Q5_K, "Q5_K", 256, 176, false},
    {GgmlType::Q6_K, "Q6_K", 256, 210, true},  {GgmlType::Q8_K, "Q8_K", 256, 292, false},
    {GgmlType::IQ4_NL, "IQ4_NL", 32, 18, true}, {GgmlType::I8, "I8", 1, 1, false},
    {GgmlType::I16, "I16", 1, 2, false},       {GgmlType::I32, "I32", 1, 4, false},
    {GgmlType::I64, "I64", 1, 8, false},       {GgmlType::F64, "F64", 1, 8, false},
    {GgmlType::BF16, "BF16", 1, 2, true},
};

}  // namespace

const GgmlTypeInfo* ggml_type_info(std::uint32_t id) {
  for (const GgmlTypeInfo& info : kTypes)
    if (static_cast<std::uint32_t>(info.type) == id) return &info;
  return nullptr;
}

std::size_t ggml_row_bytes(GgmlType t, std::int64_t n) {
  const GgmlTypeInfo* info = ggml_type_info(t);
  if (!info) throw std::invalid_argument("unknown tensor type id " + std::to_string(static_cast<std::uint32_t>(t)));
  if (n < 0 || n % info->block_size != 0)
    throw std::invalid_argument(std::string(info->name) + " rows must be a multiple of " +
                                std::to_string(info->block_size) + " elements, got " + std::to_string(n));
  return static_cast<std::size_t>(n / info->block_size) * info->block_bytes;
}

}  // namespace witcert::quant
