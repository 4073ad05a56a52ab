// A Llama-family decoder stack's forward pass for a small float32 or bfloat16 batch, in one call: the same kernels, in the
// same order and with the same arguments, as the Python modules' native path (hotswap/model/llama.py), without a
// trip through Python and the dispatcher's Python binding between them. At decode batch sizes those trips (module
// calls, argument checks, op bindings) cost a few milliseconds per step on top of the layers' own work, while the
// other cores wait.
//
// decoder_layers(x [T, H], positions [T] int64, layers, k_caches, v_caches, slot_mapping, block_tables,
//                context_lens, query_lens?, kv_of_q?, num_heads, num_kv_heads, head_dim, scale, eps,
//                final_norm [H], native_linear, native_gated, native_silu, o_split, down_split, lora, lora_rows,
//                onednn) -> [T, H]
// runs every layer on the embedded tokens x and returns the final RMSNorm of the last hidden state. `layers`
// holds kLayerTensors entries per layer, in the order of LayerTensor (biases may be None); k/v_caches hold each
// layer's cache; the other attention arguments are those of rope_paged_attention (paged_attention.cpp), shared by
// every layer. x's storage becomes the residual stream (as in the modules). The three flags say which products
// take the native small-batch kernels and which torch's (at::linear, the BLAS; the SwiGLU gate native or as
// silu(gate) * up), as the kernel policy chose for this batch: the modules' choice, so the same bits, without
// the Python between the ops. o_split / down_split (deterministic mode; 0: none) compute o and down as two partial
// products over their inputs split there, added, then the bias (as the modules do). LoRA adapters (hotswap/lora):
// `lora_rows` holds (start, length) per row segment, each served by one adapter, and `lora` holds, per layer and
// segment, kLoraTensors (shrink [in, R], expand [R, out]) pairs, one per product (None: that product is not
// adapted); each adapted product then adds shrink and expand to its segment's rows, as LoRABatch.apply does:
//   y[s : s + n] += (a[s : s + n] · shrink) · expand
// (the gate/up product through the unfused path, its adapter's share joining before the activation).
// Each layer is:
//   h = rms_norm(residual += x)              (the first layer: residual = x, h = rms_norm(x))
//   q, k, v = split(h · qkvᵀ + qkv_bias)
//   x = rope_paged_attention(q, k, v, ...) · oᵀ + o_bias      (writes the layer's KV cache)
//   h = rms_norm(residual += x)
//   x = silu_mul(h · gate_upᵀ + gate_up_bias) · downᵀ + down_bias
// bfloat16 weights: a product whose weight comes as a oneDNN-packed tensor (hotswap/kernels/packed.py) goes through
// oneDNN's `_linear_pointwise`, as the modules' does; the native flags take the bf16 small-batch kernels
// (linear_bf16.cpp) on plain weights. `onednn` (empty, or one
// flag per product: qkv, o, gate_up, down) sends a product that is not native and whose weight is plain through
// oneDNN too, where the modules take oneDNN's fp32 product (packed.py's dense_linear). Attention runs in the
// caches' dtype, q, k and v cast to it and the output cast back, as the modules' Attention does.
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/stack.h>
#include <torch/library.h>

#include <optional>

#include "kernels.h"

namespace {

enum LayerTensor : int64_t {
  kInputNorm, kQkv, kQkvBias, kO, kOBias, kPostNorm, kGateUp, kGateUpBias, kDown, kDownBias, kCos, kSin,
  kLayerTensors
};

using OptTensor = std::optional<at::Tensor>;

enum Product : int64_t { kQkvProduct, kOProduct, kGateUpProduct, kDownProduct, kProducts };

// oneDNN's product with a packed weight, the call kernels/packed.py makes (`_onednn_linear`).
at::Tensor onednn_linear(const at::Tensor& a, const at::Tensor& packed, const OptTensor& bias) {
  static const c10::OperatorHandle op =
      c10::Dispatcher::singleton().findSchemaOrThrow("mkldnn::_linear_pointwise", "");
  torch::jit::Stack stack{a.contiguous(), packed, bias, std::string("none"), c10::List<std::optional<at::Scalar>>(),
                          std::optional<std::string>(std::string(""))};
  op.callBoxed(&stack);
  return stack.back().toTensor();
}

enum LoraTensor : int64_t {
  kQkvShrink, kQkvExpand, kOShrink, kOExpand, kGateUpShrink, kGateUpExpand, kDownShrink, kDownExpand, kLoraTensors
};

at::Tensor decoder_layers(const at::Tensor& x, const at::Tensor& positions, const c10::List<OptTensor>& layers,
                          at::TensorList k_caches, at::TensorList v_caches, const at::Tensor& slot_mapping,
                          const at::Tensor& block_tables, const at::Tensor& context_lens,
                          const OptTensor& query_lens, const OptTensor& kv_of_q,
                          int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, double scale, double eps,
                          const at::Tensor& final_norm, bool native_linear, bool native_gated, bool native_silu,
                          int64_t o_split, int64_t down_split, const c10::List<OptTensor>& lora,
                          at::IntArrayRef lora_rows, const c10::List<bool>& onednn) {
  TORCH_CHECK(layers.size() % kLayerTensors == 0, "decoder_layers: layers must hold ", static_cast<int>(kLayerTensors),
              " entries per layer");
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "decoder_layers: x must be a contiguous [T, H] tensor");
  const int64_t T = x.size(0), q_size = num_heads * head_dim, kv_size = num_kv_heads * head_dim;
  const int64_t num_layers = static_cast<int64_t>(layers.size()) / kLayerTensors;
  TORCH_CHECK(static_cast<int64_t>(k_caches.size()) == num_layers &&
                  static_cast<int64_t>(v_caches.size()) == num_layers,
              "decoder_layers: one k and one v cache per layer");
  const int64_t segments = static_cast<int64_t>(lora_rows.size()) / 2;
  TORCH_CHECK(lora_rows.size() % 2 == 0 && static_cast<int64_t>(lora.size()) == num_layers * segments * kLoraTensors,
              "decoder_layers: lora must hold ", static_cast<int>(kLoraTensors),
              " entries per layer and (start, length) segment of lora_rows");
  // y += the adapters' products of input a, each on its segment's rows (see the header)
  auto adapt = [&](at::Tensor y, const at::Tensor& a, int64_t layer, LoraTensor shrink) -> at::Tensor {
    for (int64_t s = 0; s < segments; ++s) {
      const size_t at = static_cast<size_t>((layer * segments + s) * kLoraTensors + shrink);
      const OptTensor down = lora.get(at), up = lora.get(at + 1);
      if (!down.has_value()) continue;
      TORCH_CHECK(up.has_value(), "decoder_layers: a LoRA shrink without its expand");
      const int64_t start = lora_rows[2 * s], length = lora_rows[2 * s + 1];
      y.narrow(0, start, length).addmm_(at::mm(a.narrow(0, start, length), *down), *up);
    }
    return y;
  };
  auto adapted = [&](int64_t layer, LoraTensor shrink) -> bool {
    for (int64_t s = 0; s < segments; ++s) {
      if (lora.get(static_cast<size_t>((layer * segments + s) * kLoraTensors + shrink)).has_value()) return true;
    }
    return false;
  };
  auto get = [&](int64_t layer, LayerTensor which) -> OptTensor {
    return layers.get(static_cast<size_t>(layer * kLayerTensors + which));
  };
  auto need = [&](int64_t layer, LayerTensor which) -> at::Tensor {
    OptTensor t = get(layer, which);
    TORCH_CHECK(t.has_value(), "decoder_layers: layer ", layer, " lacks tensor ", static_cast<int>(which));
    return *t;
  };
  TORCH_CHECK(onednn.size() == 0 || onednn.size() == kProducts, "decoder_layers: onednn must be empty or hold ",
              static_cast<int>(kProducts), " flags");
  auto plain_onednn = [&](Product p) -> bool { return onednn.size() != 0 && onednn.get(p); };
  auto linear = [&](const at::Tensor& a, const at::Tensor& w, const OptTensor& b, Product p) -> at::Tensor {
    if (w.is_mkldnn()) return onednn_linear(a, w, b);
    if (native_linear) return hotswap_ops::small_batch_linear(a, w, b);
    return plain_onednn(p) ? onednn_linear(a, w, b) : at::linear(a, w, b);
  };
  // Deterministic mode's row-parallel product on one rank (hotswap/model/layers/linear.py): the two partial
  // products over inputs [0, split) and [split, K), added, then the bias; split 0: one product.
  auto row_linear = [&](const at::Tensor& a, const at::Tensor& w, const OptTensor& b, int64_t split,
                        Product p) -> at::Tensor {
    if (split <= 0 || split >= a.size(1)) return linear(a, w, b, p);
    if (native_linear) return hotswap_ops::small_batch_linear(a, w, b, split);
    const int64_t rest = a.size(1) - split;
    at::Tensor y = linear(a.narrow(1, 0, split), w.narrow(1, 0, split), c10::nullopt, p);
    y.add_(linear(a.narrow(1, split, rest), w.narrow(1, split, rest), c10::nullopt, p));
    if (b.has_value()) y.add_(*b);
    return y;
  };
  auto gated = [&](const at::Tensor& a, const at::Tensor& w, const OptTensor& b, int64_t layer) -> at::Tensor {
    const bool lora_here = adapted(layer, kGateUpShrink);
    if (native_gated && !lora_here) return hotswap_ops::small_batch_gated_linear(a, w, b);
    const at::Tensor h = lora_here ? adapt(linear(a, w, b, kGateUpProduct), a, layer, kGateUpShrink)
                                   : linear(a, w, b, kGateUpProduct);
    if (native_silu) return hotswap_ops::silu_and_mul(h);
    const int64_t half = h.size(1) / 2;
    return at::silu(h.narrow(1, 0, half)) * h.narrow(1, half, half);
  };
  at::Tensor hidden = x, residual;
  for (int64_t l = 0; l < num_layers; ++l) {
    at::Tensor h;
    if (l == 0) {
      residual = hidden;
      h = hotswap_ops::rms_norm(hidden, need(l, kInputNorm), eps);
    } else {
      h = hotswap_ops::add_rms_norm(hidden, residual, need(l, kInputNorm), eps);
    }
    const at::Tensor qkv = adapt(linear(h, need(l, kQkv), get(l, kQkvBias), kQkvProduct), h, l, kQkvShrink);
    TORCH_CHECK(qkv.size(1) == q_size + 2 * kv_size, "decoder_layers: qkv width does not match the head counts");
    const at::Tensor q = qkv.narrow(1, 0, q_size).view({T, num_heads, head_dim});
    const at::Tensor k = qkv.narrow(1, q_size, kv_size).view({T, num_kv_heads, head_dim});
    const at::Tensor v = qkv.narrow(1, q_size + kv_size, kv_size).view({T, num_kv_heads, head_dim});
    const at::ScalarType cache_type = k_caches[l].scalar_type();
    const bool cast = q.scalar_type() != cache_type;  // attention runs in the cache's dtype
    const at::Tensor attn_c = hotswap_ops::rope_paged_attention(
        cast ? q.to(cache_type) : q, cast ? k.to(cache_type) : k, cast ? v.to(cache_type) : v, positions,
        need(l, kCos), need(l, kSin), k_caches[l], v_caches[l], slot_mapping, block_tables, context_lens, query_lens,
        kv_of_q, scale);
    const at::Tensor attn = cast ? attn_c.to(q.scalar_type()) : attn_c;
    hidden = adapt(row_linear(attn, need(l, kO), get(l, kOBias), o_split, kOProduct), attn, l, kOShrink);
    h = hotswap_ops::add_rms_norm(hidden, residual, need(l, kPostNorm), eps);
    const at::Tensor act = gated(h, need(l, kGateUp), get(l, kGateUpBias), l);
    hidden = adapt(row_linear(act, need(l, kDown), get(l, kDownBias), down_split, kDownProduct), act, l,
                   kDownShrink);
  }
  if (num_layers == 0) return hotswap_ops::rms_norm(hidden, final_norm, eps);
  return hotswap_ops::add_rms_norm(hidden, residual, final_norm, eps);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(hotswap, m) {
  m.def(
      "decoder_layers(Tensor(a!) x, Tensor positions, Tensor?[] layers, Tensor(b!)[] k_caches, "
      "Tensor(c!)[] v_caches, Tensor slot_mapping, Tensor block_tables, Tensor context_lens, Tensor? query_lens, "
      "Tensor? kv_of_q, int num_heads, int num_kv_heads, int head_dim, float scale, float eps, Tensor final_norm, "
      "bool native_linear, bool native_gated, bool native_silu, int o_split, int down_split, Tensor?[] lora, "
      "int[] lora_rows, bool[] onednn) -> Tensor");
}

TORCH_LIBRARY_IMPL(hotswap, CPU, m) { m.impl("decoder_layers", &decoder_layers); }
// A layer list holding oneDNN-packed weights dispatches on their backend.
TORCH_LIBRARY_IMPL(hotswap, MkldnnCPU, m) { m.impl("decoder_layers", &decoder_layers); }
