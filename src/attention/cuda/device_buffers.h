// Host-side helpers of the GPU check and benchmark: CUDA errors as exceptions, and device copies of
// the mirror's arrays freed together.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <stdexcept>
#include <string>
#include <vector>

#include "attention/cuda/mirror.h"

namespace witcert::cuda {

inline void check(cudaError_t e, const char* what) {
  if (e != cudaSuccess) throw std::runtime_error(std::string(what) + ": " + cudaGetErrorString(e));
}

// Device copies of host arrays, freed together.
class Device {
 public:
  Device() = default;
  Device(const Device&) = delete;
  Device& operator=(const Device&) = delete;
  ~Device() {
    for (void* p : owned_) cudaFree(p);
  }
  void* alloc(std::size_t bytes) {
    void* p = nullptr;
    check(cudaMalloc(&p, std::max<std::size_t>(bytes, 16)), "cudaMalloc");
    owned_.push_back(p);
    return p;
  }
  template <class T>
  const T* copy(const std::vector<T>& v) {
    if (v.empty()) return nullptr;
    void* p = alloc(v.size() * sizeof(T));
    check(cudaMemcpy(p, v.data(), v.size() * sizeof(T), cudaMemcpyHostToDevice), "cudaMemcpy");
    return static_cast<const T*>(p);
  }
  PoolView pool(const HostPool& h) {
    PoolView p = h.shape;
    p.k.rows = copy(h.k_rows), p.v.rows = copy(h.v_rows);
    p.k.meta = copy(h.k_meta), p.v.meta = copy(h.v_meta);
    p.k.packed = copy(h.k_packed), p.v.packed = copy(h.v_packed);
    p.k.codes = copy(h.k_codes), p.v.codes = copy(h.v_codes);
    p.k.outliers = copy(h.k_outliers);
    p.page_counter = copy(h.page_counter), p.slot_counter = copy(h.slot_counter);
    return p;
  }
  BatchView batch(const HostBatch& h) {
    BatchView b = h.shape;
    b.n_ctx = copy(h.n_ctx), b.page_table = copy(h.page_table), b.shared_end = copy(h.shared_end);
    b.k_packed_rows = copy(h.k_packed_rows), b.v_packed_rows = copy(h.v_packed_rows);
    b.outlier_rank = copy(h.outlier_rank), b.kappa = copy(h.kappa), b.sm = copy(h.sm), b.q = copy(h.q);
    return b;
  }

 private:
  std::vector<void*> owned_;
};

}  // namespace witcert::cuda
