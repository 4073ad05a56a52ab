// A sparse delta's writes: dst[indices[i]] = values[i] for a flat, contiguous weight.
//
// The changed elements of an RL step are scattered across the weights (a 2 % delta touches about a quarter of the
// cache lines), so the write is bound by how many cache misses are in flight, not by bandwidth: each thread asks
// for the line of the write kPrefetch elements ahead (for writing), so the misses overlap instead of stalling one
// by one. torch's `index_copy_` (the fallback) issues them one at a time.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <atomic>
#include <cstdint>
#include <cstring>

namespace {

constexpr int64_t kPrefetch = 32;  // writes ahead whose lines are requested: enough misses in flight per core
constexpr int64_t kGrain = 16384;  // indices per task at least

template <typename E>
int64_t scatter_elements(E* dst, int64_t numel, const int64_t* indices, const E* values, int64_t n) {
  std::atomic<int64_t> outside{0};
  at::parallel_for(0, n, kGrain, [&](int64_t begin, int64_t end) {
    int64_t skipped = 0;
    for (int64_t i = begin; i < end; ++i) {
      if (i + kPrefetch < end) {
        const uint64_t ahead = static_cast<uint64_t>(indices[i + kPrefetch]);
        if (ahead < static_cast<uint64_t>(numel)) __builtin_prefetch(dst + ahead, 1, 3);
      }
      const uint64_t at = static_cast<uint64_t>(indices[i]);
      if (at < static_cast<uint64_t>(numel)) {
        dst[at] = values[i];
      } else {
        ++skipped;  // never written: the caller validated the indices, this only keeps memory safe
      }
    }
    if (skipped) outside += skipped;
  });
  return outside.load();
}

// dst (contiguous) viewed flat; indices int64 [n]; values [n] of dst's dtype (2, 4 or 8 bytes an element). A
// repeated index gets one of its values, as index_copy_. An index outside dst raises, after the others were written
// (callers check the range first).
void scatter_(at::Tensor dst, const at::Tensor& indices, const at::Tensor& values) {
  TORCH_CHECK(dst.device().is_cpu() && indices.device().is_cpu() && values.device().is_cpu(),
              "scatter_: CPU tensors only");
  TORCH_CHECK(dst.is_contiguous(), "scatter_: a contiguous destination");
  TORCH_CHECK(indices.scalar_type() == at::kLong && indices.dim() == 1 && indices.is_contiguous(),
              "scatter_: contiguous 1-D int64 indices");
  TORCH_CHECK(values.scalar_type() == dst.scalar_type() && values.dim() == 1 && values.is_contiguous() &&
                  values.numel() == indices.numel(),
              "scatter_: contiguous 1-D values of the destination's dtype, one per index");
  const int64_t n = indices.numel(), numel = dst.numel();
  const int64_t* ix = indices.data_ptr<int64_t>();
  int64_t outside = 0;
  switch (dst.element_size()) {
    case 2:
      outside = scatter_elements(static_cast<uint16_t*>(dst.data_ptr()), numel, ix,
                                 static_cast<const uint16_t*>(values.data_ptr()), n);
      break;
    case 4:
      outside = scatter_elements(static_cast<uint32_t*>(dst.data_ptr()), numel, ix,
                                 static_cast<const uint32_t*>(values.data_ptr()), n);
      break;
    case 8:
      outside = scatter_elements(static_cast<uint64_t*>(dst.data_ptr()), numel, ix,
                                 static_cast<const uint64_t*>(values.data_ptr()), n);
      break;
    default:
      TORCH_CHECK(false, "scatter_: 2-, 4- or 8-byte elements, got ", dst.scalar_type());
  }
  TORCH_CHECK(outside == 0, "scatter_: ", outside, " indices outside [0, ", numel, ") were not written");
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(hotswap, m) { m.def("scatter_(Tensor(a!) dst, Tensor indices, Tensor values) -> ()"); }

TORCH_LIBRARY_IMPL(hotswap, CPU, m) { m.impl("scatter_", &scatter_); }
