// The largest magnitude in each of many float tensors, in one pass: what a weight update's value check reads.
//
// For IEEE floats of one format, the order of |x|'s bit patterns (sign cleared) is the order of |x|, and NaN and
// Inf lie above every finite value, so `max_magnitude_bits(t) <= bits(limit)` says every element of t is finite and
// at most `limit`. The check of an update reads every byte the update brings (hundreds of MB), one tensor after
// another: here the tensors are laid end to end and the threads split the whole run once (one fork, each thread a
// long sequential read), where a reduction per tensor forks and joins for every tensor, each thread reading a
// megabyte or two before it waits.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <mutex>
#include <vector>

namespace {

constexpr int64_t kLine = 64;
constexpr int64_t kGrainLines = 4096;  // 256 KiB: a thread's share is never smaller

// max over p[begin, end) of (p[i] & magnitude mask), as U
template <typename U>
U max_bits(const U* p, int64_t begin, int64_t end) {
  constexpr U kMagnitude = static_cast<U>(static_cast<U>(~U(0)) >> 1);
  constexpr int64_t kLanes = 64 / sizeof(U);
  typedef U uvec __attribute__((vector_size(64)));
  uvec m0 = {}, m1 = {}, m2 = {}, m3 = {};
  int64_t i = begin;
  for (; i + 4 * kLanes <= end; i += 4 * kLanes) {
    uvec v[4];
    __builtin_memcpy(v, p + i, sizeof(v));
    v[0] &= kMagnitude;
    v[1] &= kMagnitude;
    v[2] &= kMagnitude;
    v[3] &= kMagnitude;
    m0 = v[0] > m0 ? v[0] : m0;
    m1 = v[1] > m1 ? v[1] : m1;
    m2 = v[2] > m2 ? v[2] : m2;
    m3 = v[3] > m3 ? v[3] : m3;
  }
  m0 = m0 > m1 ? m0 : m1;
  m2 = m2 > m3 ? m2 : m3;
  m0 = m0 > m2 ? m0 : m2;
  U best = 0;
  for (int64_t l = 0; l < kLanes; ++l) best = std::max(best, m0[l]);
  for (; i < end; ++i) best = std::max(best, static_cast<U>(p[i] & kMagnitude));
  return best;
}

// For each tensor (contiguous CPU float, 2 or 4 bytes an element), the largest |x| bit pattern (sign cleared).
at::Tensor max_magnitude_bits(at::TensorList tensors) {
  const int64_t n = static_cast<int64_t>(tensors.size());
  std::vector<int64_t> first_line(n + 1, 0);  // each tensor padded to whole lines in one virtual run
  for (int64_t t = 0; t < n; ++t) {
    const at::Tensor& x = tensors[t];
    TORCH_CHECK(x.device().is_cpu() && x.is_contiguous() && x.is_floating_point() &&
                    (x.element_size() == 2 || x.element_size() == 4),
                "max_magnitude_bits: contiguous CPU float tensors of 2 or 4 bytes an element, got ", x.scalar_type());
    first_line[t + 1] = first_line[t] + (x.numel() * x.element_size() + kLine - 1) / kLine;
  }
  std::vector<int64_t> result(n, 0);
  std::mutex merge;
  at::parallel_for(0, first_line[n], kGrainLines, [&](int64_t begin, int64_t end) {
    std::vector<std::pair<int64_t, int64_t>> mine;  // (tensor, max bits) for the tensors this share touches
    int64_t t = std::upper_bound(first_line.begin(), first_line.end(), begin) - first_line.begin() - 1;
    for (; t < n && first_line[t] < end; ++t) {
      const at::Tensor& x = tensors[t];
      const int64_t size = x.element_size();
      const int64_t per_line = kLine / size;
      const int64_t lo = (std::max(begin, first_line[t]) - first_line[t]) * per_line;
      const int64_t hi = std::min((std::min(end, first_line[t + 1]) - first_line[t]) * per_line, x.numel());
      if (lo >= hi) continue;
      const int64_t best =
          size == 4 ? static_cast<int64_t>(max_bits(static_cast<const uint32_t*>(x.data_ptr()), lo, hi))
                    : static_cast<int64_t>(max_bits(static_cast<const uint16_t*>(x.data_ptr()), lo, hi));
      mine.emplace_back(t, best);
    }
    std::lock_guard<std::mutex> hold(merge);
    for (const auto& [index, best] : mine) result[index] = std::max(result[index], best);
  });
  return at::tensor(result, at::kLong);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(hotswap, m) { m.def("max_magnitude_bits(Tensor[] tensors) -> Tensor"); }

TORCH_LIBRARY_IMPL(hotswap, CPU, m) { m.impl("max_magnitude_bits", &max_magnitude_bits); }
