// The GPU check's benchmark (cuda_bench.cu).
#pragma once

namespace witcert::cuda {

// Times one decode step per format and shape (--quick: S = 4096 only; --full: the whole
// matrix) and writes them to `json` (null: none). Returns the process exit status.
int run_bench(const char* json, bool quick, bool full);

}  // namespace witcert::cuda
