// The fixed randomized Hadamard rotation of rot-4bit (TurboQuant-style):
//   R = H_n·D/√n,   D = diag(σ_0, …, σ_{n−1}), σ_c = ±1 from a fixed seed,
// with H_n the Sylvester–Hadamard matrix (H_1 = 1, H_2n = [H_n H_n; H_n −H_n]). R is orthogonal, so a
// quantization error made after rotating has the same Euclidean norm once rotated back, while
// the rotation spreads a massive-activation channel over every coordinate.
#pragma once

#include <span>

namespace witcert::formats {

// x ← H_n·x/√n in place (the fast Walsh–Hadamard transform, orthonormal and its own inverse).
// n = x.size() must be a power of two.
void fwht_orthonormal(std::span<double> x);

// σ_c: bit c of a fixed Philox stream, 1 ↦ −1. It does not depend on n, so a channel keeps its
// sign at every head dimension.
double rotation_sign(int c);

void rotate(std::span<double> x);    // x ← R·x
void unrotate(std::span<double> y);  // y ← Rᵀ·y = D·H_n·y/√n

}  // namespace witcert::formats
