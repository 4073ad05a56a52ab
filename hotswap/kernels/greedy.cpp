// Greedy sampling of float32 logits in one call: greedy_sample(logits [R, V]) -> (tokens int64 [R], logprobs
// float32 [R]). tokens[r] is the first index of row r's maximum, as torch's max(dim=-1); logprobs[r] is that
// token's log-softmax, -log(sum_v exp(x_v - max)), without writing the [R, V] log-softmax a separate
// log_softmax + gather needs. A row holding NaN gives its first NaN and a NaN logprob, as torch does.
// Per row: its maximum (vectorised), the scan to that maximum's first index, then the sum of exponentials, over a
// row that stays in cache meanwhile; rows are split across threads.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cmath>
#include <limits>
#include <tuple>

#include "simd.h"

namespace {

using namespace hotswap_simd;

// The row's maximum, ignoring NaN, and whether it holds a NaN.
std::pair<float, bool> row_max(const float* x, int64_t V) {
  f16x m = f16x{} - INFINITY;
  auto nan = m != m;
  int64_t v = 0;
  for (; v + kWidth <= V; v += kWidth) {
    const f16x a = load(x + v);
    m = select_greater(a, m);
    nan |= a != a;
  }
  float out = -INFINITY;
  bool has_nan = false;
  for (int i = 0; i < kWidth; ++i) out = std::max(out, m[i]), has_nan |= nan[i] != 0;
  for (; v < V; ++v) {
    if (x[v] > out) out = x[v];
    has_nan |= std::isnan(x[v]);
  }
  return {out, has_nan};
}

float sum_exp(const float* x, int64_t V, float max) {
  f16x s = f16x{};
  int64_t v = 0;
  for (; v + kWidth <= V; v += kWidth) s += exp_clamped(load(x + v) - max);
  float out = hsum(s);
  for (; v < V; ++v) out += std::exp(x[v] - max);
  return out;
}

std::tuple<at::Tensor, at::Tensor> greedy_sample(const at::Tensor& logits) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == at::kFloat && logits.stride(1) == 1,
              "greedy_sample: logits must be float32 [R, V] with contiguous rows");
  TORCH_CHECK(logits.size(1) > 0, "greedy_sample: the vocabulary is empty");
  const int64_t R = logits.size(0), V = logits.size(1), ld = logits.stride(0);
  at::Tensor tokens = at::empty({R}, logits.options().dtype(at::kLong));
  at::Tensor logprobs = at::empty({R}, logits.options());
  const float* xp = logits.data_ptr<float>();
  int64_t* tp = tokens.data_ptr<int64_t>();
  float* lp = logprobs.data_ptr<float>();
  at::parallel_for(0, R, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* x = xp + r * ld;
      const auto [max, has_nan] = row_max(x, V);
      int64_t token = 0;
      if (has_nan) {
        while (!std::isnan(x[token])) ++token;
        tp[r] = token;
        lp[r] = std::numeric_limits<float>::quiet_NaN();
        continue;
      }
      while (x[token] != max) ++token;  // the first maximum (an all -inf row: 0)
      tp[r] = token;
      // As log_softmax: x - max is NaN at an infinite maximum.
      lp[r] = std::isfinite(max) ? -std::log(sum_exp(x, V, max)) : std::numeric_limits<float>::quiet_NaN();
    }
  });
  return {tokens, logprobs};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(hotswap, m) { m.def("greedy_sample(Tensor logits) -> (Tensor, Tensor)"); }

TORCH_LIBRARY_IMPL(hotswap, CPU, m) { m.impl("greedy_sample", &greedy_sample); }
