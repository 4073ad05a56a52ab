"""Mixture-of-experts models (Qwen3-MoE, Mixtral, Qwen2-MoE): outputs equal transformers, both checkpoint naming
schemes, updates through every transport (full and partial), FP8 experts re-quantized on update, bad updates
refused with every weight unchanged, and the experts' post-processing bound to the worker's config scope."""

from __future__ import annotations

import shutil
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from test_correctness import assert_matches_transformers
from torch import nn

from conftest import PROMPTS
from hotswap import LLM, EngineConfig, SamplingParams
from hotswap.config import current_config
from hotswap.model.layers.fused_moe import FusedMoE, expert_placement
from hotswap.model.layers.quant.fp8 import dequantize, dequantize_blocks, quantize_blocks, quantize_per_channel
from hotswap.model.settings import LayerSettings
from hotswap.testing import make_tiny_model
from hotswap.transfer.tensors import tensors_update_info
from hotswap.weights.index import WeightIndex
from hotswap.weights.update import WeightUpdate
from transfer_helpers import BACKENDS, Pusher

MOE_ARCHS = ["qwen3_moe", "mixtral", "qwen2_moe"]
GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
KV = 1 << 22


@pytest.fixture(scope="module")
def moe(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Per arch, checkpoints A and B (different seeds) of the same shape."""
    root = tmp_path_factory.mktemp("moe")
    dirs = {}
    for arch in MOE_ARCHS:
        for label, seed in (("A", 0), ("B", 1)):
            dirs[f"{arch}_{label}"] = make_tiny_model(root / f"{arch}_{label}", arch, seed=seed)
    return dirs


def tensors(path: Path) -> dict[str, torch.Tensor]:
    return load_file(str(path / "model.safetensors"))


def fused(
    named: dict[str, torch.Tensor], num_experts: int, names=("gate_proj", "up_proj", "down_proj"), block: str = "mlp"
) -> list[tuple[str, torch.Tensor]]:
    """The tensors as a transformers 5 model names them: each layer's experts stacked into gate_up_proj
    [E, 2I, H] and down_proj [E, H, I] under `mlp.experts`; every other tensor as it is."""
    gate, up, down = names
    out, layers = [], set()
    for name, tensor in named.items():
        if f".{block}.experts." not in name:
            out.append((name.replace(f".{block}.gate.", ".mlp.gate."), tensor))
            continue
        layers.add(name.split(f".{block}.experts.")[0])
    for prefix in sorted(layers):

        def get(e: int, proj: str, prefix: str = prefix) -> torch.Tensor:
            return named[f"{prefix}.{block}.experts.{e}.{proj}.weight"]

        out.append(
            (
                f"{prefix}.mlp.experts.gate_up_proj",
                torch.stack([torch.cat([get(e, gate), get(e, up)]) for e in range(num_experts)]),
            )
        )
        out.append((f"{prefix}.mlp.experts.down_proj", torch.stack([get(e, down) for e in range(num_experts)])))
    return out


def mixed_checkpoint(tmp: Path, base: Path, replaced: dict[str, torch.Tensor]) -> Path:
    """A copy of checkpoint `base` with some tensors replaced (the reference for a partial update)."""
    target = tmp / "mixed"
    shutil.copytree(base, target)
    save_file({**tensors(base), **replaced}, str(target / "model.safetensors"), metadata={"format": "pt"})
    return target


def greedy(llm: LLM, prompts=PROMPTS[:4]) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]


def hf_tokens(path: Path, llm: LLM, prompts=PROMPTS[:4], model: nn.Module | None = None) -> list[list[int]]:
    from transformers import AutoModelForCausalLM

    if model is None:
        model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    tok, out = llm.get_tokenizer(), []
    with torch.no_grad():
        for p in prompts:
            ids = tok.encode(p)
            gen = model.generate(
                torch.tensor([ids]),
                attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                max_new_tokens=16,
                min_new_tokens=16,
                do_sample=False,
                pad_token_id=0,
            )
            out.append(gen[0, len(ids) :].tolist())
    return out


def expert_storage(llm: LLM) -> list[int]:
    return llm.apply_model(lambda m: [p.data_ptr() for n, p in m.named_parameters() if ".experts." in n])[0]


@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_greedy_and_logprobs_match_transformers_with_tokens_spread_over_experts(moe, arch):
    path = str(moe[f"{arch}_A"])
    llm = LLM(path, kv_cache_memory_bytes=1 << 24)
    routed: list[torch.Tensor] = []

    def hook(model):
        for module in model.modules():
            if isinstance(module, FusedMoE):
                module.register_forward_pre_hook(lambda m, args: routed.append(args[2].flatten().clone()))

    llm.apply_model(hook)
    assert_matches_transformers(path, llm, PROMPTS)  # 8 prompts x 32 tokens, logprobs within 1e-4
    experts_hit = torch.cat(routed).unique()
    assert len(experts_hit) >= 6, f"routing should spread over the 8 experts, hit only {experts_hit.tolist()}"


@pytest.mark.parametrize("naming", ["per-expert", "fused"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_full_and_partial_updates_through_every_transport(moe, tmp_path, backend, naming):
    """A full update (B) then a partial one (layer 1's experts back to A) through each transport, with per-expert
    names or transformers 5 fused names: transformers' tokens for the new weights, storage kept."""
    a, b = tensors(moe["qwen3_moe_A"]), tensors(moe["qwen3_moe_B"])
    llm = LLM(str(moe["qwen3_moe_A"]), kv_cache_memory_bytes=KV)
    ptrs = expert_storage(llm)
    pusher = Pusher(llm, backend)
    pusher.push(list(b.items()) if naming == "per-expert" else fused(b, 8))
    assert greedy(llm) == hf_tokens(moe["qwen3_moe_B"], llm)
    layer1 = {n: t for n, t in a.items() if ".layers.1.mlp.experts." in n}
    partial = list(layer1.items()) if naming == "per-expert" else fused(layer1, 8)
    pusher.push(partial)
    assert greedy(llm) == hf_tokens(mixed_checkpoint(tmp_path, moe["qwen3_moe_B"], layer1), llm)
    assert expert_storage(llm) == ptrs and llm.get_weight_version() == 2
    pusher.close()


@pytest.mark.parametrize(("arch", "backend"), [("mixtral", "shm"), ("qwen2_moe", "tensors")])
def test_updates_with_transformers_5_fused_names(moe, arch, backend):
    """What a transformers 5 trainer's named_parameters() yields (Mixtral's block renamed `mlp` too)."""
    llm = LLM(str(moe[f"{arch}_A"]), kv_cache_memory_bytes=KV)
    ptrs = expert_storage(llm)
    names = ("w1", "w3", "w2") if arch == "mixtral" else ("gate_proj", "up_proj", "down_proj")
    block = "block_sparse_moe" if arch == "mixtral" else "mlp"
    pusher = Pusher(llm, backend)
    pusher.push(fused(tensors(moe[f"{arch}_B"]), 8, names, block))
    assert greedy(llm) == hf_tokens(moe[f"{arch}_B"], llm)
    assert expert_storage(llm) == ptrs
    pusher.close()


def test_partial_updates_of_one_expert_and_of_one_fused_layer(moe, tmp_path):
    a, b = tensors(moe["qwen3_moe_A"]), tensors(moe["qwen3_moe_B"])
    llm = LLM(str(moe["qwen3_moe_A"]), kv_cache_memory_bytes=KV)
    before = greedy(llm)
    one_expert = {n: t for n, t in b.items() if ".layers.1.mlp.experts.3." in n}
    assert len(one_expert) == 3
    llm.reload_weights(weights_iterator=list(one_expert.items()))
    after_one = greedy(llm)
    assert after_one == hf_tokens(mixed_checkpoint(tmp_path / "one", moe["qwen3_moe_A"], one_expert), llm)
    assert after_one != before  # the expert is used: the update is visible
    # layer 0's experts as one fused update (gate_up only), on top
    layer0 = {n: t for n, t in b.items() if ".layers.0.mlp.experts." in n and "down_proj" not in n}
    gate_up = [
        (n, t)
        for n, t in fused(
            layer0 | {n: t for n, t in a.items() if ".layers.0.mlp.experts." in n and "down_proj" in n}, 8
        )
        if n.endswith("gate_up_proj")
    ]
    llm.init_weight_transfer_engine({"backend": "tensors"})
    llm.start_weight_update()
    llm.update_weights(tensors_update_info(gate_up))
    llm.finish_weight_update()
    expected = mixed_checkpoint(tmp_path / "two", moe["qwen3_moe_A"], one_expert | layer0)
    after_two = greedy(llm)
    assert after_two == hf_tokens(expected, llm) and after_two != after_one


def fp8_reference(path: Path, block: tuple[int, int] | None = None) -> nn.Module:
    """transformers with `path`'s weights, every decoder linear and expert quantized and dequantized per row as
    hotswap does, or the experts per `block` tile (the routers stay in high precision)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if not name.startswith("model.layers.") or "norm" in name or name.endswith(("gate.weight", ".bias")):
                continue
            if block is not None and ".experts." in name:
                param.copy_(dequantize_blocks(*quantize_blocks(param, block), block, torch.float32))
                continue
            rows = param.reshape(-1, param.shape[-1])
            q, scale = quantize_per_channel(rows)
            param.copy_(dequantize(q, scale, torch.float32).reshape(param.shape))
    return model


def test_fp8_experts_equal_dequantized_transformers_and_updates_requantize(moe, tmp_path):
    llm = LLM(str(moe["qwen3_moe_A"]), kv_cache_memory_bytes=KV, quantization="fp8")
    dtype = llm.apply_model(lambda m: m.model.layers[0].mlp.experts.w13_weight.dtype)[0]
    assert dtype == torch.float8_e4m3fn
    assert greedy(llm) == hf_tokens(moe["qwen3_moe_A"], llm, model=fp8_reference(moe["qwen3_moe_A"]))

    def experts(m):
        return [(n, p.detach().clone()) for n, p in m.named_parameters() if ".experts." in n]

    # one expert of B: exactly its rows are re-quantized, bit for bit as a fresh FP8 load of the mixed weights
    b = tensors(moe["qwen3_moe_B"])
    one_expert = {n: t for n, t in b.items() if ".layers.1.mlp.experts.5." in n}
    llm.reload_weights(weights_iterator=list(one_expert.items()))
    mixed = mixed_checkpoint(tmp_path, moe["qwen3_moe_A"], one_expert)
    fresh = LLM(str(mixed), kv_cache_memory_bytes=KV, quantization="fp8")
    got, want = llm.apply_model(experts)[0], fresh.apply_model(experts)[0]
    assert [n for n, _ in got] == [n for n, _ in want]
    for (name, g), (_, w) in zip(got, want, strict=True):
        assert torch.equal(
            g.view(torch.uint8) if g.element_size() == 1 else g, w.view(torch.uint8) if w.element_size() == 1 else w
        ), name
    # a full push of B
    pusher = Pusher(llm, "tensors")
    pusher.push(list(b.items()))
    assert greedy(llm) == hf_tokens(moe["qwen3_moe_B"], llm, model=fp8_reference(moe["qwen3_moe_B"]))
    pusher.close()


def quantized_experts(named: dict[str, torch.Tensor], block: tuple[int, int] | None) -> dict[str, torch.Tensor]:
    """The tensors with every expert projection already FP8: float8 weights beside their `weight_scale` [rows, 1]
    (per row) or `weight_scale_inv` (per `block` tile), as FP8 checkpoints store them."""
    out = {}
    for name, tensor in named.items():
        if ".mlp.experts." not in name:
            out[name] = tensor
        elif block is None:
            q, scale = quantize_per_channel(tensor)
            out[name], out[f"{name}_scale"] = q, scale[:, None]
        else:
            out[name], out[f"{name}_scale_inv"] = quantize_blocks(tensor, block)
    return out


@pytest.mark.parametrize("block", [None, (16, 16)], ids=["per-row", "blocks"])
def test_fp8_checkpoints_already_quantized_load_as_they_are(moe, tmp_path, block):
    """An FP8 checkpoint (experts in float8 with their scales) loads bit for bit as the high-precision one
    quantized on load; block scales match transformers holding the block-dequantized experts; a float8 weight
    without its scale is refused, and so is one for an engine without quantization."""
    kwargs = {"quantization": "fp8", "weight_block_size": block}
    high = LLM(str(moe["qwen3_moe_A"]), kv_cache_memory_bytes=KV, **kwargs)
    quantized = quantized_experts(tensors(moe["qwen3_moe_A"]), block)
    folder = tmp_path / "fp8"
    shutil.copytree(moe["qwen3_moe_A"], folder)
    save_file(quantized, str(folder / "model.safetensors"), metadata={"format": "pt"})
    loaded = LLM(str(folder), kv_cache_memory_bytes=KV, **kwargs)

    def experts(m):
        return [
            (n, p.detach().view(torch.uint8) if p.element_size() == 1 else p.detach().clone())
            for n, p in m.named_parameters()
            if ".experts." in n
        ]

    for (name, a), (_, b) in zip(high.apply_model(experts)[0], loaded.apply_model(experts)[0], strict=True):
        assert torch.equal(a, b), name
    if block is not None:
        reference = fp8_reference(moe["qwen3_moe_A"], block)
        assert greedy(loaded) == hf_tokens(moe["qwen3_moe_A"], loaded, model=reference)
    # an update by B's quantized experts, as a trainer quantizing on its side would send them
    b_quantized = quantized_experts(tensors(moe["qwen3_moe_B"]), block)
    loaded.reload_weights(weights_iterator=list(b_quantized.items()))
    high.reload_weights(weights_path=str(moe["qwen3_moe_B"]))
    for (name, a), (_, b) in zip(high.apply_model(experts)[0], loaded.apply_model(experts)[0], strict=True):
        assert torch.equal(a, b), name
    before = loaded.collective_rpc("weight_checksums")
    weight = "model.layers.0.mlp.experts.3.up_proj.weight"
    with pytest.raises(ValueError, match="without its weight_scale"):
        loaded.reload_weights(weights_iterator=[(weight, b_quantized[weight])])
    assert loaded.collective_rpc("weight_checksums") == before
    scale = next(n for n in b_quantized if n.startswith(weight + "_scale"))
    with pytest.raises(ValueError, match="without its float8 weight"):
        loaded.reload_weights(weights_iterator=[(scale, b_quantized[scale])])
    assert loaded.collective_rpc("weight_checksums") == before
    plain = LLM(str(moe["qwen3_moe_A"]), kv_cache_memory_bytes=KV)
    with pytest.raises(ValueError, match="quantization='fp8'"):
        plain.reload_weights(weights_iterator=[(weight, b_quantized[weight])])


@pytest.mark.parametrize(
    ("bad", "message"),
    [
        ({"model.layers.0.mlp.experts.8.gate_proj.weight": torch.zeros(48, 64)}, "experts.8.gate_proj"),
        ({"model.layers.0.mlp.experts.gate_up_proj": torch.zeros(8, 98, 64)}, "experts.gate_up_proj"),
        ({"model.layers.1.mlp.experts.down_proj": torch.zeros(7, 64, 48)}, "experts.down_proj"),
        ({"model.layers.1.mlp.experts.2.up_proj.weight": torch.full((48, 64), float("nan"))}, "experts.2.up_proj"),
    ],
    ids=["expert-out-of-range", "wrong-intermediate", "wrong-expert-count", "nan-in-one-expert"],
)
@pytest.mark.parametrize("quantization", [None, "fp8"])
def test_bad_moe_updates_name_the_tensor_and_change_nothing(moe, bad, message, quantization):
    llm = LLM(str(moe["qwen3_moe_A"]), kv_cache_memory_bytes=KV, quantization=quantization)
    before = llm.collective_rpc("weight_checksums")
    good = {n: t for n, t in tensors(moe["qwen3_moe_B"]).items() if ".layers.0." in n}
    with pytest.raises(ValueError, match=message.replace(".", r"\.")):
        llm.reload_weights(weights_iterator=list((good | bad).items()))
    llm.init_weight_transfer_engine({"backend": "tensors"})
    llm.start_weight_update()
    llm.update_weights(tensors_update_info(list(good.items())[:5]))  # a good first call: its writes roll back
    with pytest.raises(ValueError, match=message.replace(".", r"\.")):
        llm.update_weights(tensors_update_info(list(bad.items())))
    assert llm.collective_rpc("weight_checksums") == before
    assert greedy(llm, PROMPTS[:2]) == greedy(
        LLM(str(moe["qwen3_moe_A"]), kv_cache_memory_bytes=KV, quantization=quantization), PROMPTS[:2]
    )


def test_expert_post_processing_runs_in_the_config_scope_of_every_entry_point(moe):
    """FP8 MoE: every worker entry point that can reach the experts' post-processing runs it inside the
    worker's config scope; the layer itself needs no scope (it was built with its settings): post-processed outside
    any scope, it serves the same tokens."""
    calls: list[tuple[str, object]] = []
    original = FusedMoE.process_weights_after_loading
    label = ["load_model"]

    def recording(self):
        calls.append((label[0], current_config()))
        return original(self)

    with pytest.MonkeyPatch.context() as m:
        m.setattr(FusedMoE, "process_weights_after_loading", recording)
        llm = LLM(str(moe["qwen3_moe_A"]), kv_cache_memory_bytes=KV, quantization="fp8")
        worker = llm.llm_engine.executor.worker
        b = tensors(moe["qwen3_moe_B"])
        expert = [(n, t) for n, t in b.items() if ".layers.0.mlp.experts.1." in n]
        label[0] = "reload_weights"
        llm.reload_weights(weights_iterator=expert)
        llm.init_weight_transfer_engine({"backend": "tensors"})
        label[0] = "update_weights"  # every tensor of layer 1's experts: post-processed as they complete
        llm.start_weight_update()
        llm.update_weights(tensors_update_info([(n, t) for n, t in b.items() if ".layers.1.mlp.experts." in n]))
        label[0] = "finish_weight_update"  # one projection of one expert: post-processed at finish
        llm.update_weights(tensors_update_info(expert[:1]))
        llm.finish_weight_update()
        label[0] = "reload_weights(path)"
        llm.reload_weights(weights_path=str(moe["qwen3_moe_B"]))
    seen = {name for name, _ in calls}
    assert seen == {"load_model", "reload_weights", "update_weights", "finish_weight_update", "reload_weights(path)"}
    assert all(config is worker.config for _, config in calls)
    module = llm.apply_model(lambda model: model.model.layers[0].mlp.experts)[0]
    with pytest.raises(RuntimeError, match="outside a config scope"):
        current_config()
    module.process_weights_after_loading()
    assert greedy(llm) == hf_tokens(moe["qwen3_moe_B"], llm, model=fp8_reference(moe["qwen3_moe_B"]))


def test_expert_placement_splits_unevenly_and_refuses_too_few_experts():
    assert expert_placement(7, 2) == [[0, 1, 2, 3], [4, 5, 6]]
    assert expert_placement(8, 4) == [[0, 1], [2, 3], [4, 5], [6, 7]]
    with pytest.raises(ValueError, match="at least 4 experts"):
        expert_placement(3, 4)


class _Stack(nn.Module):
    def __init__(self, layers: int, experts: int, settings: LayerSettings) -> None:
        super().__init__()
        self.layers = nn.ModuleList(
            nn.ModuleDict({"experts": FusedMoE(experts, 8, 8, settings)}) for _ in range(layers)
        )


def test_name_resolution_is_linear_in_the_number_of_names(llama_dir):
    """128 experts x 48 layers (18,432 per-expert names): building the index and checking a full declaration
    grow linearly with the names (4x the layers: well under 8x the time), not quadratically."""
    config = EngineConfig.from_kwargs(str(llama_dir))

    def resolve(layers: int) -> float:
        model = _Stack(layers, 128, LayerSettings.of(config))
        best = float("inf")
        for _ in range(3):
            start = time.process_time()  # CPU time: another process sharing the cores does not count
            index = WeightIndex(model)
            declared = [(n, torch.float32, t.full_shape) for n, t in index.targets.items() if t.covers is None]
            WeightUpdate(index, atomic=True, check_finite=True).check_declaration(declared, True, frozenset())
            best = min(best, time.process_time() - start)
        assert len(declared) == layers * 128 * 3
        return best

    small, large = resolve(12), resolve(48)
    assert large < 8 * small, f"12 layers: {small * 1e3:.1f} ms, 48 layers: {large * 1e3:.1f} ms"


@pytest.fixture(scope="module")
def moe7(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Qwen3-MoE with 7 experts (not divisible by 2 ranks), A and B."""
    root = tmp_path_factory.mktemp("moe7")
    return {
        label: make_tiny_model(root / label, "qwen3_moe", seed=seed, num_experts=7)
        for label, seed in (("A", 0), ("B", 1))
    }


@pytest.mark.slow
@pytest.mark.parametrize("expert_parallel", [True, False], ids=["ep", "tp"])
@pytest.mark.cpu_only
def test_two_ranks_match_transformers_and_take_updates(moe7, expert_parallel):
    """TP=2 with expert parallelism (experts 0-3 on rank 0, 4-6 on rank 1) or with every expert split along its
    intermediate size: transformers' tokens, and updates by per-expert and fused names over tensors and
    torch_dist keep the storage and give the new weights' tokens."""
    llm = LLM(str(moe7["A"]), kv_cache_memory_bytes=KV, tensor_parallel_size=2, enable_expert_parallel=expert_parallel)
    local = llm.collective_rpc(lambda w: len(w.model.model.layers[0].mlp.experts.local_experts))
    assert local == ([4, 3] if expert_parallel else [7, 7])

    def plan_agrees(worker):  # the shard plan a trainer slices by gives exactly the shapes each rank expects
        index = WeightIndex.of(worker.model)
        for name in index.required:
            target, shape = index.targets[name], list(index.targets[name].full_shape)
            for dim, _, length in target.narrowings():
                shape[dim] = length
            if tuple(shape) != target.local_shape:
                return name
        return None

    assert llm.collective_rpc(plan_agrees) == [None, None]
    assert greedy(llm) == hf_tokens(moe7["A"], llm)
    ptrs = llm.collective_rpc(lambda w: [p.data_ptr() for n, p in w.model.named_parameters() if ".experts." in n])
    pusher = Pusher(llm, "torch_dist")
    pusher.push(list(tensors(moe7["B"]).items()))
    assert greedy(llm) == hf_tokens(moe7["B"], llm)
    pusher.close()
    pusher = Pusher(llm, "tensors")
    pusher.push(fused(tensors(moe7["A"]), 7))
    assert greedy(llm) == hf_tokens(moe7["A"], llm)
    pusher.close()
    assert (
        llm.collective_rpc(lambda w: [p.data_ptr() for n, p in w.model.named_parameters() if ".experts." in n]) == ptrs
    )
    if expert_parallel:  # each rank given only its experts' tensors (tp_ranks), the rest whole to both
        named = list(tensors(moe7["B"]).items())
        owner = [None if ".experts." not in n else int(n.split(".experts.")[1].split(".")[0]) // 4 for n, _ in named]
        llm.init_weight_transfer_engine({"backend": "tensors"})
        llm.start_weight_update()
        llm.update_weights({**tensors_update_info(named), "tp_ranks": owner})
        llm.finish_weight_update()
        assert greedy(llm) == hf_tokens(moe7["B"], llm)


@pytest.mark.slow
@pytest.mark.cpu_only
def test_experts_move_between_ranks_on_a_live_engine(moe7):
    """update_config(expert_placement=...) moves experts between the two ranks (in place when a rank keeps its
    count, in new storage when it changes): the tokens stay the same, an invalid placement changes nothing, and
    updates after the move land on the experts' new ranks."""
    llm = LLM(str(moe7["A"]), kv_cache_memory_bytes=KV, tensor_parallel_size=2, enable_expert_parallel=True)
    before = greedy(llm)

    def local(w):
        return w.model.model.layers[0].mlp.experts.local_experts

    for placement in ([[0, 2, 4, 6], [1, 3, 5]], [[5, 6], [0, 1, 2, 3, 4]]):
        llm.update_config({"parallel_config": {"expert_placement": placement}})
        assert llm.collective_rpc(local) == placement
        assert llm.llm_engine.config.parallel_config.expert_placement == placement
        assert greedy(llm) == before
    for bad in ([[0, 1, 2], [3, 4, 5]], [[0, 1, 2, 3, 4, 5, 6], []], [[0, 0, 1, 2], [3, 4, 5, 6]]):
        with pytest.raises(ValueError, match="expert_placement"):
            llm.update_config({"parallel_config": {"expert_placement": bad}})
    assert llm.collective_rpc(local) == [[5, 6], [0, 1, 2, 3, 4]]
    pusher = Pusher(llm, "tensors")
    pusher.push(list(tensors(moe7["B"]).items()))
    assert greedy(llm) == hf_tokens(moe7["B"], llm)
    pusher.close()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("grouped", [True, False], ids=["grouped_mm", "loop"])
def test_grouped_products_equal_one_linear_per_expert(monkeypatch, dtype, grouped):
    from hotswap.model.layers import fused_moe

    if not grouped:
        monkeypatch.setattr(fused_moe, "_grouped_mm_works", lambda device, dtype: False)
    counts = torch.tensor([3, 0, 5, 1, 0, 7])
    x, w = torch.randn(16, 24, dtype=dtype), torch.randn(6, 10, 24, dtype=dtype)
    starts = [0, *counts.cumsum(0).tolist()]
    expected = torch.cat([x[starts[e] : starts[e + 1]] @ w[e].T for e in range(6)])
    got = fused_moe.grouped_mm(x, w, counts)
    if grouped and hasattr(torch, "_grouped_mm") and dtype == torch.float32:
        assert fused_moe._grouped_mm_works("cpu", dtype)  # the probe itself must not refuse a working op
    torch.testing.assert_close(got, expected, atol=1e-2 if dtype == torch.bfloat16 else 1e-5, rtol=1e-2)
