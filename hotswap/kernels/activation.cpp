// The gated activation of a SwiGLU MLP in one pass: silu_and_mul(x [T, 2I]) -> silu(x[:, :I]) * x[:, I:], [T, I].
// x may be row-strided (any row stride, contiguous rows). Matches torch's `F.silu(gate) * up`: silu is
// gate / (1 + exp(-gate)) in float32, rounded to the dtype, then the product is rounded again. float32 uses a
// vectorised exp (within 2 ulp of torch's); bfloat16 and float16 use std::exp.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cmath>
#include <cstring>

#include "kernels.h"
#include "simd.h"

namespace {

using namespace hotswap_simd;

void silu_mul_row(const float* gate, const float* up, float* out, int64_t n) {
  int64_t i = 0;
  for (; i + kWidth <= n; i += kWidth) {
    store(out + i, silu_mul(load(gate + i), load(up + i)));
  }
  if (i < n) {
    alignas(64) float g[kWidth] = {}, u[kWidth] = {}, o[kWidth];
    std::memcpy(g, gate + i, (n - i) * sizeof(float));
    std::memcpy(u, up + i, (n - i) * sizeof(float));
    store(o, silu_mul(load(g), load(u)));
    std::memcpy(out + i, o, (n - i) * sizeof(float));
  }
}

template <typename T>
void silu_mul_row(const T* gate, const T* up, T* out, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    const float g = static_cast<float>(gate[i]);
    const T silu = static_cast<T>(g / (1.f + std::exp(-g)));
    out[i] = static_cast<T>(static_cast<float>(silu) * static_cast<float>(up[i]));
  }
}

}  // namespace

namespace hotswap_ops {

at::Tensor silu_and_mul(const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.size(1) % 2 == 0 && x.stride(1) == 1,
              "silu_and_mul: x must be [T, 2 * I] with contiguous rows");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kHalf,
              "silu_and_mul: x must be float32, bfloat16 or float16");
  const int64_t T_ = x.size(0), n = x.size(1) / 2, ld = x.stride(0);
  at::Tensor out = at::empty({T_, n}, x.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "silu_and_mul", [&] {
    const scalar_t* xp = x.data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    at::parallel_for(0, T_, 4, [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) {
        silu_mul_row(xp + t * ld, xp + t * ld + n, op + t * n, n);  // float32: the vectorised overload
      }
    });
  });
  return out;
}

// 1 / (1 + exp(-x)) per element of a float32 tensor, every element through the same vector code (the tail padded
// to a whole vector): an element's result does not depend on where it sits, as torch's (a scalar tail) does.
at::Tensor sigmoid(const at::Tensor& x) {
  TORCH_CHECK(x.scalar_type() == at::kFloat, "sigmoid: x must be float32");
  const at::Tensor in = x.contiguous();
  at::Tensor out = at::empty_like(in);
  const float* xp = in.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t n = in.numel();
  int64_t i = 0;
  for (; i + kWidth <= n; i += kWidth) store(op + i, 1.f / (1.f + exp_clamped(-load(xp + i))));
  if (i < n) {
    alignas(64) float t[kWidth] = {};
    std::memcpy(t, xp + i, (n - i) * sizeof(float));
    store(t, 1.f / (1.f + exp_clamped(-load(t))));
    std::memcpy(op + i, t, (n - i) * sizeof(float));
  }
  return out;
}

}  // namespace hotswap_ops

TORCH_LIBRARY_FRAGMENT(hotswap, m) {
  m.def("silu_and_mul(Tensor x) -> Tensor");
  m.def("sigmoid(Tensor x) -> Tensor");
}

TORCH_LIBRARY_IMPL(hotswap, CPU, m) {
  m.impl("silu_and_mul", &hotswap_ops::silu_and_mul);
  m.impl("sigmoid", &hotswap_ops::sigmoid);
}
