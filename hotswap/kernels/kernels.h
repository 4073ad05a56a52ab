// The library's entry points that its files call across each other (the decoder stack chains them), declared
// once here: a call is a plain C++ call, checked by the compiler against the one definition, never a dispatcher
// lookup. Each is also registered as a torch operator under torch.ops.hotswap by the file that defines it.
#pragma once

#include <ATen/ATen.h>

#include <optional>

namespace hotswap_ops {

// layer_ops.cpp: weight * x / rms(x) per row of x [T, H], in float32, rounded to x's dtype.
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps);
// layer_ops.cpp: residual += x (in place), then rms_norm(residual).
at::Tensor add_rms_norm(const at::Tensor& x, at::Tensor residual, const at::Tensor& weight, double eps);

// Rotary embedding of q [T, H, D] and k [T, KVH, D] (contiguous heads, any token stride) for int64 `positions`
// [T] with float32 cos/sin tables [P, D], computed as the `rotary` op does. Rotated q goes to q_out (contiguous,
// q's shape and dtype); rotated k row t to k_out + r * KVH * D elements of k's dtype, where r = k_rows[t], or t
// when k_rows is null. The caller guarantees that k_out holds every row r.
void rotate_qk(const at::Tensor& q, const at::Tensor& k, const at::Tensor& positions, const at::Tensor& cos,
               const at::Tensor& sin, at::Tensor& q_out, void* k_out, const int64_t* k_rows);

// linear.cpp: y = x · wᵀ (+ bias) for a small float32 batch x [M, K], w [N, K].
at::Tensor small_batch_linear(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& bias,
                              int64_t split = 0);
// linear.cpp: silu(gate) * up of x · wᵀ (+ bias) for w = [gate; up] [2I, K]: [M, I].
at::Tensor small_batch_gated_linear(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& bias);

// linear_bf16.cpp: the same two products for a bfloat16 x and w (float32 sums, each output rounded once); the
// two entry points above take this path for a bfloat16 x.
at::Tensor small_batch_linear_bf16(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& bias,
                                   bool gated);

// activation.cpp: silu(x[:, :I]) * x[:, I:] for x [T, 2I] with contiguous rows.
at::Tensor silu_and_mul(const at::Tensor& x);

// paged_attention.cpp: rotary + write_kv_cache + paged attention in one call.
at::Tensor rope_paged_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                const at::Tensor& positions, const at::Tensor& cos, const at::Tensor& sin,
                                at::Tensor k_cache, at::Tensor v_cache, const at::Tensor& slot_mapping,
                                const at::Tensor& block_tables, const at::Tensor& context_lens,
                                const std::optional<at::Tensor>& query_lens,
                                const std::optional<at::Tensor>& kv_of_q, double scale);

}  // namespace hotswap_ops
