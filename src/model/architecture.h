// What sets one decoder architecture apart from the llama block, as data: the forward pass reads
// these traits and never the architecture's name. One entry per `general.architecture` value the
// engine runs; a GGUF of any other architecture is refused with the list of supported ones.
#pragma once

#include <string>
#include <vector>

#include "cert/witness.h"

namespace witcert::model {

enum class Activation {
  silu,       // SwiGLU: silu(gate) · up
  gelu_tanh,  // GeGLU: gelu(gate) · up, with gelu's tanh approximation
};

struct Architecture {
  std::string name;                       // general.architecture
  Activation mlp = Activation::silu;
  cert::RopeLayout rope_layout = cert::RopeLayout::interleaved;  // pairs (2j, 2j+1), or NeoX halves (j, j + d/2)
  bool qkv_bias = false;     // attn_{q,k,v}.bias added after the projections (Qwen 2)
  bool qk_norm = false;      // per-head RMSNorm of q and k before RoPE, attn_{q,k}_norm (Qwen 3, Gemma 3)
  bool post_norms = false;   // RMSNorm of each block's output before the residual add (Gemma 3)
  bool embed_scale = false;  // embeddings multiplied by √d_model (Gemma)
  // Sliding-window layers (Gemma 3): every layer except each swa_period-th attends to the last
  // `attention.sliding_window` positions with RoPE base swa_rope_theta; 0: every layer is global.
  int swa_period = 0;
  float swa_rope_theta = 10000.0f;
};

// The architecture of that name. Throws std::runtime_error naming it and the supported ones.
const Architecture& architecture(const std::string& name);
// Every supported name, in the order the error message lists them.
std::vector<std::string> supported_architectures();

}  // namespace witcert::model
