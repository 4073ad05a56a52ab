// Causal paged attention over the block-structured cache, reading keys and values in place instead of gathering
// them into a padded copy first. Serves decode batches (one query token per sequence) and short prefills alike.
//
// paged_attention(q, k_cache, v_cache, block_tables, context_lens, query_lens, kv_of_q, scale), all contiguous:
//   q            [T, H, D]                 the new tokens' queries, sequence by sequence
//   k/v_cache    [num_blocks, bs, KVH, D]  the paged cache of one layer (the new tokens already written)
//   block_tables [B, W] int64              block ids of each sequence, in order; only the first
//                                          ceil(context_lens[b] / bs) entries are read
//   context_lens [B] int64                 keys per sequence, the new tokens included (>= 1)
//   query_lens   [B] int64 or None         new tokens per sequence (1 <= query_lens[b] <= context_lens[b], summing
//                                          to T); None means one each (T = B). New token j of sequence b sits at
//                                          position context_lens[b] - query_lens[b] + j and sees the keys up to it.
//   kv_of_q      [H] int64 or None         KV head of each query head; None means h / (H / KVH)
// Returns [T, H * D] in q's dtype. Scores and accumulation are float32.
//
// write_kv_cache(k, v [T, KVH, D] with contiguous rows and any token stride, k/v_cache, slot_mapping [T] int64)
// copies each token's keys and values to its slot (block * bs + offset) of the cache; every slot is range-checked.
//
// rope_paged_attention(q, k, v, positions, cos, sin, k/v_cache, slot_mapping, block_tables, context_lens,
// query_lens, kv_of_q, scale) is `rotary` (layer_ops.cpp), write_kv_cache and paged_attention in one call, with the
// rotated keys written straight into the cache; q [T, H, D] needs contiguous heads only.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <type_traits>
#include <vector>

#include "layer_ops.h"
#include "simd.h"

namespace {

using namespace hotswap_simd;

struct Problem {
  int64_t B, H, KVH, D, bs, W;
  const int64_t* tables;
  const int64_t* lens;
  std::vector<std::vector<int64_t>> heads_of;  // query heads of each KV head
  float scale;
  std::vector<int64_t> seq_of, keys_of;  // per query token: its sequence and how many keys it sees
};

// Calls fn(t, slot) for each key position t < len of sequence b, in order, walking its block table once.
template <typename Fn>
inline void for_each_slot(const Problem& P, int64_t b, int64_t len, Fn&& fn) {
  const int64_t* table = P.tables + b * P.W;
  for (int64_t start = 0, blk = 0; start < len; start += P.bs, ++blk) {
    const int64_t n = std::min(P.bs, len - start);
    const int64_t base = table[blk] * P.bs;
    for (int64_t o = 0; o < n; ++o) fn(start + o, base + o);
  }
}

// Softmax of scores[0, len) in place; returns the normaliser.
inline float exp_normaliser(float* scores, int64_t len, float max_score) {
  float denom = 0.f;
  for (int64_t t = 0; t < len; ++t) {
    scores[t] = std::exp(scores[t] - max_score);
    denom += scores[t];
  }
  return denom;
}

// Lane j of the result is the sum of a[j]'s lanes: a transpose-and-add tree of 45 shuffles and adds, where 16
// separate reductions would take about 130.
__attribute__((always_inline)) inline f16x hsum16(const f16x* a) {
  f16x r8[8], r4[4], r2[2];
  for (int i = 0; i < 8; ++i) {  // [half sums of a[2i] | of a[2i + 1]]
    const f16x x = a[2 * i], y = a[2 * i + 1];
    r8[i] = __builtin_shufflevector(x, y, 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
            __builtin_shufflevector(x, y, 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
  }
  for (int i = 0; i < 4; ++i) {  // quarter sums of a[4i .. 4i + 3]
    const f16x x = r8[2 * i], y = r8[2 * i + 1];
    r4[i] = __builtin_shufflevector(x, y, 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27) +
            __builtin_shufflevector(x, y, 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
  }
  for (int i = 0; i < 2; ++i) {  // pair sums of a[8i .. 8i + 7]
    const f16x x = r4[2 * i], y = r4[2 * i + 1];
    r2[i] = __builtin_shufflevector(x, y, 0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29) +
            __builtin_shufflevector(x, y, 2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31);
  }
  return __builtin_shufflevector(r2[0], r2[1], 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30) +
         __builtin_shufflevector(r2[0], r2[1], 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
}

inline float hmax(f16x v) {
  const f8x lo = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7);
  const f8x hi = __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
  const f8x a = lo > hi ? lo : hi;
  const f4x a_lo = __builtin_shufflevector(a, a, 0, 1, 2, 3), a_hi = __builtin_shufflevector(a, a, 4, 5, 6, 7);
  const f4x b = a_lo > a_hi ? a_lo : a_hi;
  return std::max(std::max(b[0], b[1]), std::max(b[2], b[3]));
}

// Online softmax state of one query head: running maximum and normaliser of its scores. The value sum weighted
// by exp(score - max) is kept beside it (D floats).
struct HeadState {
  float max, sum;
};

// Per-thread working memory of the float32 path: every query head's state and weighted value sum.
struct TokenScratch {
  std::vector<HeadState> state;
  std::vector<float> acc;  // [H, D]
};

// float32 fast path, head_dim = C * 16: G query heads sharing one KV head take n <= 16 consecutive keys of the
// same block (rows `keys` and `values`, this KV head's part). Scores of the 16 keys come out as one vector, the
// softmax state is rescaled once per chunk, and each key and value row is loaded once for all G heads.
template <int C, int G, bool kFull>
inline void attend_chunk_f32(const float* const* q, const float* keys, const float* values, int64_t row, int n,
                             float scale, HeadState* state, float* const* acc) {
  if constexpr (kFull) n = kWidth;
  alignas(64) float p[G][kWidth];
  float alpha[G];
  const f16x lane = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
  const auto live = lane < static_cast<float>(n);
  for (int g = 0; g < G; ++g) {
    f16x qv[C];
    for (int c = 0; c < C; ++c) qv[c] = load(q[g] + c * kWidth);
    f16x dot[kWidth];
    for (int j = 0; j < kWidth; ++j) {
      dot[j] = f16x{};
      if (kFull || j < n) {
        const float* k = keys + j * row;
        for (int c = 0; c < C; ++c) dot[j] += qv[c] * load(k + c * kWidth);
      }
    }
    const f16x sum = hsum16(dot) * scale;
    const f16x scores = kFull ? sum : (live ? sum : f16x{} - INFINITY);
    const float new_max = std::max(state[g].max, hmax(scores));
    alpha[g] = std::exp(state[g].max - new_max);  // 0 on the first chunk (max -inf)
    const f16x ex = exp_clamped(scores - new_max);
    const f16x e = kFull ? ex : (live ? ex : f16x{});
    state[g].max = new_max;
    state[g].sum = state[g].sum * alpha[g] + hsum(e);
    store(p[g], e);
  }
  f16x out[G][C];
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < C; ++c) out[g][c] = load(acc[g] + c * kWidth) * alpha[g];
  for (int j = 0; j < n; ++j) {
    f16x vv[C];
    for (int c = 0; c < C; ++c) vv[c] = load(values + j * row + c * kWidth);
    for (int g = 0; g < G; ++g)
      for (int c = 0; c < C; ++c) out[g][c] += p[g][j] * vv[c];
  }
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < C; ++c) store(acc[g] + c * kWidth, out[g][c]);
}

// attend_chunk_f32 with the chunk size fixed when it is full (the common case), so its loops unroll.
template <int C, int G>
inline void chunk(const float* const* q, const float* keys, const float* values, int64_t row, int n, float scale,
                  HeadState* state, float* const* acc) {
  if (n == kWidth) {
    attend_chunk_f32<C, G, true>(q, keys, values, row, n, scale, state, acc);
  } else {
    attend_chunk_f32<C, G, false>(q, keys, values, row, n, scale, state, acc);
  }
}

// Query heads per chunk call: the G x C accumulators and the 16 partial dot products stay near the 32 registers.
template <int C>
constexpr int kMaxGroup = C <= 4 ? 4 : (C <= 8 ? 2 : 1);

// Prefetches the blocks a thread will read, kAhead blocks ahead of the one being read: the blocks of the
// sequences of its tokens [begin, end), sequence after sequence. Blocks are scattered, so the hardware cannot
// guess the next one, and without this each sequence would also start cold. Blocks are numbered in that order;
// the tokens of one sequence (a prefill) all walk its blocks from the first, so the request only ever moves on.
class BlockPrefetcher {
 public:
  static constexpr int64_t kAhead = 6;

  BlockPrefetcher(const Problem& P, const float* kc, const float* vc, int64_t begin, int64_t end)
      : P_(P), kc_(kc), vc_(vc) {
    for (int64_t tok = begin; tok < end; ++tok) {
      if (tok == begin || P.seq_of[tok] != P.seq_of[tok - 1]) {
        first_.push_back(total_);
        seq_.push_back(P.seq_of[tok]);
        keys_.push_back(0);
      }
      const int64_t blocks = (P.keys_of[tok] + P.bs - 1) / P.bs;
      total_ = std::max(total_, first_.back() + blocks);
      keys_.back() = std::max(keys_.back(), P.keys_of[tok]);
    }
  }

  // Number of block `blk` of the run (sequence) `run`.
  int64_t index(size_t run, int64_t blk) const { return first_[run] + blk; }

  // Block `i` is about to be read: make sure every block up to i + kAhead has been requested.
  void reach(int64_t i) {
    const int64_t row = P_.KVH * P_.D;
    for (; issued_ <= std::min(i + kAhead, total_ - 1); ++issued_) {
      while (run_ + 1 < first_.size() && first_[run_ + 1] <= issued_) ++run_;
      const int64_t blk = issued_ - first_[run_];
      const int64_t slot = P_.tables[seq_[run_] * P_.W + blk] * P_.bs;
      const int64_t used = std::min(P_.bs, keys_[run_] - blk * P_.bs);
      for (int64_t off = 0; off < used * row; off += kWidth) {
        __builtin_prefetch(kc_ + slot * row + off, 0, 2);
        __builtin_prefetch(vc_ + slot * row + off, 0, 2);
      }
    }
  }

 private:
  const Problem& P_;
  const float* kc_;
  const float* vc_;
  std::vector<int64_t> first_, seq_, keys_;  // per run of tokens of one sequence: first block number, b, keys
  int64_t total_ = 0, issued_ = 0;
  size_t run_ = 0;
};

// Every query head of token `tok` (of run `run` of `pf`), a chunk at a time: the keys, then the values, of a block
// are read in address order for all KV heads together.
template <int C>
void attend_token_f32(const Problem& P, const float* q, const float* kc, const float* vc, float* out, int64_t tok,
                      BlockPrefetcher& pf, size_t run, TokenScratch& scratch) {
  const int64_t b = P.seq_of[tok], len = P.keys_of[tok], row = P.KVH * P.D, D = P.D;
  scratch.state.assign(P.H, HeadState{-INFINITY, 0.f});
  scratch.acc.assign(P.H * D, 0.f);
  HeadState* state = scratch.state.data();
  const int64_t* table = P.tables + b * P.W;
  for (int64_t start = 0, blk = 0; start < len; start += P.bs, ++blk) {
    const int64_t base = table[blk] * P.bs, used = std::min(P.bs, len - start);
    pf.reach(pf.index(run, blk));
    for (int64_t o = 0; o < used; o += kWidth) {
      const int n = static_cast<int>(std::min<int64_t>(kWidth, used - o));
      const float* keys = kc + (base + o) * row;
      const float* values = vc + (base + o) * row;
      for (int64_t kvh = 0; kvh < P.KVH; ++kvh) {
        const std::vector<int64_t>& heads = P.heads_of[kvh];
        for (size_t i = 0; i < heads.size(); i += kMaxGroup<C>) {
          const float* qs[kMaxGroup<C>];
          float* accs[kMaxGroup<C>];
          const int g = static_cast<int>(std::min<size_t>(kMaxGroup<C>, heads.size() - i));
          for (int j = 0; j < g; ++j) {
            qs[j] = q + (tok * P.H + heads[i + j]) * D;
            accs[j] = scratch.acc.data() + heads[i + j] * D;
          }
          HeadState group_state[kMaxGroup<C>];
          for (int j = 0; j < g; ++j) group_state[j] = state[heads[i + j]];  // heads need not be adjacent
          const float* k = keys + kvh * D;
          const float* v = values + kvh * D;
          constexpr int kG = kMaxGroup<C>;
          switch (g) {
            case 4: if constexpr (kG >= 4) chunk<C, 4>(qs, k, v, row, n, P.scale, group_state, accs); break;
            case 3: if constexpr (kG >= 3) chunk<C, 3>(qs, k, v, row, n, P.scale, group_state, accs); break;
            case 2: if constexpr (kG >= 2) chunk<C, 2>(qs, k, v, row, n, P.scale, group_state, accs); break;
            default: chunk<C, 1>(qs, k, v, row, n, P.scale, group_state, accs); break;
          }
          for (int j = 0; j < g; ++j) state[heads[i + j]] = group_state[j];
        }
      }
    }
  }
  for (int64_t h = 0; h < P.H; ++h) {
    const f16x inv = f16x{} + 1.f / state[h].sum;
    const float* acc = scratch.acc.data() + h * D;
    for (int c = 0; c < C; ++c) store(out + (tok * P.H + h) * D + c * kWidth, load(acc + c * kWidth) * inv);
  }
}

// Any dtype and head_dim: the same computation, elementwise.
template <typename T>
void attend_task_generic(const Problem& P, const T* q, const T* kc, const T* vc, T* out, int64_t tok, int64_t kvh,
                         std::vector<float>& scores) {
  const int64_t b = P.seq_of[tok], len = P.keys_of[tok], row = P.KVH * P.D, D = P.D;
  std::vector<float> qf(D), acc(D);
  scores.resize(len);
  for (int64_t h : P.heads_of[kvh]) {
    for (int64_t d = 0; d < D; ++d) qf[d] = static_cast<float>(q[(tok * P.H + h) * D + d]) * P.scale;
    float max_score = -INFINITY;
    for_each_slot(P, b, len, [&](int64_t t, int64_t slot) {
      const T* k = kc + slot * row + kvh * D;
      float s = 0.f;
      for (int64_t d = 0; d < D; ++d) s += qf[d] * static_cast<float>(k[d]);
      scores[t] = s;
      max_score = std::max(max_score, s);
    });
    const float inv = 1.f / exp_normaliser(scores.data(), len, max_score);
    std::fill(acc.begin(), acc.end(), 0.f);
    for_each_slot(P, b, len, [&](int64_t t, int64_t slot) {
      const T* v = vc + slot * row + kvh * D;
      for (int64_t d = 0; d < D; ++d) acc[d] += scores[t] * static_cast<float>(v[d]);
    });
    for (int64_t d = 0; d < D; ++d) out[(tok * P.H + h) * D + d] = static_cast<T>(acc[d] * inv);
  }
}

template <typename T>
void attend(const Problem& P, const T* q, const T* kc, const T* vc, T* out) {
  const int64_t tokens = static_cast<int64_t>(P.seq_of.size());
  if constexpr (std::is_same_v<T, float>) {
    // One task per query token, all its heads: consecutive tasks (the tokens of one sequence) reuse its keys.
    void (*fn)(const Problem&, const float*, const float*, const float*, float*, int64_t, BlockPrefetcher&, size_t,
               TokenScratch&) = nullptr;
    switch (P.D) {
      case 16: fn = attend_token_f32<1>; break;
      case 32: fn = attend_token_f32<2>; break;
      case 48: fn = attend_token_f32<3>; break;
      case 64: fn = attend_token_f32<4>; break;
      case 80: fn = attend_token_f32<5>; break;
      case 96: fn = attend_token_f32<6>; break;
      case 128: fn = attend_token_f32<8>; break;
      case 256: fn = attend_token_f32<16>; break;
      default: break;
    }
    if (fn != nullptr) {
      at::parallel_for(0, tokens, 1, [&](int64_t begin, int64_t end) {
        TokenScratch scratch;
        BlockPrefetcher pf(P, kc, vc, begin, end);
        size_t run = 0;
        for (int64_t tok = begin; tok < end; ++tok) {
          if (tok > begin && P.seq_of[tok] != P.seq_of[tok - 1]) ++run;
          fn(P, q, kc, vc, out, tok, pf, run, scratch);
        }
      });
      return;
    }
  }
  // Tasks are (query token, KV head): the query heads of one group reuse its keys and values from cache, and
  // consecutive tasks (the tokens of one sequence) reuse the same keys.
  at::parallel_for(0, tokens * P.KVH, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores;
    for (int64_t task = begin; task < end; ++task) {
      attend_task_generic<T>(P, q, kc, vc, out, task / P.KVH, task % P.KVH, scores);
    }
  });
}

// Checks paged_attention's arguments (of q, only its shape and dtype) and lays out the work.
Problem prepare(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                const at::Tensor& block_tables, const at::Tensor& context_lens,
                const std::optional<at::Tensor>& query_lens, const std::optional<at::Tensor>& kv_of_q, double scale) {
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 4 && v_cache.sizes() == k_cache.sizes(), "bad shapes");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "inputs must be contiguous");
  TORCH_CHECK(k_cache.scalar_type() == q.scalar_type() && v_cache.scalar_type() == q.scalar_type(), "dtype mismatch");
  TORCH_CHECK(k_cache.size(3) == q.size(2), "head_dim mismatch");
  TORCH_CHECK(k_cache.size(2) > 0 && k_cache.size(1) > 0, "the cache needs at least one KV head and block slot");
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && block_tables.is_contiguous() && block_tables.dim() == 2,
              "block_tables must be int64 [B, W]");
  const int64_t B = block_tables.size(0);
  TORCH_CHECK(context_lens.scalar_type() == at::kLong && context_lens.is_contiguous() && context_lens.numel() == B,
              "context_lens must be int64 [B]");
  Problem P{B, q.size(1), k_cache.size(2), q.size(2), k_cache.size(1), block_tables.size(1),
            block_tables.data_ptr<int64_t>(), context_lens.data_ptr<int64_t>(), {}, static_cast<float>(scale), {}, {}};
  const int64_t num_blocks = k_cache.size(0);
  for (int64_t b = 0; b < P.B; ++b) {
    TORCH_CHECK(P.lens[b] >= 1 && P.lens[b] <= P.W * P.bs, "context_lens out of range of block_tables");
    for (int64_t i = 0; i < (P.lens[b] + P.bs - 1) / P.bs; ++i) {
      const int64_t block = P.tables[b * P.W + i];
      TORCH_CHECK(block >= 0 && block < num_blocks, "block id out of range of the cache");
    }
  }
  if (query_lens.has_value()) {
    TORCH_CHECK(query_lens->scalar_type() == at::kLong && query_lens->is_contiguous() && query_lens->numel() == B,
                "query_lens must be int64 [B]");
    const int64_t* ql = query_lens->data_ptr<int64_t>();
    int64_t total = 0;
    for (int64_t b = 0; b < B; ++b) {
      TORCH_CHECK(ql[b] >= 1 && ql[b] <= P.lens[b], "query_lens out of range of context_lens");
      total += ql[b];
    }
    TORCH_CHECK(total == q.size(0), "q must have one row per new token");
    P.seq_of.reserve(total);
    P.keys_of.reserve(total);
    for (int64_t b = 0; b < B; ++b) {
      for (int64_t j = 0; j < ql[b]; ++j) {
        P.seq_of.push_back(b);
        P.keys_of.push_back(P.lens[b] - ql[b] + j + 1);
      }
    }
  } else {
    for (int64_t b = 0; b < B; ++b) {
      P.seq_of.push_back(b);
      P.keys_of.push_back(P.lens[b]);
    }
  }
  TORCH_CHECK(static_cast<int64_t>(P.seq_of.size()) == q.size(0), "q must have one row per new token");
  P.heads_of.resize(P.KVH);
  if (kv_of_q.has_value()) {
    TORCH_CHECK(kv_of_q->scalar_type() == at::kLong && kv_of_q->numel() == P.H && kv_of_q->is_contiguous(),
                "kv_of_q must be int64 [H]");
  } else {
    TORCH_CHECK(P.H % P.KVH == 0, "query heads must be a multiple of KV heads");
  }
  const int64_t* heads = kv_of_q.has_value() ? kv_of_q->data_ptr<int64_t>() : nullptr;
  for (int64_t h = 0; h < P.H; ++h) {
    const int64_t kvh = heads ? heads[h] : h / (P.H / P.KVH);
    TORCH_CHECK(kvh >= 0 && kvh < P.KVH, "kv_of_q out of range");
    P.heads_of[kvh].push_back(h);
  }
  return P;
}

// Attention of the prepared problem; q contiguous, shaped and typed as `prepare` checked.
at::Tensor attend_all(const Problem& P, const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache) {
  at::Tensor out = at::empty({q.size(0), P.H * P.D}, q.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "paged_attention", [&] {
    attend<scalar_t>(P, q.data_ptr<scalar_t>(), k_cache.data_ptr<scalar_t>(), v_cache.data_ptr<scalar_t>(),
                     out.data_ptr<scalar_t>());
  });
  return out;
}

at::Tensor paged_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                           const at::Tensor& block_tables, const at::Tensor& context_lens,
                           const std::optional<at::Tensor>& query_lens, const std::optional<at::Tensor>& kv_of_q,
                           double scale) {
  TORCH_CHECK(q.is_contiguous(), "inputs must be contiguous");
  const Problem P = prepare(q, k_cache, v_cache, block_tables, context_lens, query_lens, kv_of_q, scale);
  return attend_all(P, q, k_cache, v_cache);
}

// Checks write_kv_cache's arguments (see the top of the file); returns the slot of each token.
const int64_t* check_kv_write(const at::Tensor& k, const at::Tensor& v, const at::Tensor& k_cache,
                              const at::Tensor& v_cache, const at::Tensor& slot_mapping) {
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.is_contiguous() && v_cache.sizes() == k_cache.sizes() &&
                  v_cache.is_contiguous(), "caches must be contiguous [num_blocks, bs, KVH, D]");
  const int64_t slots = k_cache.size(0) * k_cache.size(1);
  TORCH_CHECK(k.dim() == 3 && k.sizes() == v.sizes() && k.size(1) == k_cache.size(2) && k.size(2) == k_cache.size(3),
              "k and v must be [T, KVH, D] matching the cache");
  TORCH_CHECK(k.stride(2) == 1 && k.stride(1) == k.size(2) && v.stride(2) == 1 && v.stride(1) == v.size(2),
              "k and v must have contiguous rows (any token stride)");
  TORCH_CHECK(k.scalar_type() == k_cache.scalar_type() && v.scalar_type() == k_cache.scalar_type() &&
                  v_cache.scalar_type() == k_cache.scalar_type(), "dtype mismatch");
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.is_contiguous() &&
                  slot_mapping.numel() == k.size(0), "slot_mapping must be int64 [T]");
  const int64_t* slot = slot_mapping.data_ptr<int64_t>();
  for (int64_t t = 0; t < k.size(0); ++t) TORCH_CHECK(slot[t] >= 0 && slot[t] < slots, "slot out of range");
  return slot;
}

// Copies token row t of `x` [T, KVH, D] (checked by check_kv_write) to slot[t] of `cache`.
void copy_to_slots(const at::Tensor& x, at::Tensor& cache, const int64_t* slot) {
  const int64_t bytes = cache.size(2) * cache.size(3) * cache.element_size();
  const int64_t stride = x.stride(0) * x.element_size();
  const char* src = static_cast<const char*>(x.data_ptr());
  char* dst = static_cast<char*>(cache.data_ptr());
  at::parallel_for(0, x.size(0), 64, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) std::memcpy(dst + slot[t] * bytes, src + t * stride, bytes);
  });
}

void write_kv_cache(const at::Tensor& k, const at::Tensor& v, at::Tensor k_cache, at::Tensor v_cache,
                    const at::Tensor& slot_mapping) {
  const int64_t* slot = check_kv_write(k, v, k_cache, v_cache, slot_mapping);
  copy_to_slots(k, k_cache, slot);
  copy_to_slots(v, v_cache, slot);
}

// rotary + write_kv_cache + paged_attention in one call: q and k are rotated at `positions`, the rotated keys
// go straight to their cache slots (never to a separate tensor), then the new tokens attend.
at::Tensor rope_paged_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                const at::Tensor& positions, const at::Tensor& cos, const at::Tensor& sin,
                                at::Tensor k_cache, at::Tensor v_cache, const at::Tensor& slot_mapping,
                                const at::Tensor& block_tables, const at::Tensor& context_lens,
                                const std::optional<at::Tensor>& query_lens,
                                const std::optional<at::Tensor>& kv_of_q, double scale) {
  // Every check runs before the cache is written: bad input leaves it as it was.
  const int64_t* slot = check_kv_write(k, v, k_cache, v_cache, slot_mapping);
  const Problem P = prepare(q, k_cache, v_cache, block_tables, context_lens, query_lens, kv_of_q, scale);
  at::Tensor q_rot = at::empty({q.size(0), q.size(1), q.size(2)}, q.options());
  hotswap_ops::rotate_qk(q, k, positions, cos, sin, q_rot, k_cache.data_ptr(), slot);  // checks, then writes
  copy_to_slots(v, v_cache, slot);
  return attend_all(P, q_rot, k_cache, v_cache);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(hotswap, m) {
  m.def("write_kv_cache(Tensor k, Tensor v, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor slot_mapping) -> ()");
  m.def(
      "paged_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, Tensor context_lens, "
      "Tensor? query_lens, Tensor? kv_of_q, float scale) -> Tensor");
  m.def(
      "rope_paged_attention(Tensor q, Tensor k, Tensor v, Tensor positions, Tensor cos, Tensor sin, "
      "Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor slot_mapping, Tensor block_tables, Tensor context_lens, "
      "Tensor? query_lens, Tensor? kv_of_q, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(hotswap, CPU, m) {
  m.impl("paged_attention", &paged_attention);
  m.impl("write_kv_cache", &write_kv_cache);
  m.impl("rope_paged_attention", &rope_paged_attention);
}
