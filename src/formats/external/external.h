// The `external` scheme: the reconstruction of each token comes from the writer (a user's function
// outside the library), which hands it over for one write at a time through ExternalReconstruction.
#pragma once

#include <span>

#include "formats/schemes.h"

namespace witcert::formats {

// The scheme of one side; its blocks hold the reconstruction as head_dim floats.
const KvScheme& external_scheme(KvSide side);

// The reconstructions of the token being written, for the calling thread, while it lives: the key
// side's and the value side's (empty where that side is not external). Encoding an external block
// with none set throws std::logic_error.
class ExternalReconstruction {
 public:
  ExternalReconstruction(std::span<const float> key, std::span<const float> value);
  ~ExternalReconstruction();
  ExternalReconstruction(const ExternalReconstruction&) = delete;
  ExternalReconstruction& operator=(const ExternalReconstruction&) = delete;
};

}  // namespace witcert::formats
