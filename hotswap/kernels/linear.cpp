// Float32 linear layer for small batches (decode steps): y[M, N] = x[M, K] · w[N, K]ᵀ (+ bias[N]). A bfloat16 x
// goes to linear_bf16.cpp.
// small_batch_gated_linear(x, w [2I, K], bias [2I]?) is a SwiGLU MLP's fused gate/up projection with its gate
// applied on the way out: silu(x · gateᵀ + b_gate) * (x · upᵀ + b_up), [M, I], where gate = w[:I] and up = w[I:].
// Each thread computes matching gate and up tiles back to back, so the [M, 2I] projection never reaches memory.
//
// At decode batch sizes a linear layer streams its whole weight from DRAM for a few dozen FLOPs per element, and
// a BLAS spends much of the step re-packing that weight. This kernel reads the weight once, in its natural
// [N, K] layout, and keeps the small operand in cache instead:
//   - x is transposed per block of kBlockRows rows into xt[K][kLanes * MV] (MV = native vectors of rows in the
//     block, rows past M zero), which every weight row then meets as MV vector loads per k;
//   - a tile of R consecutive weight rows (one contiguous R * K run of memory) accumulates R x MV vectors of
//     output against each block in turn, each weight element broadcast into MV fused multiply-adds; the tile's
//     R * K floats are read from DRAM for the first block and from cache for the others;
//   - while a tile computes its first block, the next tile of the same thread is prefetched in the order it will
//     be read (and xt a few k ahead), so the DRAM stream overlaps the arithmetic.
// Vector width, block height (kLinearVectors) and tile height (linear_tile_rows) come from the compile target
// (simd.h), so the accumulators and operands stay in its registers.
// Threads split the output columns (rows of w; gated, a gate row and its up row each); each transposes x for
// itself, so one parallel region does the whole call.
// Per output element the sum runs over k in order, with fused multiply-adds (results differ from a BLAS in the
// last bits, as two BLAS builds do), whatever the build's tiling, the thread count, the number of rows and the
// row's place among them: an element depends on its row of x and its row of w alone. Deterministic mode
// (hotswap/kernels/ops.py) relies on this at any row count. w's rows may have any stride (a slice of columns).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstring>
#include <utility>
#include <vector>

#include "kernels.h"
#include "simd.h"

namespace {

using namespace hotswap_simd;

constexpr int kMaxMV = kLinearVectors;
constexpr int64_t kBlockRows = kLanes * kMaxMV;  // rows of x per block
constexpr int64_t kXtAhead = 8;  // k distance of the prefetches into xt
constexpr int64_t kGroupBytes = 1 << 20;  // of xt a thread keeps in L2 across its weight tiles (see `run`)

constexpr bool tiles_fit() {
  for (int mv = 1; mv <= kMaxMV; ++mv)
    if (linear_tile_rows(mv) < 1) return false;
  return true;
}
static_assert(tiles_fit(), "every block height needs a tile of at least one row");

// Index of output lane i of one transpose round's LO (hi = 0) or HI (hi = 1) shuffle: rows a and b of a pair
// swap their sub-blocks of S lanes.
constexpr int shuffle_index(int S, int hi, int i) {
  const int chunk = i / S, j = i % S, pair = chunk / 2;
  return (chunk % 2 == 0 ? 0 : kLanes) + 2 * S * pair + hi * S + j;
}

template <int S, int hi, int... I>
inline fvec shuffle(fvec a, fvec b, std::integer_sequence<int, I...>) {
  return __builtin_shufflevector(a, b, shuffle_index(S, hi, I)...);
}

// In-place transpose of a kLanes x kLanes block held as kLanes vectors: log2(kLanes) rounds, each swapping the
// off-diagonal sub-blocks of size S between row pairs (i, i + S).
template <int S = kLanes / 2>
inline void transpose(fvec* r) {
  if constexpr (S >= 1) {
    for (int i = 0; i < kLanes; ++i) {
      if (i & S) continue;
      const fvec a = r[i], b = r[i + S];
      r[i] = shuffle<S, 0>(a, b, std::make_integer_sequence<int, kLanes>{});
      r[i + S] = shuffle<S, 1>(a, b, std::make_integer_sequence<int, kLanes>{});
    }
    transpose<S / 2>(r);
  }
}

// xt[k][kLanes * v + i] = x[kLanes * v + i][k] for i < kLanes, v < MV; rows at or past `rows` read as zero.
void transpose_block(const float* x, int64_t ldx, int64_t rows, int64_t K, int MV, float* xt) {
  const int64_t width = kLanes * MV;
  for (int v = 0; v < MV; ++v) {
    for (int64_t k0 = 0; k0 < K; k0 += kLanes) {
      const int64_t kn = std::min<int64_t>(kLanes, K - k0);
      fvec r[kLanes];
      for (int i = 0; i < kLanes; ++i) {
        const int64_t m = kLanes * v + i;
        if (m < rows && kn == kLanes) {
          r[i] = load_vec(x + m * ldx + k0);
        } else {
          r[i] = fvec{};
          if (m < rows) std::memcpy(&r[i], x + m * ldx + k0, kn * sizeof(float));
        }
      }
      transpose(r);
      for (int64_t j = 0; j < kn; ++j) store_vec(xt + (k0 + j) * width + kLanes * v, r[j]);
    }
  }
}

// acc[r][v] += w row r · xt over k in [from, to), in order: the tile's inner loop (see `tile`).
template <int R, int MV>
__attribute__((always_inline)) inline void accumulate(fvec (&acc)[R][MV], const float* const (&rows_of)[R],
                                                      const float* __restrict xt, int64_t from, int64_t to,
                                                      int64_t ldw, const float* next, int64_t next_rows) {
  constexpr int64_t kLine = 16;  // floats per cache line
  for (int64_t k0 = from; k0 < to; k0 += kLine) {
    // The lines the next tile reads at this k: each arrives about one tile ahead of its use.
    for (int64_t r = 0; r < next_rows; ++r) __builtin_prefetch(next + r * ldw + k0, 0, 2);
    const int64_t k1 = std::min<int64_t>(k0 + kLine, to);
    for (int64_t k = k0; k < k1; ++k) {
      fvec xv[MV];
      for (int v = 0; v < MV; ++v) xv[v] = load_vec(xt + k * kLanes * MV + kLanes * v);
      // xt (K x kLanes MV floats) outgrows L1, so every tile re-reads it from L2: ask for it a few k ahead, one
      // request per cache line. (xt has kXtAhead rows of slack past K for these addresses)
      for (int v = 0; v < MV; v += kLine / kLanes)
        __builtin_prefetch(xt + (k + kXtAhead) * kLanes * MV + kLanes * v, 0, 3);
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        const float a = rows_of[r][k];
        for (int v = 0; v < MV; ++v) acc[r][v] += a * xv[v];
      }
    }
  }
}

// Rows [0, R) of w (row stride ldw) against one block's xt; writes y[m][0, R) for m < rows. Prefetches the
// `next_rows` rows at `next` (the following tile) along the way, in the order that tile will read them. With
// 0 < split < K, each element is the sum over k < split plus the sum over k >= split, each a chain from zero
// (deterministic mode's row-parallel product on one rank: the two ranks' partial products, added).
template <int R, int MV, bool kSplit>
inline void tile(const float* __restrict w, const float* __restrict xt, int64_t K, int64_t ldw, int64_t split,
                 const float* bias, float* __restrict y, int64_t ldy, int64_t rows, const float* next,
                 int64_t next_rows) {
  static_assert(R * MV + MV + 1 <= kVectorRegisters, "the tile's accumulators and operands must fit the registers");
  fvec acc[R][MV];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < MV; ++v) acc[r][v] = fvec{};
  const float* rows_of[R];  // one pointer per weight row: R <= 8 keeps them, and the accumulators, in registers
  for (int r = 0; r < R; ++r) rows_of[r] = w + r * ldw;
  if constexpr (kSplit) {
    accumulate<R, MV>(acc, rows_of, xt, 0, split, ldw, next, next_rows);
    fvec first[R][MV];
    for (int r = 0; r < R; ++r)
      for (int v = 0; v < MV; ++v) first[r][v] = acc[r][v], acc[r][v] = fvec{};
    accumulate<R, MV>(acc, rows_of, xt, split, K, ldw, next, next_rows);
    for (int r = 0; r < R; ++r)
      for (int v = 0; v < MV; ++v) acc[r][v] = first[r][v] + acc[r][v];
  } else {
    accumulate<R, MV>(acc, rows_of, xt, 0, K, ldw, next, next_rows);
  }
  // acc[r][v] holds y[kLanes v .. kLanes v + kLanes - 1][r]: transpose kLanes x kLanes blocks so each output row
  // is one short copy.
  for (int v = 0; v < MV; ++v) {
    fvec t[kLanes];
    for (int r = 0; r < kLanes; ++r) t[r] = r < R ? acc[r][v] + (bias != nullptr ? bias[r] : 0.0f) : fvec{};
    transpose(t);
    for (int i = 0; i < kLanes && kLanes * v + i < rows; ++i)
      __builtin_memcpy(y + (kLanes * v + i) * ldy, &t[i], R * sizeof(float));
  }
}

// `tile` with the split (0 < split < K) or without: two instantiations, so the common one keeps its registers.
template <int R, int MV>
inline void tile_any(const float* w, const float* xt, int64_t K, int64_t ldw, int64_t split, const float* bias,
                     float* y, int64_t ldy, int64_t rows, const float* next, int64_t next_rows) {
  if (split > 0 && split < K) {
    tile<R, MV, true>(w, xt, K, ldw, split, bias, y, ldy, rows, next, next_rows);
  } else {
    tile<R, MV, false>(w, xt, K, ldw, split, bias, y, ldy, rows, next, next_rows);
  }
}

template <int R>
inline void tile(int MV, const float* w, const float* xt, int64_t K, int64_t ldw, int64_t split, const float* bias,
                 float* y, int64_t ldy,
                 int64_t rows, const float* next, int64_t next_rows) {
  // MV is at most the first block's, for which R was chosen: the cases past it do not occur.
  static_assert(kMaxMV <= 4, "one case per block height");
  switch (MV) {
    case 4:
      if constexpr (kMaxMV >= 4 && R <= linear_tile_rows(4)) tile_any<R, 4>(w, xt, K, ldw, split, bias, y, ldy, rows, next, next_rows);
      break;
    case 3:
      if constexpr (kMaxMV >= 3 && R <= linear_tile_rows(3)) tile_any<R, 3>(w, xt, K, ldw, split, bias, y, ldy, rows, next, next_rows);
      break;
    case 2:
      if constexpr (kMaxMV >= 2 && R <= linear_tile_rows(2)) tile_any<R, 2>(w, xt, K, ldw, split, bias, y, ldy, rows, next, next_rows);
      break;
    default:
      tile_any<R, 1>(w, xt, K, ldw, split, bias, y, ldy, rows, next, next_rows);
      break;
  }
}

// y[m][0, T) = silu_mul(gate[m][t], up[m][t]) for m < rows (scratch row stride 16). Not inlined: the exp's
// constants would otherwise be hoisted into vector registers across the tiles, and spill their accumulators.
__attribute__((noinline)) void write_gated(const float* gate, const float* up, float* y, int64_t ldy, int64_t rows,
                                           int T) {
  for (int64_t m = 0; m < rows; ++m) {
    const f16x out = silu_mul(load(gate + m * 16), load(up + m * 16));  // lanes past T are ignored
    std::memcpy(y + m * ldy, &out, T * sizeof(float));
  }
}

// x transposed block by block: block b (rows [b kBlockRows, ...)) at xt + b * stride, with mv[b] vectors.
struct Blocks {
  const float* xt;
  int64_t stride, count, M;
  int64_t split;  // see `tile` (0: none)
  int64_t rows(int64_t b) const { return std::min(kBlockRows, M - b * kBlockRows); }
  int mv(int64_t b) const { return static_cast<int>((rows(b) + kLanes - 1) / kLanes); }
};

// Output columns [n, n + T) for every block: rows n of w, or with kGated the silu_mul of gate rows n and up rows
// I + n (computed back to back into the gate/up scratch, [m][t] with a row stride of 16). `next` (next_rows
// rows) is what the following call reads first, for the prefetches.
template <int T, bool kGated>
inline void columns(const float* w, const Blocks& xb, int64_t K, int64_t ldw, const float* bias, float* y, int64_t ldy,
                    int64_t n, int64_t I, float* gate, float* up, const float* next, int64_t next_rows) {
  for (int64_t b = 0; b < xb.count; ++b) {
    const float* xt = xb.xt + b * xb.stride;
    const int mv = xb.mv(b);
    const int64_t rows = xb.rows(b);
    float* yb = y + b * kBlockRows * ldy;
    const bool first = b == 0;  // later blocks find the tile in cache: nothing to prefetch
    if constexpr (!kGated) {
      tile<T>(mv, w + n * ldw, xt, K, ldw, xb.split, bias != nullptr ? bias + n : nullptr, yb + n, ldy, rows, first ? next : nullptr,
              first ? next_rows : 0);
    } else {
      tile<T>(mv, w + n * ldw, xt, K, ldw, xb.split, bias != nullptr ? bias + n : nullptr, gate, 16, rows,
              first ? w + (I + n) * ldw : nullptr, first ? T : 0);
      tile<T>(mv, w + (I + n) * ldw, xt, K, ldw, xb.split, bias != nullptr ? bias + I + n : nullptr, up, 16, rows,
              first ? next : nullptr, first ? next_rows : 0);
      write_gated(gate, up, yb + n, ldy, rows, T);
    }
  }
}

// Output columns [n0, n1): tiles of R rows, then single rows for the tail.
template <int R, bool kGated>
void column_range(const float* w, const Blocks& xb, int64_t K, int64_t ldw, const float* bias, float* y, int64_t ldy,
                  int64_t n0,
                  int64_t n1, int64_t I) {
  constexpr int64_t kScratch = kGated ? kBlockRows * 16 : 1;
  alignas(64) float gate[kScratch] = {};
  alignas(64) float up[kScratch] = {};
  int64_t n = n0;
  for (; n + R <= n1; n += R) {
    const int64_t next_rows = std::max<int64_t>(0, std::min<int64_t>(R, n1 - n - R));
    columns<R, kGated>(w, xb, K, ldw, bias, y, ldy, n, I, gate, up, w + (n + R) * ldw, next_rows);
  }
  for (; n < n1; ++n) columns<1, kGated>(w, xb, K, ldw, bias, y, ldy, n, I, gate, up, nullptr, 0);
}

template <bool kGated>
void column_range(int MV, const float* w, const Blocks& xb, int64_t K, int64_t ldw, const float* bias, float* y,
                  int64_t ldy,
                  int64_t n0, int64_t n1, int64_t I) {
  switch (MV) {
    case 4:
      if constexpr (kMaxMV >= 4) column_range<linear_tile_rows(4), kGated>(w, xb, K, ldw, bias, y, ldy, n0, n1, I);
      break;
    case 3:
      if constexpr (kMaxMV >= 3) column_range<linear_tile_rows(3), kGated>(w, xb, K, ldw, bias, y, ldy, n0, n1, I);
      break;
    case 2:
      if constexpr (kMaxMV >= 2) column_range<linear_tile_rows(2), kGated>(w, xb, K, ldw, bias, y, ldy, n0, n1, I);
      break;
    default:
      column_range<linear_tile_rows(1), kGated>(w, xb, K, ldw, bias, y, ldy, n0, n1, I);
      break;
  }
}

// ---- a few rows (a decode step of 1-4 sequences) ---------------------------------------------------------------
// With lanes over rows, a block of kLanes rows holding 1-4 of them spends most of its multiply-adds on zeros. Here
// the lanes go over output columns instead: kLanes weight rows are loaded kLanes k at a time and transposed in
// registers, and each k is one fused multiply-add per row of x. An output element is still one chain over k in
// order from zero (then the split's second chain, then the bias), so every row count gives the same bits.
constexpr int64_t kFewRows = 4;
static_assert(kLanes <= 16, "few_rows keeps a row of output in 16 floats");

// acc[m] lane i += sum over k in [from, to) of x[m][k] w[i][k], in order, for i < cols.
template <int M>
inline void few_accumulate(const float* w, int64_t ldw, int64_t cols, const float* x, int64_t ldx, int64_t from,
                           int64_t to, fvec* acc) {
  int64_t k0 = from;
  if (cols == kLanes) {  // whole blocks: fixed trip counts, the compiler unrolls and keeps all in registers
    for (; k0 + kLanes <= to; k0 += kLanes) {
      fvec r[kLanes];
#pragma GCC unroll 16
      for (int i = 0; i < kLanes; ++i) r[i] = load_vec(w + i * ldw + k0);
      transpose(r);  // r[j] lane i = w[i][k0 + j]
#pragma GCC unroll 16
      for (int j = 0; j < kLanes; ++j)
        for (int m = 0; m < M; ++m) acc[m] += x[m * ldx + k0 + j] * r[j];
    }
  }
  for (; k0 < to; k0 += kLanes) {  // the last columns or the last k: zero-padded, only k < to counted
    const int64_t kn = std::min<int64_t>(kLanes, to - k0);
    fvec r[kLanes];
    for (int i = 0; i < kLanes; ++i) {
      r[i] = fvec{};
      if (i < cols) std::memcpy(&r[i], w + i * ldw + k0, kn * sizeof(float));
    }
    transpose(r);
    for (int64_t j = 0; j < kn; ++j)
      for (int m = 0; m < M; ++m) acc[m] += x[m * ldx + k0 + j] * r[j];
  }
}

// acc[m] = the rows' products with weight rows [0, cols) (two chains summed with 0 < split < K), without bias.
template <int M>
inline void few_products(const float* w, int64_t ldw, int64_t cols, const float* x, int64_t ldx, int64_t K,
                         int64_t split, fvec* acc) {
  for (int m = 0; m < M; ++m) acc[m] = fvec{};
  if (split > 0 && split < K) {
    fvec second[M];
    for (int m = 0; m < M; ++m) second[m] = fvec{};
    few_accumulate<M>(w, ldw, cols, x, ldx, 0, split, acc);
    few_accumulate<M>(w, ldw, cols, x, ldx, split, K, second);
    for (int m = 0; m < M; ++m) acc[m] = acc[m] + second[m];
  } else {
    few_accumulate<M>(w, ldw, cols, x, ldx, 0, K, acc);
  }
}

template <int M>
void few_rows(const float* x, int64_t ldx, const float* w, int64_t ldw, const float* bias, float* y, int64_t N,
              int64_t K, int64_t split, bool gated) {
  at::parallel_for(0, (N + kLanes - 1) / kLanes, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t n = b * kLanes, cols = std::min<int64_t>(kLanes, N - n);
      fvec acc[M];
      few_products<M>(w + n * ldw, ldw, cols, x, ldx, K, split, acc);
      alignas(64) float out[M][16] = {};
      for (int m = 0; m < M; ++m)
        for (int i = 0; i < cols; ++i) out[m][i] = acc[m][i] + (bias != nullptr ? bias[n + i] : 0.0f);
      if (gated) {  // acc was the gate: the up rows are N further on; the gate is applied as write_gated does
        few_products<M>(w + (N + n) * ldw, ldw, cols, x, ldx, K, split, acc);
        for (int m = 0; m < M; ++m) {
          alignas(64) float up[16] = {};
          for (int i = 0; i < cols; ++i) up[i] = acc[m][i] + (bias != nullptr ? bias[N + n + i] : 0.0f);
          const f16x gate_up = silu_mul(load(out[m]), load(up));
          std::memcpy(out[m], &gate_up, sizeof(gate_up));
        }
      }
      for (int m = 0; m < M; ++m) std::memcpy(y + m * N + n, out[m], cols * sizeof(float));
    }
  });
}

// y = x · wᵀ (+ bias), or with `gated` the SwiGLU gate over w's two halves (see the top of the file).
at::Tensor run(const at::Tensor& x, const at::Tensor& w, const c10::optional<at::Tensor>& bias, bool gated,
               int64_t split) {
  const char* name = gated ? "small_batch_gated_linear" : "small_batch_linear";
  if (x.scalar_type() == at::kBFloat16) {  // linear_bf16.cpp (no split: deterministic mode is float32)
    TORCH_CHECK(split == 0, name, ": a bfloat16 product has no split");
    return hotswap_ops::small_batch_linear_bf16(x, w, bias, gated);
  }
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.stride(1) == 1, name,
              ": x must be a float32 [M, K] tensor with contiguous rows");
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kFloat && w.stride(1) == 1 && w.size(1) == x.size(1) &&
                  (w.size(0) <= 1 || w.stride(0) >= w.size(1)), name,
              ": w must be a float32 [N, K] tensor with contiguous rows, matching x's K");
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
  const int64_t ldx = x.stride(0), ldw = w.size(0) <= 1 ? K : w.stride(0);
  if (M <= kFewRows) {
    switch (M) {
      case 1: few_rows<1>(xp, ldx, wp, ldw, bp, yp, N, K, split, gated); break;
      case 2: few_rows<2>(xp, ldx, wp, ldw, bp, yp, N, K, split, gated); break;
      case 3: few_rows<3>(xp, ldx, wp, ldw, bp, yp, N, K, split, gated); break;
      default: few_rows<4>(xp, ldx, wp, ldw, bp, yp, N, K, split, gated); break;
    }
    return y;
  }
  const int64_t count = (M + kBlockRows - 1) / kBlockRows;
  const int64_t stride = (K + kXtAhead) * kBlockRows;  // one block's xt, with the prefetches' slack
  // Threads take whole tiles of output columns (the tile height is set by the first block's), so only the end has
  // a tail, and the split is even to a tile: units of several tiles left a thread up to a fifth of a small
  // layer's columns (256 or 512) more than the other.
  const int64_t unit = linear_tile_rows(static_cast<int>((std::min(M, kBlockRows) + kLanes - 1) / kLanes));
  at::parallel_for(0, (N + unit - 1) / unit, 1, [&](int64_t u0, int64_t u1) {
    const int64_t n0 = u0 * unit, n1 = std::min(N, u1 * unit);
    thread_local std::vector<float> xt;
    xt.resize(std::max<size_t>(xt.size(), static_cast<size_t>(count * stride)));
    const Blocks xb{xt.data(), stride, count, M, split};
    for (int64_t b = 0; b < count; ++b)
      transpose_block(xp + b * kBlockRows * ldx, ldx, xb.rows(b), K, xb.mv(b), xt.data() + b * stride);
    // Blocks go by groups whose xt stays in L2 (kGroupBytes) while every weight tile of the thread meets them: a
    // tall x (a prefill) would otherwise stream all of xt from the last-level cache once per tile. A decode batch
    // is one group. The tile height is set by the group's tallest block (its first).
    const int64_t group = std::max<int64_t>(1, kGroupBytes / (stride * static_cast<int64_t>(sizeof(float))));
    for (int64_t g0 = 0; g0 < count; g0 += group) {
      const Blocks gb{xt.data() + g0 * stride, stride, std::min(group, count - g0), M - g0 * kBlockRows, split};
      float* yg = yp + g0 * kBlockRows * N;
      if (gated) {
        column_range<true>(gb.mv(0), wp, gb, K, ldw, bp, yg, N, n0, n1, N);
      } else {
        column_range<false>(gb.mv(0), wp, gb, K, ldw, bp, yg, N, n0, n1, N);
      }
    }
  });
  return y;
}

}  // namespace

namespace hotswap_ops {

at::Tensor small_batch_linear(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& bias,
                              int64_t split) {
  return run(x, w, bias, false, split);
}

at::Tensor small_batch_gated_linear(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& bias) {
  return run(x, w, bias, true, 0);
}

}  // namespace hotswap_ops

TORCH_LIBRARY_FRAGMENT(hotswap, m) {
  m.def("small_batch_linear(Tensor x, Tensor w, Tensor? bias, int split=0) -> Tensor");
  m.def("small_batch_gated_linear(Tensor x, Tensor w, Tensor? bias) -> Tensor");
}

TORCH_LIBRARY_IMPL(hotswap, CPU, m) {
  m.impl("small_batch_linear", &hotswap_ops::small_batch_linear);
  m.impl("small_batch_gated_linear", &hotswap_ops::small_batch_gated_linear);
}
