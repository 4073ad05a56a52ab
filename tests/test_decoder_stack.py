"""The native decoder stack (`decoder_layers`, one call per step for small float32 batches) against the module
path it replaces: the same kernels in the same order, so the same bits in outputs and caches.

Whole engine runs are compared with a tolerance of 1e-6 only because their full prefills go to MKL in both runs,
whose last bits may depend on buffer alignment; a forward pass on the same inputs and caches is compared to the
bit."""

from __future__ import annotations

import pytest
import torch

from conftest import PROMPTS
from hotswap import LLM, SamplingParams
from hotswap.kernels import packed as packing
from hotswap.kernels.policy import use_mode
from hotswap.model.layers.attention import AttentionMetadata
from hotswap.model.step import StepContext
from hotswap.testing import make_tiny_lora, make_tiny_model
from hotswap.worker.decoder_stack import NativeDecoderStack

PARAMS = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=2)


@pytest.fixture(scope="module")
def ops(native_kernels):
    return native_kernels


@pytest.fixture(autouse=True)
def _stack_path():
    """The stack's exactness holds on every build (where the calibration finds it slower, it is not taken)."""
    with use_mode("native"):
        yield


def _run(path: str, monkeypatch: pytest.MonkeyPatch, native_stack: bool) -> tuple[list, list[torch.Tensor], int]:
    """Outputs of two runs of PROMPTS (the second one's prefills hit the prefix cache: steps of a few new tokens
    per prompt, with query_lens), every layer's KV cache afterwards, and how many forward passes took the native
    stack."""
    used = []
    real_run, real_applies = NativeDecoderStack.run, NativeDecoderStack.applies

    def counted(self, *args):
        used.append(1)
        return real_run(self, *args)

    monkeypatch.setattr(NativeDecoderStack, "run", counted)
    if not native_stack:
        monkeypatch.setattr(NativeDecoderStack, "applies", lambda self, *args: False)
    llm = LLM(path, kv_cache_memory_bytes=1 << 22)
    try:
        outs = [llm.generate(PROMPTS, PARAMS, use_tqdm=False) for _ in range(2)]
        caches = llm.apply_model(
            lambda model: [
                t.clone()
                for layer in model.model.layers
                for t in (layer.self_attn.attn.k_cache, layer.self_attn.attn.v_cache)
            ]
        )[0]
    finally:
        llm.shutdown()
        monkeypatch.setattr(NativeDecoderStack, "run", real_run)
        monkeypatch.setattr(NativeDecoderStack, "applies", real_applies)
    return outs, caches, len(used)


@pytest.fixture(scope="module")
def biased_llama(tmp_path_factory: pytest.TempPathFactory):
    folder = tmp_path_factory.mktemp("biased") / "llama"
    return make_tiny_model(folder, arch="llama", attention_bias=True, mlp_bias=True)


@pytest.mark.parametrize("name", ["llama", "llama_tied", "qwen2", "biased"])  # qwen2: q/k/v biases; biased: all
def test_native_stack_gives_the_module_paths_bits(ops, model_dirs, biased_llama, monkeypatch, name):
    path = str(biased_llama if name == "biased" else model_dirs[name])
    fast, fast_caches, native_steps = _run(path, monkeypatch, native_stack=True)
    slow, slow_caches, none = _run(path, monkeypatch, native_stack=False)
    # every decode step of both runs, and the second run's prefill (the prompts' last tokens); never a full prefill
    assert native_steps == 2 * (PARAMS.max_tokens - 1) + 1 and none == 0
    for a, b in zip(fast[0] + fast[1], slow[0] + slow[1], strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert a.outputs[0].cumulative_logprob == pytest.approx(b.outputs[0].cumulative_logprob, abs=1e-6)
        for step_a, step_b in zip(a.outputs[0].logprobs, b.outputs[0].logprobs, strict=True):
            assert step_a.keys() == step_b.keys()
            assert all(step_a[t].logprob == pytest.approx(step_b[t].logprob, abs=1e-6) for t in step_a)
    for a, b in zip(fast_caches, slow_caches, strict=True):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize(
    ("name", "lora", "dtype", "kv", "rows"),
    [
        ("qwen2", False, "float32", "auto", 8),
        ("biased", False, "float32", "auto", 8),
        ("qwen2", True, "float32", "auto", 8),
        ("biased", True, "float32", "auto", 8),
        ("qwen2", False, "bfloat16", "auto", 8),
        ("biased", False, "bfloat16", "auto", 8),
        ("llama", False, "bfloat16", "bfloat16", 8),
        ("biased", False, "float32", "auto", 2),
        ("biased", False, "float32", "onednn", 1),
        ("biased", False, "bfloat16", "auto", 3),
        ("biased", False, "bfloat16", "packed", 8),
        ("qwen2", False, "bfloat16", "packed", 2),
    ],
)
def test_native_stack_forward_is_the_module_forward_to_the_bit(
    ops, model_dirs, biased_llama, name, lora, dtype, kv, rows, tmp_path, monkeypatch
):
    """One decode step of `rows` sequences (contexts of 5 to 40 tokens over scattered blocks) from the same inputs
    and caches, through the native stack and through the modules: the same hidden states and caches, bit for bit.
    `lora`: rows 0-3 run with one LoRA adapter (every projection) and rows 4-7 with another (q/v/down only).
    bfloat16: the native bf16 products, or ("packed") torch's, every weight oneDNN-packed where oneDNN can (a
    float32 or a bf16 cache). Below 4 rows the fp32 products are torch's whatever the policy (the modules' choice
    there); "onednn": with oneDNN's fp32 product taken for every shape, as on a CPU where it beats the BLAS."""
    path = str(biased_llama if name == "biased" else model_dirs[name])
    if dtype == "bfloat16" and packing.supported():
        monkeypatch.setattr(packing, "faster", lambda *shape: True)
    if kv == "onednn":
        if not packing.dense_supported():
            pytest.skip("torch has no oneDNN linear here")
        monkeypatch.setattr(packing, "dense_faster", lambda *shape: True)
        kv = "auto"
    if kv == "packed":  # the products off the native kernels: torch's, oneDNN-packed where oneDNN can
        from hotswap.kernels import ops as facade
        from hotswap.kernels.policy import OPS, Decision, KernelPolicy

        decisions = {op: Decision.rule(op, op not in ("linear", "gated_linear"), "test") for op in OPS}
        mixed = KernelPolicy("native", decisions, None)
        monkeypatch.setattr(facade, "policy", lambda: mixed)
        kv = "auto"

    def adapters(worker):
        if not lora:
            return None
        first, second = sorted(worker.loras.adapters)
        return worker.loras.batch([(first, 0, 4), (second, 4, 8)], rows)

    def compare(worker):
        model, kernel, stack = worker.model.model, worker.runner.attention_kernel, worker.runner.stack
        attn = model.layers[0].self_attn.attn
        block_size = attn.k_cache.shape[1]
        gen = torch.Generator().manual_seed(0)
        contexts = torch.randint(5, 41, (rows,), generator=gen).tolist()
        blocks = torch.randperm(attn.k_cache.shape[0] - 1, generator=gen) + 1
        tables, used = [], 0
        for c in contexts:
            n = -(-c // block_size)
            tables.append(blocks[used : used + n].tolist())
            used += n
        meta = AttentionMetadata.build([1] * rows, contexts, tables, block_size, kernel)
        ids = torch.randint(0, 100, (rows,), generator=gen)
        positions = torch.tensor(contexts) - 1
        caches = [layer.self_attn.attn for layer in model.layers]
        for cache in caches:  # the steps before this one left keys and values everywhere
            cache.k_cache.copy_(torch.randn(cache.k_cache.shape, generator=gen))
            cache.v_cache.copy_(torch.randn(cache.v_cache.shape, generator=gen))
        before = [(c.k_cache.clone(), c.v_cache.clone()) for c in caches]
        results = []
        for native_stack in (True, False):
            for cache, (k, v) in zip(caches, before, strict=True):
                cache.k_cache.copy_(k)
                cache.v_cache.copy_(v)
            ctx = StepContext(meta, adapters(worker))
            with torch.inference_mode():
                assert stack.applies(len(ids), positions, ctx)
                assert next(model.parameters()).dtype == getattr(torch, dtype)
                hidden = stack.run(stack.embed(ids), positions, ctx) if native_stack else model(ids, positions, ctx)
            results.append((hidden, [(c.k_cache.clone(), c.v_cache.clone()) for c in caches]))
        (native_hidden, native_caches), (module_hidden, module_caches) = results
        flat = [t for pair in native_caches for t in pair], [t for pair in module_caches for t in pair]
        return torch.equal(native_hidden, module_hidden) and all(torch.equal(a, b) for a, b in zip(*flat, strict=True))

    llm = LLM(
        path,
        kv_cache_memory_bytes=1 << 22,
        enable_lora=lora,
        max_loras=2,
        max_lora_rank=8,
        dtype=dtype,
        kv_cache_dtype=kv,
    )
    try:
        if lora:
            llm.load_lora_adapter("a", str(make_tiny_lora(path, tmp_path / "a", rank=8, seed=1)))
            llm.load_lora_adapter(
                "b",
                str(
                    make_tiny_lora(
                        path, tmp_path / "b", rank=4, seed=2, target_modules=["q_proj", "v_proj", "down_proj"]
                    )
                ),
            )
        assert llm.collective_rpc(compare) == [True]
    finally:
        llm.shutdown()


def test_native_stack_is_skipped_where_the_modules_differ(ops, model_dirs, monkeypatch):
    """q/k norms (qwen3) are not in the native stack; a forward hook set through the worker on any layer module
    sees every step run, and once removed, decode steps take the native stack again."""
    _, _, native_steps = _run(str(model_dirs["qwen3"]), monkeypatch, native_stack=True)
    assert native_steps == 0

    seen, used = [], []
    real_run = NativeDecoderStack.run
    monkeypatch.setattr(NativeDecoderStack, "run", lambda self, *a: used.append(1) or real_run(self, *a))
    llm = LLM(str(model_dirs["llama"]), kv_cache_memory_bytes=1 << 22)
    try:
        llm.generate(PROMPTS, PARAMS, use_tqdm=False)  # the hook check runs (and is remembered) before the hook
        assert len(used) == PARAMS.max_tokens - 1
        [handle] = llm.apply_model(
            lambda model: model.model.layers[1].mlp.register_forward_hook(lambda *_: seen.append(1))
        )
        used.clear()
        llm.generate(PROMPTS, PARAMS, use_tqdm=False)
        assert len(seen) == PARAMS.max_tokens and used == []  # the prefill and every decode step ran the modules
        llm.apply_model(lambda model: handle.remove())
        llm.reset_prefix_cache()  # else the cached prompts make the prefill small enough for the native stack too
        llm.generate(PROMPTS, PARAMS, use_tqdm=False)
        assert len(seen) == PARAMS.max_tokens and len(used) == PARAMS.max_tokens - 1
    finally:
        llm.shutdown()


def test_native_stack_is_skipped_for_a_patched_module(ops, model_dirs):
    """A module whose forward user code replaced (through the worker) makes the layers run as modules."""
    calls = []
    llm = LLM(str(model_dirs["llama"]), kv_cache_memory_bytes=1 << 22)
    try:
        llm.generate(PROMPTS, PARAMS, use_tqdm=False)

        def patch(model):
            down = model.model.layers[0].mlp.down_proj
            real = down.forward
            down.forward = lambda x: calls.append(x.shape[0]) or real(x)

        llm.apply_model(patch)
        llm.reset_prefix_cache()
        llm.generate(PROMPTS, PARAMS, use_tqdm=False)
    finally:
        llm.shutdown()
    assert len(calls) == PARAMS.max_tokens  # the prefill and every decode step called the patched forward


def call_stack(ops, x, layers: list, loras: list, lora_rows: list, onednn: list) -> None:
    """`ops.decoder_layers` on four rows of `x` with one-layer settings, `layers`, the adapters' factors, their
    row segments and the oneDNN handles as given."""
    ops.decoder_layers(
        x,
        torch.zeros(4, dtype=torch.long),
        layers,
        [],
        [],
        torch.zeros(4, dtype=torch.long),
        torch.zeros(4, 1, dtype=torch.long),
        torch.ones(4, dtype=torch.long),
        None,
        None,
        1,
        1,
        8,
        1.0,
        1e-6,
        torch.ones(8),
        True,
        True,
        True,
        0,
        0,
        loras,
        lora_rows,
        onednn,
    )


def test_decoder_layers_rejects_bad_input(ops):
    x = torch.randn(4, 8)
    with pytest.raises(RuntimeError, match="entries per layer"):
        call_stack(ops, x, [None] * 5, [], [], [])
    with pytest.raises(RuntimeError, match="segment of lora_rows"):
        call_stack(ops, x, [], [None] * 3, [0, 4], [])
    with pytest.raises(RuntimeError, match="onednn must be empty or hold 4"):
        call_stack(ops, x, [], [], [], [True])


def test_the_stack_runs_each_product_as_the_policy_chose(ops, model_dirs, monkeypatch, tmp_path):
    """With the linear products on torch's BLAS (as on AVX2 builds) and the rest native, the stack still runs the
    step, with the modules' bits (with LoRA adapters too: their gate/up product then takes the unfused path)."""
    from hotswap.kernels import ops as facade
    from hotswap.kernels import policy
    from hotswap.kernels.policy import OPS, Decision, KernelPolicy

    decisions = {op: Decision.rule(op, op not in ("linear", "gated_linear"), "test") for op in OPS}
    mixed = KernelPolicy("native", decisions, None)
    monkeypatch.setattr(facade, "policy", lambda: mixed)
    monkeypatch.setattr(policy, "prepare", lambda hf_config, dtype=None: mixed)
    monkeypatch.setattr(policy, "calibrate_stack", lambda measure: mixed)
    test_native_stack_forward_is_the_module_forward_to_the_bit(
        ops, model_dirs, None, "qwen2", True, "float32", "auto", 8, tmp_path, monkeypatch
    )
    fast, _, native_steps = _run(str(model_dirs["llama"]), monkeypatch, native_stack=True)
    slow, _, _ = _run(str(model_dirs["llama"]), monkeypatch, native_stack=False)
    assert native_steps > 0
    assert [o.outputs[0].token_ids for o in fast[0]] == [o.outputs[0].token_ids for o in slow[0]]


def test_the_step_timing_runs_each_variant_of_the_products(ops, model_dirs):
    """`time_step` times one decode step through the stack per variant of the products and one through the
    modules; it declines a step that the cache has too few blocks for (a smaller one is another batch class)."""
    llm = LLM(str(model_dirs["llama"]), kv_cache_memory_bytes=1 << 22)

    def timing(worker):
        r = worker.runner
        variants = [(False, False, True), (True, True, True)]
        args = (r.block_size, r.attention_kernel, r.num_blocks, variants)
        return r.stack.time_step(4, *args), r.stack.time_step(r.num_blocks + 1, *args)

    ((timed, declined),) = llm.collective_rpc(timing)
    stack_s, modules_s = timed
    assert len(stack_s) == 2 and all(s > 0 for s in stack_s) and modules_s > 0
    assert declined is None
    llm.shutdown()
