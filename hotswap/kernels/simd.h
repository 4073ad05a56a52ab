// Float vectors (GCC/Clang vector extensions) shared by the kernels, and the compile target's vector budget.
//   - f16x: portable 16-lane vectors (one AVX-512 register, two AVX2 registers, or whatever the target offers),
//     for the streaming kernels, whose speed does not hang on the register count;
//   - fvec: one native register of kLanes floats, for register-tiled kernels (the small-batch linear kernel),
//     which size their tiles from kLanes and kVectorRegisters, defined here and nowhere else.
#pragma once

#include <cstdint>

namespace hotswap_simd {

#if defined(__AVX512F__)
constexpr int kLanes = 16;           // floats per vector register
constexpr int kVectorRegisters = 32;  // architectural vector registers
#elif defined(__AVX2__) && defined(__FMA__)
constexpr int kLanes = 8;
constexpr int kVectorRegisters = 16;
#elif defined(__aarch64__)
constexpr int kLanes = 4;
constexpr int kVectorRegisters = 32;
#else
constexpr int kLanes = 4;
constexpr int kVectorRegisters = 16;
#endif

typedef float fvec __attribute__((vector_size(4 * kLanes)));

typedef float f16x __attribute__((vector_size(64)));
typedef int32_t i16x __attribute__((vector_size(64)));
typedef float f8x __attribute__((vector_size(32)));
typedef float f4x __attribute__((vector_size(16)));
constexpr int kWidth = 16;

inline f16x load(const float* p) {
  f16x v;
  __builtin_memcpy(&v, p, sizeof(v));
  return v;
}

inline void store(float* p, f16x v) { __builtin_memcpy(p, &v, sizeof(v)); }

inline fvec load_vec(const float* p) {
  fvec v;
  __builtin_memcpy(&v, p, sizeof(v));
  return v;
}

inline void store_vec(float* p, fvec v) { __builtin_memcpy(p, &v, sizeof(v)); }

// kLanes bfloat16 values (their bits) as floats: exact, bf16 being the upper half of a float.
typedef uint16_t hvec __attribute__((vector_size(2 * kLanes)));
typedef uint32_t uvec __attribute__((vector_size(4 * kLanes)));
inline fvec load_vec(const uint16_t* p) {
  hvec h;
  __builtin_memcpy(&h, p, sizeof(h));
  const uvec w = __builtin_convertvector(h, uvec) << 16;
  fvec v;
  __builtin_memcpy(&v, &w, sizeof(v));
  return v;
}

// The small-batch linear kernel's register tile (linear.cpp): a block of x is kLinearVectors vectors of rows
// (kLanes rows each), and a tile of linear_tile_rows(MV) weight rows against MV of those vectors holds R x MV
// accumulators, MV operands of x and one broadcast weight in the vector registers. R <= kLanes (the output
// transpose works on kLanes x kLanes blocks) and R <= 8 (one row pointer each in the general registers).
// AVX-512: 4 vectors (64 rows), 6 rows at MV = 4 (24 + 4 + 1 of 32); AVX2: 2 vectors (16 rows), 6 rows (12 + 2 + 1
// of 16).
constexpr int kLinearVectors = kVectorRegisters >= 32 ? 4 : 2;

constexpr int linear_tile_rows(int mv) {
  const int fit = (kVectorRegisters - 1 - mv) / mv;
  const int cap = kLanes < 8 ? kLanes : 8;
  return fit < cap ? fit : cap;
}

// op (on native vectors) applied to f16x a and b a native vector at a time. GCC lowers `?:` on vectors wider than
// the target's registers lane by lane (16 scalar compares and blends per f16x on AVX2), but not on native ones,
// so every select on f16x goes through here.
template <typename Op>
inline f16x by_native(f16x a, f16x b, Op op) {
  constexpr int kParts = 16 / kLanes;
  fvec pa[kParts], pb[kParts];
  __builtin_memcpy(pa, &a, sizeof(a));
  __builtin_memcpy(pb, &b, sizeof(b));
  for (int i = 0; i < kParts; ++i) pa[i] = op(pa[i], pb[i]);
  __builtin_memcpy(&a, pa, sizeof(a));
  return a;
}

// a > b ? a : b per lane (b where either is NaN).
inline f16x select_greater(f16x a, f16x b) {
  return by_native(a, b, [](fvec x, fvec y) { return x > y ? x : y; });
}

// x < lo ? lo : x, then x > hi ? hi : x, per lane (NaN stays NaN).
inline f16x clamp(f16x x, float lo, float hi) {
  return by_native(x, f16x{}, [lo, hi](fvec v, fvec) {
    v = v < lo ? fvec{} + lo : v;
    return v > hi ? fvec{} + hi : v;
  });
}

// Tree reduction: a serial sum would chain 16 dependent adds.
inline float hsum(f16x v) {
  const f8x a = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) +
                __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
  const f4x b = __builtin_shufflevector(a, a, 0, 1, 2, 3) + __builtin_shufflevector(a, a, 4, 5, 6, 7);
  return (b[0] + b[2]) + (b[1] + b[3]);
}

// hsum for one native vector (f16x, fvec or narrower): a tree, like hsum.
template <typename V>
inline float hsum_native(V v) {
  constexpr int n = sizeof(V) / sizeof(float);
  if constexpr (n == 16) {
    return hsum(v);
  } else if constexpr (n == 8) {
    const f4x b = __builtin_shufflevector(v, v, 0, 1, 2, 3) + __builtin_shufflevector(v, v, 4, 5, 6, 7);
    return (b[0] + b[2]) + (b[1] + b[3]);
  } else {
    static_assert(n == 4, "a native vector holds 4, 8 or 16 floats");
    return (v[0] + v[2]) + (v[1] + v[3]);
  }
}

// exp(x), within 2 ulp of std::exp for x in [-87.3, 88.3]; x is clamped to that range first (below it the
// result is about 1e-38 instead of 0, above it about 2e38 instead of inf). x = n ln2 + r with |r| <= ln2 / 2,
// exp(r) by a degree-7 polynomial, 2^n put into the exponent bits.
inline f16x exp_clamped(f16x x) {
  x = clamp(x, -87.3f, 88.3f);
  const f16x n = (x * 1.44269504088896341f + 12582912.f) - 12582912.f;  // round to nearest via 1.5 * 2^23
  const f16x r = (x - n * 0.693359375f) - n * -2.12194440e-4f;            // ln 2 split in two (Cody-Waite)
  f16x p = 1.9875691500e-4f * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.f;
  const i16x bits = (__builtin_convertvector(n, i16x) + 127) << 23;
  f16x scale;
  __builtin_memcpy(&scale, &bits, sizeof(scale));
  return p * scale;
}

// The SwiGLU gate: silu(g) * u = g / (1 + exp(-g)) * u.
inline f16x silu_mul(f16x g, f16x u) { return g / (1.f + exp_clamped(-g)) * u; }

}  // namespace hotswap_simd
