// Entry points of layer_ops.cpp for the other kernels of the library.
#pragma once

#include <ATen/ATen.h>

namespace hotswap_ops {

// Rotary embedding of q [T, H, D] and k [T, KVH, D] (contiguous heads, any token stride) for int64 `positions`
// [T] with float32 cos/sin tables [P, D], computed as the `rotary` op does. Rotated q goes to q_out (contiguous,
// q's shape and dtype); rotated k row t to k_out + r * KVH * D elements of k's dtype, where r = k_rows[t], or t
// when k_rows is null. The caller guarantees that k_out holds every row r.
void rotate_qk(const at::Tensor& q, const at::Tensor& k, const at::Tensor& positions, const at::Tensor& cos,
               const at::Tensor& sin, at::Tensor& q_out, void* k_out, const int64_t* k_rows);

}  // namespace hotswap_ops
