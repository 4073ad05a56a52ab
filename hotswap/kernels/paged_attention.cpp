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
#include <atomic>
#include <cmath>
#include <cstring>
#include <type_traits>
#include <vector>

#include "kernels.h"
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

// Calls fn(t, slot, ahead) for each key position t < len of sequence b, in order, walking its block table once.
// `ahead` is the slot one block further on (position t + bs), or -1 past the end: the slot to prefetch now.
template <typename Fn>
inline void for_each_slot(const Problem& P, int64_t b, int64_t len, Fn&& fn) {
  const int64_t* table = P.tables + b * P.W;
  for (int64_t start = 0, blk = 0; start < len; start += P.bs, ++blk) {
    const int64_t n = std::min(P.bs, len - start);
    const int64_t base = table[blk] * P.bs;
    const int64_t ahead_n = std::min(P.bs, len - start - P.bs);  // used slots of the next block (<= 0: none)
    const int64_t ahead_base = ahead_n > 0 ? table[blk + 1] * P.bs : 0;
    for (int64_t o = 0; o < n; ++o) fn(start + o, base + o, o < ahead_n ? ahead_base + o : -1);
  }
}

// Requests the D elements at `row` (one key or value of one KV head), a 64-byte line at a time.
template <typename KT>
inline void prefetch_row(const KT* row, int64_t D) {
  constexpr int64_t per_line = 64 / sizeof(KT);
  for (int64_t d = 0; d < D; d += per_line) __builtin_prefetch(row + d, 0, 3);
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

// exp_normaliser, vectorised.
inline float exp_normaliser_f32(float* scores, int64_t len, float max_score) {
  f16x sum = f16x{};
  int64_t t = 0;
  for (; t + kWidth <= len; t += kWidth) {
    const f16x e = exp_clamped(load(scores + t) - max_score);
    store(scores + t, e);
    sum += e;
  }
  float denom = hsum(sum);
  if (t < len) {
    alignas(64) float tail[kWidth] = {};
    std::memcpy(tail, scores + t, (len - t) * sizeof(float));
    const f16x e = exp_clamped(load(tail) - max_score);
    store(tail, e);
    for (int64_t i = 0; i < len - t; ++i) denom += tail[i];
    std::memcpy(scores + t, tail, (len - t) * sizeof(float));
  }
  return denom;
}

// float32 fast path for head_dim = C * 16 and G query heads sharing one KV head: each key and value row is loaded
// once for all G heads; query and accumulator tiles stay in registers. The rows are held as V native vectors
// (simd.h), not as C 16-lane ones: arrays of vectors wider than the target's registers are kept on the stack by
// GCC (on AVX2 every accumulation went through memory).
// KT: the cache's element, float or bfloat16 (its bits, uint16_t; loaded as floats, exactly): q and out are float.
template <int C, int G, typename KT>
void attend_group_f32(const Problem& P, const float* q, const KT* kbase, const KT* vbase, float* out,
                      int64_t tok, const int64_t* heads, float* scores) {
  constexpr int V = C * 16 / kLanes;
  const int64_t b = P.seq_of[tok], len = P.keys_of[tok], row = P.KVH * P.D;
  fvec qv[G][V];
  float max_score[G];
  for (int g = 0; g < G; ++g) {
    for (int c = 0; c < V; ++c) qv[g][c] = load_vec(q + (tok * P.H + heads[g]) * P.D + c * kLanes) * P.scale;
    max_score[g] = -INFINITY;
  }
  // Blocks are scattered, so the hardware cannot guess the next one: scoring a key requests the key one block
  // ahead and this key's values, a row at a time so the outstanding misses stay few.
  for_each_slot(P, b, len, [&](int64_t t, int64_t slot, int64_t ahead) {
    if (ahead >= 0) prefetch_row(kbase + ahead * row, P.D);
    prefetch_row(vbase + slot * row, P.D);
    const KT* k = kbase + slot * row;
    fvec kv[V];
    for (int c = 0; c < V; ++c) kv[c] = load_vec(k + c * kLanes);
    for (int g = 0; g < G; ++g) {
      fvec acc = qv[g][0] * kv[0];
      for (int c = 1; c < V; ++c) acc += qv[g][c] * kv[c];
      const float s = hsum_native(acc);
      scores[g * len + t] = s;
      max_score[g] = std::max(max_score[g], s);
    }
  });
  float inv[G];
  for (int g = 0; g < G; ++g) inv[g] = 1.f / exp_normaliser_f32(scores + g * len, len, max_score[g]);
  fvec acc[G][V] = {};
  for_each_slot(P, b, len, [&](int64_t t, int64_t slot, int64_t ahead) {
    if (ahead >= 0) prefetch_row(vbase + ahead * row, P.D);
    const KT* v = vbase + slot * row;
    fvec vv[V];
    for (int c = 0; c < V; ++c) vv[c] = load_vec(v + c * kLanes);
    for (int g = 0; g < G; ++g) {
      const float p = scores[g * len + t];
      for (int c = 0; c < V; ++c) acc[g][c] += p * vv[c];
    }
  });
  for (int g = 0; g < G; ++g) {
    float* dst = out + (tok * P.H + heads[g]) * P.D;
    for (int c = 0; c < V; ++c) {
      store_vec(dst + c * kLanes, acc[g][c] * inv[g]);
    }
  }
}

// One (query token, KV head) task: its query heads in groups of up to 4.
template <int C, typename KT>
void attend_task_f32(const Problem& P, const float* q, const KT* kc, const KT* vc, float* out, int64_t tok,
                     int64_t kvh, std::vector<float>& scores) {
  const std::vector<int64_t>& heads = P.heads_of[kvh];
  const KT* kbase = kc + kvh * P.D;
  const KT* vbase = vc + kvh * P.D;
  scores.resize(4 * P.keys_of[tok]);
  for (size_t i = 0; i < heads.size(); i += 4) {
    const int64_t* group = heads.data() + i;
    switch (std::min<size_t>(4, heads.size() - i)) {
      case 4: attend_group_f32<C, 4, KT>(P, q, kbase, vbase, out, tok, group, scores.data()); break;
      case 3: attend_group_f32<C, 3, KT>(P, q, kbase, vbase, out, tok, group, scores.data()); break;
      case 2: attend_group_f32<C, 2, KT>(P, q, kbase, vbase, out, tok, group, scores.data()); break;
      default: attend_group_f32<C, 1, KT>(P, q, kbase, vbase, out, tok, group, scores.data()); break;
    }
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
    for_each_slot(P, b, len, [&](int64_t t, int64_t slot, int64_t) {
      const T* k = kc + slot * row + kvh * D;
      float s = 0.f;
      for (int64_t d = 0; d < D; ++d) s += qf[d] * static_cast<float>(k[d]);
      scores[t] = s;
      max_score = std::max(max_score, s);
    });
    const float inv = 1.f / exp_normaliser(scores.data(), len, max_score);
    std::fill(acc.begin(), acc.end(), 0.f);
    for_each_slot(P, b, len, [&](int64_t t, int64_t slot, int64_t) {
      const T* v = vc + slot * row + kvh * D;
      for (int64_t d = 0; d < D; ++d) acc[d] += scores[t] * static_cast<float>(v[d]);
    });
    for (int64_t d = 0; d < D; ++d) out[(tok * P.H + h) * D + d] = static_cast<T>(acc[d] * inv);
  }
}

// Runs task(tok, kvh, scores) for every (query token, KV head). Tasks are (query token, KV head): the query heads of
// one group reuse its keys and values from cache, and consecutive tasks (the tokens of one sequence) reuse the same
// keys. Threads take chunks of tasks (one token's, or fewer when there are few tasks per thread) from a shared
// counter: contexts differ in length, and the cores do not always run at the same speed, so an even split by
// count leaves one thread waiting for the other. Each task writes its own rows of `out`, so the order they run in
// does not change the result.
template <typename Task>
void for_each_task(const Problem& P, Task&& task) {
  const int64_t tasks = static_cast<int64_t>(P.seq_of.size()) * P.KVH;
  const int64_t threads = at::get_num_threads();
  const int64_t chunk = std::clamp<int64_t>(tasks / (4 * threads), 1, P.KVH);
  std::atomic<int64_t> next{0};
  at::parallel_for(0, std::min(threads, (tasks + chunk - 1) / chunk), 1, [&](int64_t, int64_t) {
    std::vector<float> scores;
    for (int64_t first; (first = next.fetch_add(chunk)) < tasks;) {
      for (int64_t t = first; t < std::min(tasks, first + chunk); ++t) task(t / P.KVH, t % P.KVH, scores);
    }
  });
}

// The vectorised task for head_dim D (a multiple of 16 up to 256, as `vectorised` says) over a cache of KT.
template <typename KT>
void attend_task_vec(const Problem& P, const float* q, const KT* kc, const KT* vc, float* out, int64_t tok,
                     int64_t kvh, std::vector<float>& scores) {
  switch (P.D) {
    case 16: attend_task_f32<1, KT>(P, q, kc, vc, out, tok, kvh, scores); return;
    case 32: attend_task_f32<2, KT>(P, q, kc, vc, out, tok, kvh, scores); return;
    case 48: attend_task_f32<3, KT>(P, q, kc, vc, out, tok, kvh, scores); return;
    case 64: attend_task_f32<4, KT>(P, q, kc, vc, out, tok, kvh, scores); return;
    case 80: attend_task_f32<5, KT>(P, q, kc, vc, out, tok, kvh, scores); return;
    case 96: attend_task_f32<6, KT>(P, q, kc, vc, out, tok, kvh, scores); return;
    case 128: attend_task_f32<8, KT>(P, q, kc, vc, out, tok, kvh, scores); return;
    case 256: attend_task_f32<16, KT>(P, q, kc, vc, out, tok, kvh, scores); return;
    default: TORCH_CHECK(false, "no vectorised attention for head_dim ", P.D);
  }
}

inline bool vectorised(int64_t D) {
  return D == 16 || D == 32 || D == 48 || D == 64 || D == 80 || D == 96 || D == 128 || D == 256;
}

template <typename T>
void attend(const Problem& P, const T* q, const T* kc, const T* vc, T* out) {
  for_each_task(P, [&](int64_t tok, int64_t kvh, std::vector<float>& scores) {
    if constexpr (std::is_same_v<T, float>) {
      if (vectorised(P.D)) return attend_task_vec<float>(P, q, kc, vc, out, tok, kvh, scores);
    }
    attend_task_generic<T>(P, q, kc, vc, out, tok, kvh, scores);
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
  if (q.scalar_type() == at::kBFloat16 && vectorised(P.D)) {
    // a bfloat16 cache read by the vectorised path (each key and value widened to float as it is loaded, exactly);
    // q and out go through float (a pass over rows that are few beside the keys and values read)
    const at::Tensor qf = q.to(at::kFloat).contiguous();
    at::Tensor outf = at::empty({q.size(0), P.H * P.D}, qf.options());
    const auto* kc = reinterpret_cast<const uint16_t*>(k_cache.data_ptr<at::BFloat16>());
    const auto* vc = reinterpret_cast<const uint16_t*>(v_cache.data_ptr<at::BFloat16>());
    const float* qp = qf.data_ptr<float>();
    float* op = outf.data_ptr<float>();
    for_each_task(P, [&](int64_t tok, int64_t kvh, std::vector<float>& scores) {
      attend_task_vec<uint16_t>(P, qp, kc, vc, op, tok, kvh, scores);
    });
    return outf.to(at::kBFloat16);
  }
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

}  // namespace

namespace hotswap_ops {

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

}  // namespace hotswap_ops

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
  m.impl("rope_paged_attention", &hotswap_ops::rope_paged_attention);
}
