"""The `device` setting on a machine without a GPU: names are checked, CUDA is refused at construction with the
reason, what has no CUDA path yet is refused naming the setting, the GPU's KV budget and KV dtype follow vLLM's
rules, the step's metadata moves to a device unchanged, and no runtime path creates a tensor on torch's implicit
default device outside a reviewed list (a tensor without `device=` lands on the CPU, beside a model on a GPU)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

from hotswap import LLM
from hotswap import config as config_module
from hotswap.config import EngineConfig
from hotswap.config import model as model_config_module
from hotswap.device import check_engine_on_device, cuda_kv_budget, parse_device
from hotswap.model.layers.attention import AttentionMetadata

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.unit
def test_device_names():
    assert parse_device("cpu") == "cpu"
    for bad in ("gpu", "cuda:x", "cpu:0", "cuda:-1", "", "CUDA"):
        with pytest.raises(ValueError, match="device"):
            parse_device(bad)


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is visible")
def test_cuda_without_a_gpu_is_refused_at_construction_with_the_reason(llama_dir):
    with pytest.raises(ValueError, match=r"no CUDA support|no CUDA GPU is visible"):
        parse_device("cuda")
    with pytest.raises(ValueError, match="device='cuda'"):
        LLM(str(llama_dir), device="cuda", kv_cache_memory_bytes=1 << 20)
    llm = LLM(str(llama_dir), device="cpu", kv_cache_memory_bytes=1 << 20)  # the default, said out loud
    assert llm.config.model_config.device == "cpu"
    assert llm.apply_model(lambda m: {p.device.type for p in m.parameters()})[0] == {"cpu"}


@pytest.mark.unit
def test_what_has_no_cuda_path_yet_is_refused_naming_the_setting():
    check_engine_on_device("cpu", deterministic=True, tensor_parallel_size=2)
    for kwargs, named in (
        ({"deterministic": True}, "deterministic=True"),
        ({"tensor_parallel_size": 2}, "tensor_parallel_size=2"),
    ):
        with pytest.raises(ValueError, match=named):
            check_engine_on_device("cuda:0", **kwargs)
    check_engine_on_device("cuda:0")


def test_a_cuda_config_takes_the_weights_dtype_for_its_kv_and_refuses_deterministic(llama_dir, monkeypatch):
    """The config's own rules for CUDA, checked without a GPU (the device name is taken as given): LoRA and a
    speculative draft are accepted, the draft on the target's device and with its `enforce_eager`."""
    monkeypatch.setattr(model_config_module, "parse_device", lambda name: "cuda:0" if name.startswith("cuda") else name)
    path = str(llama_dir)
    assert EngineConfig.from_kwargs(path, device="cuda", dtype="bfloat16").cache_config.kv_cache_dtype == "bfloat16"
    assert EngineConfig.from_kwargs(path, device="cuda", dtype="float32").cache_config.kv_cache_dtype == "float32"
    assert (
        EngineConfig.from_kwargs(
            path, device="cuda", dtype="bfloat16", kv_cache_dtype="float32"
        ).cache_config.kv_cache_dtype
        == "float32"
    )
    assert EngineConfig.from_kwargs(path, dtype="bfloat16").cache_config.kv_cache_dtype == "auto"  # CPU: float32
    with pytest.raises(ValueError, match="deterministic=True runs on the CPU"):
        EngineConfig.from_kwargs(path, device="cuda", deterministic=True)
    speculative = {"method": "draft_model", "model": path, "num_speculative_tokens": 2}
    for eager in (False, True):
        draft = EngineConfig.from_kwargs(
            path, device="cuda", speculative_config=speculative, enforce_eager=eager
        ).draft_model_config
        assert draft is not None and draft.device == "cuda:0" and draft.enforce_eager is eager
    draft = EngineConfig.from_kwargs(path, speculative_config=speculative).draft_model_config
    assert draft is not None and draft.device == "cpu"
    assert EngineConfig.from_kwargs(path, device="cuda", enable_lora=True).lora_config.enable_lora


@pytest.mark.unit
def test_the_gpu_kv_budget():
    gib = 1 << 30
    assert cuda_kv_budget(140 * gib, 0.9, 10 * gib) == int(140 * gib * 0.9) - 10 * gib
    with pytest.raises(ValueError, match=r"gpu_memory_utilization=0\.1"):
        cuda_kv_budget(140 * gib, 0.1, 20 * gib)
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        config_module.CacheConfig(gpu_memory_utilization=1.5)


@pytest.mark.unit
def test_attention_metadata_moves_whole():
    """Every tensor of a step's metadata, its parts' included, arrives on the device unchanged."""
    meta = AttentionMetadata.build([1, 1, 40], [9, 17, 40], [[3, 1], [0, 2, 5], [4, 6, 7, 8, 9]], 8, kernel=None)
    assert meta.parts is not None
    moved = meta.to(torch.device("cpu"))

    def tensors(m: AttentionMetadata) -> list[torch.Tensor | None]:
        return [m.slot_mapping, m.block_tables, m.context_lens, m.pad_index, m.mask, m.query_lens]

    for a, b in [(meta, moved), *zip([p for _, p in meta.parts], [p for _, p in moved.parts or []], strict=True)]:
        for x, y in zip(tensors(a), tensors(b), strict=True):
            assert (x is None) == (y is None) and (x is None or torch.equal(x, y))
    assert [torch.equal(r, s) for (r, _), (s, _) in zip(meta.parts, moved.parts or [], strict=True)] == [True, True]


# ---- tensors created on the implicit default device ----------------------------------------------------------

CONSTRUCTORS = {"tensor", "as_tensor", "arange", "zeros", "ones", "empty", "full", "rand", "randn", "randint"}
RUNTIME = ("hotswap/worker", "hotswap/model", "hotswap/weights", "hotswap/transfer", "hotswap/lora")
# (file or folder, function or "*") -> why a tensor there may be created without `device=`
ALLOWED = {
    ("hotswap/model", "__init__"): "construction: build_model runs every constructor under torch.device(device)",
    ("hotswap/model/layers/linear.py", "_param"): "construction (see __init__)",
    ("hotswap/model/layers/fused_moe.py", "_param"): "construction (see __init__)",
    ("hotswap/model/layers/attention.py", "build"): "the step's metadata: built on the host, moved once (to())",
    ("hotswap/model/layers/attention.py", "_split"): "the step's metadata (see build)",
    ("hotswap/model/layers/attention.py", "_rope_attend_exact"): "deterministic mode: refused on CUDA",
    ("hotswap/model/layers/attention.py", "reference"): "deterministic mode's trainer reference: CPU only",
    ("hotswap/model/layers/sampler.py", "uniforms_for"): "uniforms drawn on the host: seeded draws device-free",
    ("hotswap/model/layers/sampler.py", "uniform_for"): "a seeded row's generator, on the host",
    ("hotswap/worker/speculative.py", "broadcast_ids"): "proposed ids, host values sent over the gloo group",
    ("hotswap/worker/decoder_stack.py", "time_step"): "the native CPU decoder stack",
    ("hotswap/worker/model_runner.py", "hidden_states"): "ids and positions: built on the host, moved once",
    ("hotswap/worker/model_runner.py", "bytes_per_block"): "an element size",
    ("hotswap/worker/model_runner.py", "zeroed"): "its CPU branch (an anonymous mapping)",
    ("hotswap/worker/cuda_graphs.py", "run"): "a step's inputs, built on the host, copied into the graphs' buffers",
    ("hotswap/worker/worker.py", "_move_experts"): "a flag summed over the gloo group",
    ("hotswap/weights/safetensors_io.py", "iterate_index"): "checkpoint bytes read on the host",
    ("hotswap/transfer", "*"): "wire buffers and shm views live on the host",
    ("hotswap/weights/delta.py", "xor_dtype"): "a dtype's element size",
    ("hotswap/weights/checks.py", "magnitude_bound"): "a scalar bound read with .item()",
    ("hotswap/weights/source.py", "random_source"): "dummy weights generated on the host, copied in like a file's",
}


def implicit_device_tensors(root: Path) -> list[tuple[str, str, int]]:
    """(file, enclosing function, line) of every `torch.<constructor>(...)` without `device=` under RUNTIME."""
    found = []
    for folder in RUNTIME:
        for file in sorted((root / folder).rglob("*.py")):
            tree = ast.parse(file.read_text(), filename=str(file))
            for fn in ast.walk(tree):
                if not isinstance(fn, ast.FunctionDef | ast.AsyncFunctionDef):
                    continue
                for node in ast.walk(fn):
                    if (
                        isinstance(node, ast.Call)
                        and isinstance(node.func, ast.Attribute)
                        and node.func.attr in CONSTRUCTORS
                        and ast.unparse(node.func.value) == "torch"
                        and not any(k.arg == "device" for k in node.keywords)
                    ):
                        found.append((file.relative_to(root).as_posix(), fn.name, node.lineno))
    return sorted(set(found))


def allowed(file: str, function: str) -> bool:
    return any((file == place or file.startswith(place + "/")) and name in (function, "*") for place, name in ALLOWED)


@pytest.mark.unit
def test_no_runtime_tensor_lands_on_the_implicit_device():
    found = implicit_device_tensors(ROOT)
    unreviewed = [f"{f}:{line} in {fn}()" for f, fn, line in found if not allowed(f, fn)]
    assert unreviewed == [], (
        "tensors created without device= (pass the device, or add a reviewed reason):\n" + "\n".join(unreviewed)
    )
    stale = [
        key
        for key in ALLOWED
        if not any((f == key[0] or f.startswith(key[0] + "/")) and key[1] in (fn, "*") for f, fn, _ in found)
    ]
    assert stale == [], f"allowlist entries that match nothing any more: {stale}"


@pytest.mark.unit
def test_the_device_guard_finds_a_planted_tensor(tmp_path):
    planted = tmp_path / "hotswap" / "worker" / "runner.py"
    planted.parent.mkdir(parents=True)
    planted.write_text(
        "import torch\n\ndef step(x):\n    return torch.arange(4) + x\n\n"
        "def fine(x):\n    return torch.arange(4, device=x.device)\n"
    )
    assert implicit_device_tensors(tmp_path) == [("hotswap/worker/runner.py", "step", 4)]


@pytest.mark.cuda
def test_an_update_on_the_gpu_is_checked_in_one_pass_rolled_back_and_then_taken(ckpts, b_tensors, device):
    """On a GPU: a NaN in a pushed tensor is refused (the fused device check) with the weights bit-identical; the
    clean push is taken and checksummed as the trainer's tensors; the engine then serves checkpoint B."""
    from conftest import serves
    from hotswap.weights.checksum import tensor_sha256

    llm = LLM(str(ckpts["A"]), device=device, kv_cache_memory_bytes=1 << 22)
    before = llm.weight_checksums()
    bad = [(n, t.clone().to(device)) for n, t in b_tensors]
    bad[-1][1].view(-1)[3] = float("nan")
    with pytest.raises(ValueError, match="NaN"):
        llm.reload_weights(weights_iterator=bad)
    assert llm.weight_checksums() == before
    llm.reload_weights(weights_iterator=[(n, t.to(device)) for n, t in b_tensors])
    after = llm.weight_checksums()
    assert after == {n: tensor_sha256(t) for n, t in b_tensors}
    assert serves(llm, ckpts["B"])


@pytest.mark.cuda
def test_sleep_and_wake_on_the_gpu(ckpts, b_tensors, device):
    """On a GPU: level 1 moves the weights to host memory and frees their device memory; wake_up brings them back
    bit for bit (new device memory, the decode graphs captured again) and the engine serves A as before. Level 2
    frees them without a copy: refused until a reload, which then serves B. A staged update commits by a device
    copy, so the graphs captured before it keep replaying."""
    from conftest import serves

    llm = LLM(str(ckpts["A"]), device=device, kv_cache_memory_bytes=1 << 22)
    before = llm.weight_checksums()
    free_before = torch.cuda.mem_get_info(device)[0]
    llm.sleep(1)
    assert torch.cuda.mem_get_info(device)[0] > free_before, "sleep(1) released no device memory"
    with pytest.raises(RuntimeError, match="asleep"):
        llm.collective_rpc("weight_checksums")
    llm.wake_up()
    assert llm.weight_checksums() == before
    assert serves(llm, ckpts["A"])
    llm.sleep(2)
    llm.wake_up(["weights"])
    llm.wake_up(["kv_cache"])
    with pytest.raises(RuntimeError):
        llm.generate([[1, 2, 3]], use_tqdm=False)
    llm.reload_weights(weights_path=str(ckpts["B"]))
    assert serves(llm, ckpts["B"])
    staged = LLM(str(ckpts["A"]), device=device, update_staging="shadow", kv_cache_memory_bytes=1 << 22)
    assert serves(staged, ckpts["A"])
    pointers = staged.apply_model(lambda m: [p.data_ptr() for p in m.parameters()])
    staged.reload_weights(weights_path=str(ckpts["B"]))
    assert staged.apply_model(lambda m: [p.data_ptr() for p in m.parameters()]) == pointers
    assert serves(staged, ckpts["B"])


@pytest.mark.cuda
@pytest.mark.parametrize("backup_device", ["cpu", "device"])
def test_rollback_copies_where_the_user_says(ckpts, b_tensors, device, backup_device):
    """A streamed session that fails after writing rolls back bit for bit from rollback copies kept in page-locked
    host memory ("cpu") or in HBM ("device")."""
    from transfer_helpers import Pusher

    llm = LLM(str(ckpts["A"]), device=device, kv_cache_memory_bytes=1 << 22, backup_device=backup_device)
    before = llm.weight_checksums()
    pusher = Pusher(llm, "shm")
    try:
        llm.start_weight_update()
        pusher.update(b_tensors[:4])  # written (and backed up) before the bad one arrives
        bad = [(n, t.clone()) for n, t in b_tensors[4:]]
        bad[-1][1].view(-1)[0] = float("nan")
        with pytest.raises(ValueError, match="restored"):
            pusher.update(bad)
        (where,) = llm.collective_rpc(lambda w: {str(t.device) for t in w.session.backups.values()})
        assert where == ({"cpu"} if backup_device == "cpu" else {str(torch.empty(0, device=device).device)})
        assert llm.weight_checksums() == before
    finally:
        pusher.close()


@pytest.mark.cuda
def test_lora_and_speculative_decoding_on_the_gpu(llama_dir, tmp_path, device):
    """On a GPU: greedy tokens of rows on a LoRA adapter (beside base rows, in one batch) equal transformers' with
    PEFT's merged weights on the same GPU, the base rows and a base-only batch afterwards (decode graphs again)
    transformers' own; the adapter's tensors live on the GPU. Speculative decoding, by prompt lookup, by a draft
    that always agrees (the target itself) and by one that rarely does, emits exactly the tokens of greedy
    decoding without it on the GPU."""
    peft = pytest.importorskip("peft")
    from transformers import AutoModelForCausalLM

    from conftest import PROMPTS, hf_greedy
    from hotswap import LoRARequest, SamplingParams
    from hotswap.testing import make_tiny_lora, make_tiny_model

    tokens = 8
    greedy = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    adapter = make_tiny_lora(llama_dir, tmp_path / "adapter", rank=8, seed=1)
    base = AutoModelForCausalLM.from_pretrained(str(llama_dir), dtype=torch.float32)
    merged = peft.PeftModel.from_pretrained(base, str(adapter)).merge_and_unload().to(device).eval()

    def merged_greedy(prompt_ids: list[int]) -> list[int]:
        with torch.no_grad():
            out = merged.generate(
                torch.tensor([prompt_ids], device=device),
                max_new_tokens=tokens,
                min_new_tokens=tokens,
                do_sample=False,
                pad_token_id=0,
                attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long, device=device),
            )
        return list(out[0, len(prompt_ids) :].tolist())

    llm = LLM(
        str(llama_dir), device=device, enable_lora=True, max_loras=1, max_lora_rank=8, kv_cache_memory_bytes=1 << 23
    )
    ids = [llm.get_tokenizer().encode(p) for p in PROMPTS[:4]]
    request = LoRARequest("a", 1, str(adapter))
    loras = [request, None, request, request]
    outs = llm.generate([{"prompt_token_ids": i} for i in ids], greedy, lora_request=loras, use_tqdm=False)
    for prompt_ids, out, lora in zip(ids, outs, loras, strict=True):
        expected = (
            merged_greedy(prompt_ids)
            if lora is not None
            else hf_greedy(str(llama_dir), tuple(prompt_ids), tokens, device=device)[0]
        )
        assert out.outputs[0].token_ids == expected
    assert merged_greedy(ids[0]) != hf_greedy(str(llama_dir), tuple(ids[0]), tokens, device=device)[0]
    (places,) = llm.collective_rpc(lambda w: {p.device.type for a in w.loras.adapters.values() for p in a.parameters()})
    assert places == {"cuda"}
    plain = llm.generate([{"prompt_token_ids": i} for i in ids], greedy, use_tqdm=False)
    for prompt_ids, out in zip(ids, plain, strict=True):
        assert out.outputs[0].token_ids == hf_greedy(str(llama_dir), tuple(prompt_ids), tokens, device=device)[0]
    llm.shutdown()

    prompts = [*PROMPTS, "a b c d a b c d a b c d a b c d"]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)

    def token_ids(engine: LLM) -> list[list[int]]:
        return [o.outputs[0].token_ids for o in engine.generate(prompts, params, use_tqdm=False)]

    expected = token_ids(LLM(str(llama_dir), device=device, kv_cache_memory_bytes=1 << 23))
    draft = make_tiny_model(
        tmp_path / "draft",
        seed=11,
        num_hidden_layers=1,
        hidden_size=32,
        intermediate_size=64,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
    )
    for config in (
        {"method": "ngram", "num_speculative_tokens": 4},
        {"method": "draft_model", "model": str(llama_dir), "num_speculative_tokens": 3},
        {"method": "draft_model", "model": str(draft), "num_speculative_tokens": 3},
    ):
        spec = LLM(str(llama_dir), device=device, kv_cache_memory_bytes=1 << 23, speculative_config=config)
        assert token_ids(spec) == expected, config
        stats = spec.llm_engine.stats()
        assert stats["spec_draft_tokens"] > 0, config
        if config.get("model") == str(llama_dir):  # the target as its own draft: (nearly) every proposal taken
            assert stats["spec_acceptance_rate"] > 0.9
        spec.shutdown()
