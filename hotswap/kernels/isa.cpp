// The vector ISA this build was compiled for, so Python can tell which kernels suit it: 512 (AVX-512F), 256
// (AVX2 with FMA), or 128 (anything else: SSE, NEON, or the compiler's generic vectors).
#include <torch/library.h>

#include <cstdint>

namespace {

int64_t vector_bits() {
#if defined(__AVX512F__)
  return 512;
#elif defined(__AVX2__) && defined(__FMA__)
  return 256;
#else
  return 128;
#endif
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(hotswap, m) { m.def("vector_bits() -> int", &vector_bits); }
