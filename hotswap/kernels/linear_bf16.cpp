// bfloat16 linear layer for a few rows (decode steps of a few sequences): y[M, N] = x[M, K] · w[N, K]ᵀ (+ bias[N]),
// and its gated form (w = [gate; up] [2I, K]: silu(x · gateᵀ + b_gate) * (x · upᵀ + b_up), [M, I]), with float32
// sums, each product rounded to bfloat16 once; the gated form then rounds as silu_and_mul does (activation.cpp), so
// it gives the bits of the product followed by silu_and_mul, without writing the [M, 2I] product.
//
// A decode step of a few sequences streams every weight once for a handful of products per element: what counts is
// how fast the weight arrives. oneDNN's packed product, torch's bf16 path here, reaches about half of the memory's
// bandwidth at one to four rows (docs/log.md). This kernel keeps the weight in its natural [N, K] layout and runs
// the lanes along k instead:
//   - a thread takes tiles of kTileRows consecutive weight rows (kTileRows streams, one contiguous run of memory);
//     each k step loads one vector of each row and meets it with each of G rows of x (one accumulator vector per
//     (weight row, x row)); after the last k each accumulator is summed across its lanes;
//   - while a tile computes, the next tile of the thread is prefetched in the order it will be read;
//   - x is met G rows at a time (G from the registers: kTileRows x G accumulators, G operands, one weight vector);
//     the tile, read from memory for the first G rows, is read from L1 for the next.
// With AVX512-BF16, one `vdpbf16ps` multiplies 32 bf16 pairs and adds them into 16 float lanes (x stays bf16);
// elsewhere (AVX2, AVX-512 without BF16, other targets) each weight vector is widened to float (a shift of 16
// bits: exact) and met by fused multiply-adds with x widened once per call.
// Per output element the sum runs over k in order (in pairs under AVX512-BF16), then across the lanes, then the
// bias: it depends on its row of x and its row of w alone, not on the number of rows or their place.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cmath>
#include <cstring>

#if defined(__AVX512BF16__)
#include <immintrin.h>
#endif

#include "kernels.h"
#include "simd.h"

namespace {

using namespace hotswap_simd;

constexpr int kTileRows = 8;   // weight rows streamed together
constexpr int64_t kLine = 32;  // bf16 per cache line

#if defined(__AVX512BF16__)
constexpr int kGroup = 3;      // x rows per pass: 8 x 3 accumulators, 3 operands and 1 weight of 32 registers
#else
constexpr int kGroup = std::max(1, (kVectorRegisters - 2) / (kTileRows + 1));
#endif

// The prefetches for the next tile at k: one line of each of its rows.
inline void prefetch(const uint16_t* next, int64_t next_rows, int64_t ldw, int64_t k) {
  for (int64_t r = 0; r < next_rows; ++r) __builtin_prefetch(next + r * ldw + k, 0, 2);
}

#if defined(__AVX512BF16__)
using XRow = uint16_t;  // x as it comes

// out[g][r] = w row r · x row g over all K, for r < kTileRows, g < G.
template <int G>
inline void tile(const uint16_t* const (&rows_of)[kTileRows], const uint16_t* x, int64_t ldx, int64_t K,
                 float (&out)[kGroup][kTileRows], const uint16_t* next, int64_t next_rows, int64_t ldw) {
  __m512 acc[kTileRows][G];
  for (int r = 0; r < kTileRows; ++r)
    for (int g = 0; g < G; ++g) acc[r][g] = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + 32 <= K; k += 32) {
    prefetch(next, next_rows, ldw, k);
    __m512bh xv[G];
    for (int g = 0; g < G; ++g) xv[g] = (__m512bh)_mm512_loadu_si512(x + g * ldx + k);
#pragma GCC unroll 8
    for (int r = 0; r < kTileRows; ++r) {
      const __m512bh wv = (__m512bh)_mm512_loadu_si512(rows_of[r] + k);
      for (int g = 0; g < G; ++g) acc[r][g] = _mm512_dpbf16_ps(acc[r][g], wv, xv[g]);
    }
  }
  if (k < K) {  // the last k: zero-padded (a zero pair adds nothing)
    const __mmask32 mask = static_cast<__mmask32>((1ull << (K - k)) - 1);
    __m512bh xv[G];
    for (int g = 0; g < G; ++g) xv[g] = (__m512bh)_mm512_maskz_loadu_epi16(mask, x + g * ldx + k);
    for (int r = 0; r < kTileRows; ++r) {
      const __m512bh wv = (__m512bh)_mm512_maskz_loadu_epi16(mask, rows_of[r] + k);
      for (int g = 0; g < G; ++g) acc[r][g] = _mm512_dpbf16_ps(acc[r][g], wv, xv[g]);
    }
  }
  for (int g = 0; g < G; ++g)
    for (int r = 0; r < kTileRows; ++r) out[g][r] = _mm512_reduce_add_ps(acc[r][g]);
}
#else
using XRow = float;  // x widened once per call

template <int G>
inline void tile(const uint16_t* const (&rows_of)[kTileRows], const float* x, int64_t ldx, int64_t K,
                 float (&out)[kGroup][kTileRows], const uint16_t* next, int64_t next_rows, int64_t ldw) {
  fvec acc[kTileRows][G];
  for (int r = 0; r < kTileRows; ++r)
    for (int g = 0; g < G; ++g) acc[r][g] = fvec{};
  int64_t k = 0;
  for (; k + kLanes <= K; k += kLanes) {
    if (k % kLine == 0) prefetch(next, next_rows, ldw, k);
    fvec xv[G];
    for (int g = 0; g < G; ++g) xv[g] = load_vec(x + g * ldx + k);
#pragma GCC unroll 8
    for (int r = 0; r < kTileRows; ++r) {
      const fvec wv = load_vec(rows_of[r] + k);
      for (int g = 0; g < G; ++g) acc[r][g] += wv * xv[g];
    }
  }
  for (int g = 0; g < G; ++g) {
    for (int r = 0; r < kTileRows; ++r) {
      float sum = hsum_native(acc[r][g]);
      for (int64_t j = k; j < K; ++j) {  // the last k, in order
        const uint32_t bits = static_cast<uint32_t>(rows_of[r][j]) << 16;
        float wj;
        std::memcpy(&wj, &bits, sizeof(wj));
        sum += wj * x[g * ldx + j];
      }
      out[g][r] = sum;
    }
  }
}
#endif

// out[g][r] for rows g < rows of x (at most kGroup), by the tile instantiated for that many.
inline void tile_rows(int rows, const uint16_t* const (&rows_of)[kTileRows], const XRow* x, int64_t ldx, int64_t K,
                      float (&out)[kGroup][kTileRows], const uint16_t* next, int64_t next_rows, int64_t ldw) {
  static_assert(kGroup >= 1 && kGroup <= 3, "one case per group height");
  switch (rows) {
    case 3:
      if constexpr (kGroup >= 3) tile<3>(rows_of, x, ldx, K, out, next, next_rows, ldw);
      break;
    case 2:
      if constexpr (kGroup >= 2) tile<2>(rows_of, x, ldx, K, out, next, next_rows, ldw);
      break;
    default:
      tile<1>(rows_of, x, ldx, K, out, next, next_rows, ldw);
      break;
  }
}

inline float bias_at(const c10::BFloat16* bias, int64_t n) { return bias != nullptr ? static_cast<float>(bias[n]) : 0.f; }

}  // namespace

namespace hotswap_ops {

at::Tensor small_batch_linear_bf16(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& bias,
                                   bool gated) {
  const char* name = gated ? "small_batch_gated_linear" : "small_batch_linear";
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.stride(1) == 1, name,
              ": x must be a bfloat16 [M, K] tensor with contiguous rows");
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kBFloat16 && w.stride(1) == 1 && w.size(1) == x.size(1) &&
                  (w.size(0) <= 1 || w.stride(0) >= w.size(1)), name,
              ": w must be a bfloat16 [N, K] tensor with contiguous rows, matching x's K");
  TORCH_CHECK(!gated || w.size(0) % 2 == 0, name, ": w must have an even number of rows (gate, then up)");
  const int64_t M = x.size(0), K = x.size(1), N = gated ? w.size(0) / 2 : w.size(0);
  const c10::BFloat16* bp = nullptr;
  if (bias.has_value()) {
    TORCH_CHECK(bias->dim() == 1 && bias->scalar_type() == at::kBFloat16 && bias->is_contiguous() &&
                    bias->size(0) == w.size(0),
                name, ": bias must be a contiguous bfloat16 tensor with one entry per row of w");
    bp = bias->data_ptr<c10::BFloat16>();
  }
  at::Tensor y = at::empty({M, N}, x.options());
  if (M == 0 || N == 0) return y;
#if defined(__AVX512BF16__)
  const XRow* xp = reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>());
  const int64_t ldx = x.stride(0);
#else
  const at::Tensor xs = x.to(at::kFloat).contiguous();
  const XRow* xp = xs.data_ptr<float>();
  const int64_t ldx = K;
#endif
  const auto* wp = reinterpret_cast<const uint16_t*>(w.data_ptr<at::BFloat16>());
  const int64_t ldw = w.size(0) <= 1 ? K : w.stride(0);
  c10::BFloat16* yp = y.data_ptr<c10::BFloat16>();
  const int64_t tiles = (N + kTileRows - 1) / kTileRows;
  at::parallel_for(0, tiles, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t n = t * kTileRows, cols = std::min<int64_t>(kTileRows, N - n);
      // this tile's rows (a short last tile repeats its first row, its results dropped) and what comes next: the
      // up rows after the gate rows, then the thread's next tile
      const uint16_t* gate_rows[kTileRows];
      const uint16_t* up_rows[kTileRows];
      for (int r = 0; r < kTileRows; ++r) {
        gate_rows[r] = wp + (n + (r < cols ? r : 0)) * ldw;
        up_rows[r] = wp + (N + n + (r < cols ? r : 0)) * ldw;
      }
      const int64_t next_n = n + kTileRows;
      const int64_t next_rows = t + 1 < t1 ? std::min<int64_t>(kTileRows, N - next_n) : 0;
      for (int64_t m0 = 0; m0 < M; m0 += kGroup) {
        const int rows = static_cast<int>(std::min<int64_t>(kGroup, M - m0));
        const bool first = m0 == 0;  // later groups find the tile in cache: nothing to prefetch
        float gate[kGroup][kTileRows], up[kGroup][kTileRows];
        if (!gated) {
          tile_rows(rows, gate_rows, xp + m0 * ldx, ldx, K, gate, wp + next_n * ldw, first ? next_rows : 0, ldw);
        } else {
          tile_rows(rows, gate_rows, xp + m0 * ldx, ldx, K, gate, wp + (N + n) * ldw, first ? cols : 0, ldw);
          tile_rows(rows, up_rows, xp + m0 * ldx, ldx, K, up, wp + next_n * ldw, first ? next_rows : 0, ldw);
        }
        for (int g = 0; g < rows; ++g) {
          c10::BFloat16* out = yp + (m0 + g) * N + n;
          for (int64_t r = 0; r < cols; ++r) {
            const c10::BFloat16 v(gate[g][r] + bias_at(bp, n + r));
            if (!gated) {
              out[r] = v;
              continue;
            }
            // the product's two halves as the unfused product rounds them, then silu_and_mul's bf16 steps
            // (activation.cpp): the same bits as the two calls
            const float g_ = static_cast<float>(v);
            const c10::BFloat16 silu(g_ / (1.f + std::exp(-g_)));
            const c10::BFloat16 u(up[g][r] + bias_at(bp, N + n + r));
            out[r] = c10::BFloat16(static_cast<float>(silu) * static_cast<float>(u));
          }
        }
      }
    }
  });
  return y;
}

}  // namespace hotswap_ops
