"""Live weight updates: every transport, fp8 re-quantization, reload, partial and tied updates."""

from __future__ import annotations

import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from conftest import PROMPTS, hf_greedy, hf_model
from hotswap import LLM, SamplingParams
from hotswap.model.layers.quant.fp8 import dequantize, quantize_per_channel
from hotswap.testing import make_tiny_model
from transfer_helpers import BACKENDS, Pusher

GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory, ckpts):
    """The shared A/B pair plus a tied-embedding qwen3 pair."""
    root = tmp_path_factory.mktemp("update_models")
    return {
        **ckpts,
        "A_tied": make_tiny_model(root / "A_tied", arch="qwen3", seed=0, tie_word_embeddings=True),
        "B_tied": make_tiny_model(root / "B_tied", arch="qwen3", seed=1, tie_word_embeddings=True),
    }


def tensors_of(path) -> list[tuple[str, torch.Tensor]]:
    return list(load_file(str(path / "model.safetensors")).items())


def greedy_tokens(llm: LLM, prompts=PROMPTS[:4]) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]


def hf_tokens(path, llm: LLM, prompts=PROMPTS[:4]) -> list[list[int]]:
    tok = llm.get_tokenizer()
    return [hf_greedy(str(path), tuple(tok.encode(p)), 16)[0] for p in prompts]


def storage(llm: LLM) -> dict[str, int]:
    return llm.apply_model(lambda m: {n: p.data_ptr() for n, p in m.named_parameters()})[0]


@pytest.mark.parametrize("backend", BACKENDS)
def test_push_b_into_a_matches_transformers_with_b(ckpts, backend):
    llm = LLM(str(ckpts["A"]), kv_cache_memory_bytes=1 << 22)
    assert greedy_tokens(llm) == hf_tokens(ckpts["A"], llm)
    ptrs = storage(llm)
    pusher = Pusher(llm, backend)
    pusher.push(tensors_of(ckpts["B"]))
    assert greedy_tokens(llm) == hf_tokens(ckpts["B"], llm)
    assert storage(llm) == ptrs
    assert llm.get_weight_version() == 1
    pusher.push(tensors_of(ckpts["A"]), weight_version=7)
    assert greedy_tokens(llm) == hf_tokens(ckpts["A"], llm)
    assert llm.get_weight_version() == 7
    pusher.close()


def fp8_reference_tokens(path, llm: LLM, prompts=PROMPTS[:4]) -> list[list[int]]:
    """transformers with `path`'s weights, each decoder linear quantized and dequantized like hotswap does."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    with torch.no_grad():
        for name, module in model.named_modules():
            if isinstance(module, torch.nn.Linear) and name.startswith("model.layers."):
                q, scale = quantize_per_channel(module.weight)
                module.weight.copy_(dequantize(q, scale, torch.float32))
    tok = llm.get_tokenizer()
    out = []
    for p in prompts:
        ids = tok.encode(p)
        gen = model.generate(
            torch.tensor([ids]),
            max_new_tokens=16,
            min_new_tokens=16,
            do_sample=False,
            pad_token_id=0,
            attention_mask=torch.ones(1, len(ids), dtype=torch.long),
        )
        out.append(gen[0, len(ids) :].tolist())
    return out


@pytest.mark.parametrize("backend", BACKENDS)
def test_fp8_push_requantizes_from_new_weights(ckpts, backend):
    llm = LLM(str(ckpts["A"]), kv_cache_memory_bytes=1 << 22, quantization="fp8")
    dtypes = llm.apply_model(lambda m: m.model.layers[0].self_attn.qkv_proj.weight.dtype)[0]
    assert dtypes == torch.float8_e4m3fn
    before = greedy_tokens(llm)
    assert before == fp8_reference_tokens(ckpts["A"], llm)
    ptrs = storage(llm)
    pusher = Pusher(llm, backend)
    pusher.push(tensors_of(ckpts["B"]))
    after = greedy_tokens(llm)
    assert after == fp8_reference_tokens(ckpts["B"], llm)
    assert after != before
    assert storage(llm) == ptrs
    pusher.close()


def test_reload_from_new_path_and_back(ckpts):
    llm = LLM(str(ckpts["A"]), kv_cache_memory_bytes=1 << 22)
    ptrs = storage(llm)
    llm.reload_weights(weights_path=str(ckpts["B"]))
    assert greedy_tokens(llm) == hf_tokens(ckpts["B"], llm)
    assert llm.config.model_config.model == str(ckpts["B"])
    assert llm.get_weight_version() == 1
    llm.reload_weights()  # re-reads the recorded folder (B)
    assert greedy_tokens(llm) == hf_tokens(ckpts["B"], llm)
    llm.reload_weights(weights_iterator=hf_model(str(ckpts["A"])).named_parameters())
    assert greedy_tokens(llm) == hf_tokens(ckpts["A"], llm)
    assert storage(llm) == ptrs and llm.get_weight_version() == 3


def test_reload_rejects_a_differently_shaped_checkpoint(ckpts, tmp_path):
    llm = LLM(str(ckpts["A"]), kv_cache_memory_bytes=1 << 22)
    other = make_tiny_model(tmp_path / "wide", arch="llama", hidden_size=96)
    with pytest.raises(ValueError, match="different model shape"):
        llm.reload_weights(weights_path=str(other))
    assert greedy_tokens(llm) == hf_tokens(ckpts["A"], llm)


def test_reload_prefix_cache_is_invalidated(ckpts):
    llm = LLM(str(ckpts["A"]), kv_cache_memory_bytes=1 << 22, block_size=4)
    prompt = [PROMPTS[7]]
    greedy_tokens(llm, prompt)
    llm.reload_weights(weights_path=str(ckpts["B"]))
    out = llm.generate(prompt, GREEDY, use_tqdm=False)[0]
    assert out.num_cached_tokens == 0
    assert out.outputs[0].token_ids == hf_tokens(ckpts["B"], llm, prompt)[0]


def test_update_config_validates_and_applies(ckpts):
    llm = LLM(str(ckpts["A"]), kv_cache_memory_bytes=1 << 22)
    cfg = llm.config
    llm.update_config({"weight_transfer_config": {"atomic": False, "timeout_s": 5.0}})
    assert cfg.weight_transfer_config.atomic is False and cfg.weight_transfer_config.timeout_s == 5.0
    for overrides, message in [
        ({"nope_config": {}}, "unknown config section"),
        ({"load_config": {"nope": 1}}, "unknown field"),
        ({"load_config": {"load_format": "pickle"}}, "load_format"),
        ({"weight_transfer_config": {"timeout_s": -1}}, "timeout_s"),
        ({"model_config": {"dtype": "bfloat16"}}, "cannot change on a live engine"),
        ({"model_config": {"model": "/nonexistent/folder"}}, "does not exist"),
        ("not a dict", "overrides must be a dict"),
    ]:
        with pytest.raises(ValueError, match=message):
            llm.update_config(overrides)
    assert cfg.weight_transfer_config.timeout_s == 5.0 and cfg.load_config.load_format == "safetensors"
    llm.update_config({"model_config": {"model": str(ckpts["B"])}})
    llm.reload_weights()
    assert greedy_tokens(llm) == hf_tokens(ckpts["B"], llm)


def test_partial_update_of_one_layer_leaves_the_rest(ckpts, tmp_path):
    llm = LLM(str(ckpts["A"]), kv_cache_memory_bytes=1 << 22)
    before = llm.weight_checksums()
    b = dict(tensors_of(ckpts["B"]))
    only_q = [("model.layers.1.self_attn.q_proj.weight", b["model.layers.1.self_attn.q_proj.weight"])]
    pusher = Pusher(llm, "tensors")
    pusher.push(only_q)
    pusher.close()
    after = llm.weight_checksums()
    changed = {n for n in before if before[n] != after[n]}
    assert changed == {"model.layers.1.self_attn.q_proj.weight"}  # k and v slices of the fused weight unchanged
    q_rows = llm.apply_model(lambda m: m.model.layers[1].self_attn.qkv_proj.weight[: 4 * 16].clone())[0]
    torch.testing.assert_close(q_rows, b["model.layers.1.self_attn.q_proj.weight"], rtol=0, atol=0)
    a = dict(tensors_of(ckpts["A"]))
    kv_rows = llm.apply_model(lambda m: m.model.layers[1].self_attn.qkv_proj.weight[4 * 16 :].clone())[0]
    expected = torch.cat([a["model.layers.1.self_attn.k_proj.weight"], a["model.layers.1.self_attn.v_proj.weight"]])
    torch.testing.assert_close(kv_rows, expected, rtol=0, atol=0)
    # the reference: A with B's q_proj in layer 1
    mixed = tmp_path / "mixed"
    shutil.copytree(ckpts["A"], mixed)
    save_file({**a, **dict(only_q)}, str(mixed / "model.safetensors"))
    assert greedy_tokens(llm) == hf_tokens(mixed, llm)


def test_fp8_partial_update_requantizes_only_its_rows(ckpts):
    llm = LLM(str(ckpts["A"]), kv_cache_memory_bytes=1 << 22, quantization="fp8")

    def get(m):
        return (
            m.model.layers[0].mlp.gate_up_proj.weight.clone(),
            m.model.layers[0].mlp.gate_up_proj.weight_scale.clone(),
        )

    w0, s0 = llm.apply_model(get)[0]
    up_b = dict(tensors_of(ckpts["B"]))["model.layers.0.mlp.up_proj.weight"]
    llm.reload_weights(weights_iterator=[("model.layers.0.mlp.up_proj.weight", up_b)])
    w1, s1 = llm.apply_model(get)[0]
    inter = up_b.shape[0]
    assert torch.equal(w1[:inter].view(torch.uint8), w0[:inter].view(torch.uint8)) and torch.equal(
        s1[:inter], s0[:inter]
    )
    q, s = quantize_per_channel(up_b)
    assert torch.equal(w1[inter:].view(torch.uint8), q.view(torch.uint8)) and torch.equal(s1[inter:], s)


@pytest.mark.parametrize("name", ["lm_head.weight", "model.embed_tokens.weight"])
def test_tied_embeddings_stay_tied_whichever_name_arrives(ckpts, name):
    llm = LLM(str(ckpts["A_tied"]), kv_cache_memory_bytes=1 << 22)
    b = dict(tensors_of(ckpts["B_tied"]))
    emb_b = b["model.embed_tokens.weight"]
    llm.reload_weights(weights_iterator=[(name, emb_b)])
    same, equal = llm.apply_model(
        lambda m: (
            m.lm_head_weight.data_ptr() == m.model.embed_tokens.weight.data_ptr(),
            torch.equal(m.model.embed_tokens.weight, emb_b),
        )
    )[0]
    assert same and equal
    llm.reload_weights(weights_iterator=list(b.items()))
    assert greedy_tokens(llm) == hf_tokens(ckpts["B_tied"], llm)


# ---- torch_dist: device and collective backend settings -------------------------------------------------------


def _dist_engine(port: int, **extra):
    from hotswap.config import WeightTransferConfig
    from hotswap.transfer.torch_dist import TorchDistEngine

    info = {"backend": "torch_dist", "master_address": "127.0.0.1", "master_port": port, **extra}
    return TorchDistEngine(info, WeightTransferConfig(timeout_s=60))


@pytest.mark.unit
def test_torch_dist_settings_are_validated_with_clear_errors():
    from hotswap.testing import free_port
    from hotswap.transfer.torch_dist import TorchDistSender, resolve_group_settings

    assert resolve_group_settings("cpu", None) == ("cpu", "gloo")
    assert resolve_group_settings("cpu", "gloo") == ("cpu", "gloo")
    port = free_port()
    for extra, message in [
        ({"dist_backend": "mpi"}, "dist_backend must be one of"),
        ({"dist_backend": "nccl", "device": "cpu"}, "'nccl' moves CUDA tensors only"),
        ({"device": "gpu0"}, "device must be 'cpu', 'cuda' or 'cuda:N'"),
        ({"device": "cpu:1"}, "the CPU takes no index"),
        ({"device": 3}, "device must be"),
    ]:
        with pytest.raises(ValueError, match=message):
            _dist_engine(port, **extra)
    with pytest.raises(ValueError, match="'nccl' moves CUDA tensors only"):
        TorchDistSender("127.0.0.1", port, device="cpu", dist_backend="nccl")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="device='cuda'"):
            _dist_engine(port, device="cuda")


def _dist_tensors() -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    return [
        ("a", torch.randn(300, generator=g)),  # several buckets of 4 KiB: two in flight at a time
        ("b", torch.randn(40, 50, generator=g).to(torch.bfloat16)),
        ("empty", torch.empty(0, 3)),
        ("c", torch.randint(0, 9, (2000,), generator=g)),
        ("d", torch.randn(5, generator=g)),
    ]


def _receive_from_trainer_process(device: str, dist_backend: str | None, trainer_device: str | None = None) -> None:
    """A trainer in its own (spawned) process broadcasts buckets packed on `trainer_device` (default `device`);
    the engine receives onto `device` over `dist_backend`, twice (the buffers are reused), bit for bit."""
    import multiprocessing as mp
    import time

    from hotswap.testing import free_port
    from transfer_helpers import torch_dist_trainer

    ctx = mp.get_context("spawn")
    infos, go = ctx.Queue(), ctx.Queue()
    port, named = free_port(), _dist_tensors()
    args = (port, named, trainer_device or device, dist_backend, 4096, infos, go)
    trainer = ctx.Process(target=torch_dist_trainer, args=args)
    trainer.start()
    engine = None
    try:
        extra = {"device": device} | ({} if dist_backend is None else {"dist_backend": dist_backend})
        engine = _dist_engine(port, **extra)
        deadline = time.monotonic() + 60
        while not engine.ready():
            assert time.monotonic() < deadline, "the engine did not join the trainer's group"
            time.sleep(0.01)
        info = infos.get(timeout=60)
        for _ in range(2):
            go.put("send")
            got = [(n, t.clone()) for n, t in engine.source(info).tensors()]
            assert infos.get(timeout=60) == "sent"
            assert [n for n, _ in got] == [n for n, _ in named]
            for (name, want), (_, have) in zip(named, got, strict=True):
                assert have.device == torch.device(engine.device), name
                assert torch.equal(have.cpu(), want), name
    finally:
        go.put("stop")
        if engine is not None:
            engine.shutdown()
        trainer.join(timeout=60)
    assert trainer.exitcode == 0


def test_torch_dist_gloo_on_the_cpu_named_explicitly():
    _receive_from_trainer_process("cpu", "gloo")


@pytest.mark.cuda
def test_torch_dist_gloo_with_cuda_buckets_on_one_gpu(device):
    """The device-bucket path (two CUDA buckets in flight) on one GPU: gloo broadcasts CUDA tensors."""
    _receive_from_trainer_process(device, "gloo")


@pytest.mark.cuda
def test_torch_dist_nccl_between_two_gpus(device):
    if torch.cuda.device_count() < 2:
        pytest.skip("NCCL pairs two processes on two GPUs only")
    _receive_from_trainer_process("cuda:1", "nccl", trainer_device="cuda:0")  # NCCL refuses two ranks on one GPU


@pytest.mark.parametrize("backend", ["shm", "disk"])
def test_a_staged_host_transport_updates_the_engine(ckpts, backend, monkeypatch):
    """The host transports' device staging (what a CUDA engine gets), run on the CPU with unpinned slots: the
    streamed source goes through the real update path, bit for bit."""
    import importlib

    from hotswap.weights.host_staging import HostStaging

    stagers: list[HostStaging] = []

    def staging_for(init_info):
        stagers.append(HostStaging("cpu", slot_bytes=4096, pin=False))
        return stagers[-1]

    monkeypatch.setattr(importlib.import_module(f"hotswap.transfer.{backend}"), "staging_for", staging_for)
    llm = LLM(str(ckpts["A"]), kv_cache_memory_bytes=1 << 22)
    reference = LLM(str(ckpts["B"]), kv_cache_memory_bytes=1 << 22)
    pusher = Pusher(llm, backend)
    pusher.push(tensors_of(ckpts["B"]))
    assert stagers and stagers[-1].stats.tensors == len(tensors_of(ckpts["B"]))
    assert llm.weight_checksums() == reference.weight_checksums()
    assert greedy_tokens(llm) == greedy_tokens(reference)
    pusher.close()
