// Float32 linear layer for small batches (decode steps): y[M, N] = x[M, K] · w[N, K]ᵀ (+ bias[N]).
// small_batch_gated_linear(x, w [2I, K], bias [2I]?) is a SwiGLU MLP's fused gate/up projection with its gate
// applied on the way out: silu(x · gateᵀ + b_gate) * (x · upᵀ + b_up), [M, I], where gate = w[:I] and up = w[I:].
// Each thread computes matching gate and up tiles back to back, so the [M, 2I] projection never reaches memory.
//
// At decode batch sizes a linear layer streams its whole weight from DRAM for a few dozen FLOPs per element, and
// a BLAS spends much of the step re-packing that weight. This kernel reads the weight once, in its natural
// [N, K] layout, and keeps the small operand in cache instead:
//   - x is transposed per block of up to 64 rows into xt[K][16 * MV] (MV = 16-float vectors per k, rows past M
//     zero), which every weight row then meets as MV vector loads per k;
//   - a tile of R consecutive weight rows (one contiguous R * K run of memory) accumulates R x MV vectors of
//     output, each weight element broadcast into MV fused multiply-adds;
//   - while a tile computes, the next tile of the same thread is prefetched in the order it will be read (and xt
//     a few k ahead), so the DRAM stream overlaps the arithmetic.
// Threads split the output columns (rows of w; gated, a gate row and its up row each); each transposes x for
// itself, so one parallel region does the whole call.
// Per output element the sum runs over k in order, with fused multiply-adds (results differ from a BLAS in the
// last bits, as two BLAS builds do).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstring>
#include <vector>

#include "kernels.h"
#include "simd.h"

namespace {

using namespace hotswap_simd;

constexpr int64_t kBlockRows = 64;  // rows of x per block: MV <= 4
constexpr int64_t kXtAhead = 8;     // k distance of the prefetches into xt

// In-place transpose of a 16 x 16 block held as 16 vectors: four rounds, each swapping the off-diagonal
// sub-blocks of size s (8, 4, 2, 1) between row pairs (i, i + s).
#define HS_ROUND(S, LO, HI)                           \
  for (int i = 0; i < 16; ++i) {                      \
    if (i & (S)) continue;                            \
    const f16x a = r[i], b = r[i + (S)];              \
    r[i] = __builtin_shufflevector(a, b, LO);         \
    r[i + (S)] = __builtin_shufflevector(a, b, HI);   \
  }
#define HS_L8 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23
#define HS_H8 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31
#define HS_L4 0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27
#define HS_H4 4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29, 30, 31
#define HS_L2 0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29
#define HS_H2 2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31
#define HS_L1 0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28, 14, 30
#define HS_H1 1, 17, 3, 19, 5, 21, 7, 23, 9, 25, 11, 27, 13, 29, 15, 31

inline void transpose16(f16x* r) {
  HS_ROUND(8, HS_L8, HS_H8)
  HS_ROUND(4, HS_L4, HS_H4)
  HS_ROUND(2, HS_L2, HS_H2)
  HS_ROUND(1, HS_L1, HS_H1)
}

// xt[k][16 * v + i] = x[16 * v + i][k] for i < 16, v < MV; rows at or past `rows` read as zero.
void transpose_block(const float* x, int64_t ldx, int64_t rows, int64_t K, int MV, float* xt) {
  const int64_t width = 16 * MV;
  for (int v = 0; v < MV; ++v) {
    for (int64_t k0 = 0; k0 < K; k0 += 16) {
      const int64_t kn = std::min<int64_t>(16, K - k0);
      f16x r[16];
      for (int i = 0; i < 16; ++i) {
        const int64_t m = 16 * v + i;
        if (m < rows && kn == 16) {
          r[i] = load(x + m * ldx + k0);
        } else {
          r[i] = f16x{};
          if (m < rows) std::memcpy(&r[i], x + m * ldx + k0, kn * sizeof(float));
        }
      }
      transpose16(r);
      for (int64_t j = 0; j < kn; ++j) store(xt + (k0 + j) * width + 16 * v, r[j]);
    }
  }
}

// Rows [0, R) of w (row stride K) against xt; writes y[m][0, R) for m < rows. Prefetches the `next_rows` rows
// at `next` (the following tile) along the way, in the order that tile will read them.
template <int R, int MV>
inline void tile(const float* __restrict w, const float* __restrict xt, int64_t K, const float* bias,
                 float* __restrict y, int64_t ldy, int64_t rows, const float* next, int64_t next_rows) {
  f16x acc[R][MV];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < MV; ++v) acc[r][v] = f16x{};
  const float* rows_of[R];  // one pointer per weight row: R <= 8 keeps them, and the accumulators, in registers
  for (int r = 0; r < R; ++r) rows_of[r] = w + r * K;
  for (int64_t k0 = 0; k0 < K; k0 += 16) {
    // The lines the next tile reads at this k: each arrives about one tile ahead of its use.
    for (int64_t r = 0; r < next_rows; ++r) __builtin_prefetch(next + r * K + k0, 0, 2);
    const int64_t k1 = std::min<int64_t>(k0 + 16, K);
    for (int64_t k = k0; k < k1; ++k) {
      f16x xv[MV];
      for (int v = 0; v < MV; ++v) xv[v] = load(xt + k * 16 * MV + 16 * v);
      // xt (K x 16 MV floats) outgrows L1, so every tile re-reads it from L2: ask for it a few k ahead.
      // (xt has kXtAhead rows of slack past K for these addresses)
      for (int v = 0; v < MV; ++v) __builtin_prefetch(xt + (k + kXtAhead) * 16 * MV + 16 * v, 0, 3);
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        const float a = rows_of[r][k];
        for (int v = 0; v < MV; ++v) acc[r][v] += a * xv[v];
      }
    }
  }
  // acc[r][v] holds y[16 v .. 16 v + 15][r]: transpose 16 x 16 blocks so each output row is one short copy.
  for (int v = 0; v < MV; ++v) {
    f16x t[16];
    for (int r = 0; r < 16; ++r) t[r] = r < R ? acc[r][v] + (bias != nullptr ? bias[r] : 0.0f) : f16x{};
    transpose16(t);
    for (int i = 0; i < 16 && 16 * v + i < rows; ++i) __builtin_memcpy(y + (16 * v + i) * ldy, &t[i], R * sizeof(float));
  }
}

// Output columns [n, n + T): rows n of w, or with kGated the silu_mul of gate rows n and up rows I + n (computed
// back to back into the gate/up scratch, [m][t] with a row stride of 16). `next` (next_rows rows) is what the
// following call reads first, for the prefetches.
template <int T, int MV, bool kGated>
inline void columns(const float* w, const float* xt, int64_t K, const float* bias, float* y, int64_t ldy,
                    int64_t rows, int64_t n, int64_t I, float* gate, float* up, const float* next, int64_t next_rows) {
  if constexpr (!kGated) {
    tile<T, MV>(w + n * K, xt, K, bias != nullptr ? bias + n : nullptr, y + n, ldy, rows, next, next_rows);
  } else {
    tile<T, MV>(w + n * K, xt, K, bias != nullptr ? bias + n : nullptr, gate, 16, rows, w + (I + n) * K, T);
    tile<T, MV>(w + (I + n) * K, xt, K, bias != nullptr ? bias + I + n : nullptr, up, 16, rows, next, next_rows);
    for (int64_t m = 0; m < rows; ++m) {
      const f16x out = silu_mul(load(gate + m * 16), load(up + m * 16));  // lanes past T are ignored
      __builtin_memcpy(y + m * ldy + n, &out, T * sizeof(float));
    }
  }
}

// Output columns [n0, n1) of one block of x: tiles of R, then single rows for the tail.
template <int MV, bool kGated>
void column_range(const float* w, const float* xt, int64_t K, const float* bias, float* y, int64_t ldy,
                  int64_t rows, int64_t n0, int64_t n1, int64_t I) {
  // R x MV accumulators + MV operands + a broadcast fit the 32 vector registers of AVX-512, and R row pointers
  // the general-purpose registers.
  constexpr int R = MV == 4 ? 6 : 8;
  constexpr int64_t kScratch = kGated ? kBlockRows * 16 : 1;
  alignas(64) float gate[kScratch] = {};
  alignas(64) float up[kScratch] = {};
  int64_t n = n0;
  for (; n + R <= n1; n += R) {
    const int64_t next_rows = std::max<int64_t>(0, std::min<int64_t>(R, n1 - n - R));
    columns<R, MV, kGated>(w, xt, K, bias, y, ldy, rows, n, I, gate, up, w + (n + R) * K, next_rows);
  }
  for (; n < n1; ++n) columns<1, MV, kGated>(w, xt, K, bias, y, ldy, rows, n, I, gate, up, nullptr, 0);
}

template <bool kGated>
void column_range(int MV, const float* w, const float* xt, int64_t K, const float* bias, float* y, int64_t ldy,
                  int64_t rows, int64_t n0, int64_t n1, int64_t I) {
  switch (MV) {
    case 4: column_range<4, kGated>(w, xt, K, bias, y, ldy, rows, n0, n1, I); break;
    case 3: column_range<3, kGated>(w, xt, K, bias, y, ldy, rows, n0, n1, I); break;
    case 2: column_range<2, kGated>(w, xt, K, bias, y, ldy, rows, n0, n1, I); break;
    default: column_range<1, kGated>(w, xt, K, bias, y, ldy, rows, n0, n1, I); break;
  }
}

// y = x · wᵀ (+ bias), or with `gated` the SwiGLU gate over w's two halves (see the top of the file).
at::Tensor run(const at::Tensor& x, const at::Tensor& w, const c10::optional<at::Tensor>& bias, bool gated) {
  const char* name = gated ? "small_batch_gated_linear" : "small_batch_linear";
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.stride(1) == 1, name,
              ": x must be a float32 [M, K] tensor with contiguous rows");
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kFloat && w.is_contiguous() && w.size(1) == x.size(1), name,
              ": w must be a contiguous float32 [N, K] tensor matching x's K");
  TORCH_CHECK(!gated || w.size(0) % 2 == 0, name, ": w must have an even number of rows (gate, then up)");
  const int64_t M = x.size(0), K = x.size(1), N = gated ? w.size(0) / 2 : w.size(0);
  const float* bp = nullptr;
  if (bias.has_value()) {
    TORCH_CHECK(bias->dim() == 1 && bias->scalar_type() == at::kFloat && bias->is_contiguous() &&
                    bias->size(0) == w.size(0),
                name, ": bias must be a contiguous float32 tensor with one entry per row of w");
    bp = bias->data_ptr<float>();
  }
  at::Tensor y = at::empty({M, N}, x.options());
  if (M == 0 || N == 0) return y;
  if (K == 0) {
    if (!bias.has_value()) return y.zero_();
    if (!gated) return y.copy_(bias->expand({M, N}));
    const at::Tensor b = bias->view({2, N});
    return y.copy_((at::silu(b[0]) * b[1]).expand({M, N}));
  }
  const float* xp = x.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const int64_t ldx = x.stride(0);
  // Threads take whole units of 48 output columns (a multiple of every tile height), so only the end has a tail.
  constexpr int64_t kUnit = 48;
  at::parallel_for(0, (N + kUnit - 1) / kUnit, 1, [&](int64_t u0, int64_t u1) {
    const int64_t n0 = u0 * kUnit, n1 = std::min(N, u1 * kUnit);
    thread_local std::vector<float> xt;
    for (int64_t m0 = 0; m0 < M; m0 += kBlockRows) {
      const int64_t rows = std::min(kBlockRows, M - m0);
      const int MV = static_cast<int>((rows + 15) / 16);
      xt.resize(std::max<size_t>(xt.size(), static_cast<size_t>((K + kXtAhead) * 16 * MV)));
      transpose_block(xp + m0 * ldx, ldx, rows, K, MV, xt.data());
      float* yb = yp + m0 * N;
      if (gated) {
        column_range<true>(MV, wp, xt.data(), K, bp, yb, N, rows, n0, n1, N);
      } else {
        column_range<false>(MV, wp, xt.data(), K, bp, yb, N, rows, n0, n1, N);
      }
    }
  });
  return y;
}

}  // namespace

namespace hotswap_ops {

at::Tensor small_batch_linear(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& bias) {
  return run(x, w, bias, false);
}

at::Tensor small_batch_gated_linear(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& bias) {
  return run(x, w, bias, true);
}

}  // namespace hotswap_ops

TORCH_LIBRARY_FRAGMENT(hotswap, m) {
  m.def("small_batch_linear(Tensor x, Tensor w, Tensor? bias) -> Tensor");
  m.def("small_batch_gated_linear(Tensor x, Tensor w, Tensor? bias) -> Tensor");
}

TORCH_LIBRARY_IMPL(hotswap, CPU, m) {
  m.impl("small_batch_linear", &hotswap_ops::small_batch_linear);
  m.impl("small_batch_gated_linear", &hotswap_ops::small_batch_gated_linear);
}
