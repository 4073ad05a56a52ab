// Fused elementwise steps of a decoder layer, each one pass over its rows instead of several torch ops.
// Every op computes in float32 and rounds to the input dtype where the Hugging Face reference does:
//   rms_norm(x [T, H], w [H], eps)                 -> w * to_dtype(x * rsqrt(mean(x^2) + eps))
//   add_rms_norm(x [T, H], residual [T, H], w, eps) residual += x (in place), then returns rms_norm(residual)
//   rotary(q [T, H, D], k [T, KVH, D], positions [T] int64, cos [P, D], sin [P, D])
//                                                  -> (q * cos + rotate_half(q) * sin, same for k), contiguous;
//                                                     q and k may be row-strided views (e.g. slices of qkv)
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <tuple>

#include "kernels.h"

// No fused multiply-adds: torch rounds each product before the add, and these ops reproduce its rounding.
#pragma GCC optimize("fp-contract=off")

namespace {

constexpr int kLanes = 16;
constexpr int64_t kRowGrain = 16;  // rows per parallel task for rotary: the ops are cheap per row
// Norm rows per parallel task: about 64 Ki elements, below which waking a second thread costs more than it saves
// (a decode batch's norm runs on the calling thread).
inline int64_t norm_grain(int64_t n) { return std::max<int64_t>(1, 65536 / std::max<int64_t>(n, 1)); }

template <typename T>
float sum_squares(const T* x, int64_t n) {
  float lanes[kLanes] = {};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    for (int l = 0; l < kLanes; ++l) {
      const float v = static_cast<float>(x[i + l]);
      lanes[l] += v * v;
    }
  }
  float sum = 0.f;
  for (int l = 0; l < kLanes; ++l) sum += lanes[l];
  for (; i < n; ++i) sum += static_cast<float>(x[i]) * static_cast<float>(x[i]);
  return sum;
}

template <typename T>
void norm_row(const T* x, const T* w, T* out, int64_t n, float eps) {
  const float inv = 1.f / std::sqrt(sum_squares(x, n) / static_cast<float>(n) + eps);
  for (int64_t i = 0; i < n; ++i) {
    const T normed = static_cast<T>(static_cast<float>(x[i]) * inv);  // rounded to T before the weight, as in HF
    out[i] = static_cast<T>(static_cast<float>(w[i]) * static_cast<float>(normed));
  }
}

void check_rows(const at::Tensor& x, const at::Tensor& w) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "x must be a contiguous [T, H] tensor");
  TORCH_CHECK(w.dim() == 1 && w.is_contiguous() && w.size(0) == x.size(1) && w.scalar_type() == x.scalar_type(),
              "weight must be [H] in x's dtype");
}

}  // namespace

namespace hotswap_ops {

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  check_rows(x, weight);
  at::Tensor out = at::empty_like(x);
  const int64_t rows = x.size(0), n = x.size(1);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "rms_norm", [&] {
    const scalar_t* xp = x.data_ptr<scalar_t>();
    const scalar_t* wp = weight.data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    at::parallel_for(0, rows, norm_grain(n), [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) norm_row(xp + r * n, wp, op + r * n, n, static_cast<float>(eps));
    });
  });
  return out;
}

at::Tensor add_rms_norm(const at::Tensor& x, at::Tensor residual, const at::Tensor& weight, double eps) {
  check_rows(x, weight);
  TORCH_CHECK(residual.sizes() == x.sizes() && residual.is_contiguous() && residual.scalar_type() == x.scalar_type(),
              "residual must match x");
  at::Tensor out = at::empty_like(x);
  const int64_t rows = x.size(0), n = x.size(1);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "add_rms_norm", [&] {
    const scalar_t* xp = x.data_ptr<scalar_t>();
    scalar_t* rp = residual.data_ptr<scalar_t>();
    const scalar_t* wp = weight.data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    at::parallel_for(0, rows, norm_grain(n), [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        scalar_t* res = rp + r * n;
        for (int64_t i = 0; i < n; ++i) {
          res[i] = static_cast<scalar_t>(static_cast<float>(res[i]) + static_cast<float>(xp[r * n + i]));
        }
        norm_row(res, wp, op + r * n, n, static_cast<float>(eps));
      }
    });
  });
  return out;
}

}  // namespace hotswap_ops

namespace {

template <typename T>
void rotate_rows(const T* src, int64_t heads, int64_t D, const float* cos, const float* sin, T* dst) {
  const int64_t half = D / 2;
  for (int64_t h = 0; h < heads; ++h) {
    const T* x = src + h * D;
    T* y = dst + h * D;
    for (int64_t d = 0; d < half; ++d) {
      // rotate_half(x)[d] = -x[d + half]; rotate_half(x)[d + half] = x[d]; each product rounds to T as in torch
      const T c0 = static_cast<T>(cos[d]), s0 = static_cast<T>(sin[d]);
      const T c1 = static_cast<T>(cos[d + half]), s1 = static_cast<T>(sin[d + half]);
      const T a = x[d], b = x[d + half];
      y[d] = static_cast<T>(static_cast<T>(a * c0) + static_cast<T>(static_cast<T>(-b) * s0));
      y[d + half] = static_cast<T>(static_cast<T>(b * c1) + static_cast<T>(a * s1));
    }
  }
}

std::tuple<at::Tensor, at::Tensor> rotary(const at::Tensor& q, const at::Tensor& k, const at::Tensor& positions,
                                          const at::Tensor& cos, const at::Tensor& sin) {
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3, "bad q/k shapes");
  at::Tensor q_out = at::empty({q.size(0), q.size(1), q.size(2)}, q.options());
  at::Tensor k_out = at::empty({k.size(0), k.size(1), k.size(2)}, k.options());
  hotswap_ops::rotate_qk(q, k, positions, cos, sin, q_out, k_out.data_ptr(), nullptr);
  return {q_out, k_out};
}

}  // namespace

namespace hotswap_ops {

void rotate_qk(const at::Tensor& q, const at::Tensor& k, const at::Tensor& positions, const at::Tensor& cos,
               const at::Tensor& sin, at::Tensor& q_out, void* k_out, const int64_t* k_rows) {
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && q.size(0) == k.size(0) && q.size(2) == k.size(2), "bad q/k shapes");
  TORCH_CHECK(q.stride(2) == 1 && q.stride(1) == q.size(2) && k.stride(2) == 1 && k.stride(1) == k.size(2),
              "q and k must have contiguous heads");
  TORCH_CHECK(q.scalar_type() == k.scalar_type(), "q and k dtypes differ");
  const int64_t T_ = q.size(0), H = q.size(1), KVH = k.size(1), D = q.size(2);
  TORCH_CHECK(D % 2 == 0, "head_dim must be even");
  TORCH_CHECK(cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat && cos.is_contiguous() &&
                  sin.is_contiguous() && cos.dim() == 2 && cos.size(1) == D && sin.sizes() == cos.sizes(),
              "cos/sin must be float32 [P, head_dim]");
  TORCH_CHECK(positions.scalar_type() == at::kLong && positions.is_contiguous() && positions.numel() == T_,
              "positions must be int64 [T]");
  const int64_t* pos = positions.data_ptr<int64_t>();
  for (int64_t t = 0; t < T_; ++t) TORCH_CHECK(pos[t] >= 0 && pos[t] < cos.size(0), "position out of range");
  TORCH_CHECK(q_out.is_contiguous() && q_out.sizes() == q.sizes() && q_out.scalar_type() == q.scalar_type(),
              "q_out must be a contiguous tensor like q");
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "rotary", [&] {
    const scalar_t* qp = q.data_ptr<scalar_t>();
    const scalar_t* kp = k.data_ptr<scalar_t>();
    scalar_t* qo = q_out.data_ptr<scalar_t>();
    scalar_t* ko = static_cast<scalar_t*>(k_out);
    const float* cp = cos.data_ptr<float>();
    const float* sp = sin.data_ptr<float>();
    at::parallel_for(0, T_, kRowGrain, [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) {
        const float* c = cp + pos[t] * D;
        const float* s = sp + pos[t] * D;
        rotate_rows(qp + t * q.stride(0), H, D, c, s, qo + t * H * D);
        rotate_rows(kp + t * k.stride(0), KVH, D, c, s, ko + (k_rows != nullptr ? k_rows[t] : t) * KVH * D);
      }
    });
  });
}

}  // namespace hotswap_ops

TORCH_LIBRARY_FRAGMENT(hotswap, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("add_rms_norm(Tensor x, Tensor(a!) residual, Tensor weight, float eps) -> Tensor");
  m.def("rotary(Tensor q, Tensor k, Tensor positions, Tensor cos, Tensor sin) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(hotswap, CPU, m) {
  m.impl("rms_norm", &hotswap_ops::rms_norm);
  m.impl("add_rms_norm", &hotswap_ops::add_rms_norm);
  m.impl("rotary", &rotary);
}
