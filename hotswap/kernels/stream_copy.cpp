// A byte copy whose stores bypass the caches (non-temporal stores), for weights written into place.
//
// An ordinary store to a line that is not cached first reads the line (read-for-ownership), so copying N bytes
// moves 3N through memory; streaming stores write whole lines without reading them (2N), and do not evict what
// the caches hold. For a destination far larger than the caches (a weight update writes every weight once) this is
// the cheaper copy; for a small one it is not (the data is not in cache afterwards), so the facade takes it only
// for large destinations and where the calibration measured it faster (hotswap/kernels/ops.py `copy_`).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

constexpr int64_t kLine = 64;          // bytes per cache line, the unit one thread streams
constexpr int64_t kGrainLines = 4096;  // 256 KiB per task at least: threads share long runs of lines

// Copies `lines` whole 64-byte lines from src to dst (dst 64-byte aligned) with streaming stores, then fences so
// the stores are visible before the op returns.
void stream_lines(char* dst, const char* src, int64_t lines) {
#if defined(__AVX512F__)
  for (int64_t i = 0; i < lines; ++i) {
    _mm512_stream_si512(reinterpret_cast<__m512i*>(dst + i * kLine),
                        _mm512_loadu_si512(reinterpret_cast<const void*>(src + i * kLine)));
  }
  _mm_sfence();
#elif defined(__AVX2__)
  for (int64_t i = 0; i < lines; ++i) {
    const __m256i* s = reinterpret_cast<const __m256i*>(src + i * kLine);
    __m256i* d = reinterpret_cast<__m256i*>(dst + i * kLine);
    _mm256_stream_si256(d, _mm256_loadu_si256(s));
    _mm256_stream_si256(d + 1, _mm256_loadu_si256(s + 1));
  }
  _mm_sfence();
#else
  std::memcpy(dst, src, static_cast<size_t>(lines * kLine));
#endif
}

// dst <- src, byte for byte: same dtype, both contiguous, the same number of elements, not overlapping.
void stream_copy_(at::Tensor dst, const at::Tensor& src) {
  TORCH_CHECK(dst.device().is_cpu() && src.device().is_cpu(), "stream_copy_: CPU tensors only");
  TORCH_CHECK(dst.scalar_type() == src.scalar_type(), "stream_copy_: dtypes differ (", dst.scalar_type(), " vs ",
              src.scalar_type(), ")");
  TORCH_CHECK(dst.is_contiguous() && src.is_contiguous(), "stream_copy_: contiguous tensors only");
  TORCH_CHECK(dst.numel() == src.numel(), "stream_copy_: sizes differ (", dst.numel(), " vs ", src.numel(), ")");
  const int64_t n = dst.numel() * static_cast<int64_t>(dst.element_size());
  char* d = static_cast<char*>(dst.data_ptr());
  const char* s = static_cast<const char*>(src.data_ptr());
  TORCH_CHECK(d + n <= s || s + n <= d, "stream_copy_: the tensors overlap");
  int64_t head = static_cast<int64_t>((kLine - (reinterpret_cast<uintptr_t>(d) & (kLine - 1))) & (kLine - 1));
  head = std::min(head, n);
  std::memcpy(d, s, static_cast<size_t>(head));
  const int64_t lines = (n - head) / kLine;
  char* db = d + head;
  const char* sb = s + head;
  at::parallel_for(0, lines, kGrainLines, [&](int64_t begin, int64_t end) {
    stream_lines(db + begin * kLine, sb + begin * kLine, end - begin);
  });
  const int64_t done = head + lines * kLine;
  std::memcpy(d + done, s + done, static_cast<size_t>(n - done));
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(hotswap, m) { m.def("stream_copy_(Tensor(a!) dst, Tensor src) -> ()"); }

TORCH_LIBRARY_IMPL(hotswap, CPU, m) { m.impl("stream_copy_", &stream_copy_); }
