"""Bad input gets a clear error, and the engine keeps generating correctly afterwards."""

from __future__ import annotations

import json
import shutil

import pytest

from conftest import PROMPTS, hf_greedy
from hotswap import LLM, EngineConfig, SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(llama_dir):
    return LLM(str(llama_dir), kv_cache_memory_bytes=1 << 24, max_model_len=256)


def still_correct(llm: LLM, path) -> None:
    out = llm.generate(PROMPTS[:3], GREEDY, use_tqdm=False)
    tok = llm.get_tokenizer()
    for prompt, o in zip(PROMPTS[:3], out, strict=True):
        assert o.outputs[0].token_ids == hf_greedy(str(path), tuple(tok.encode(prompt)), 16)[0]
    assert not llm.llm_engine.has_unfinished_requests()


@pytest.mark.parametrize(
    "prompts,params,message",
    [
        ([""], GREEDY, "empty"),
        ([{"prompt_token_ids": []}], GREEDY, "empty"),
        ([{"prompt_token_ids": [1] * 300}], GREEDY, "max_model_len"),
        ([{"prompt_token_ids": [1, 10**6]}], GREEDY, "out of range"),
        ([{"prompt_token_ids": ["a"]}], GREEDY, "integers"),
        ([{"text": "x"}], GREEDY, "prompt_token_ids"),
        (["ok", "ok"], [GREEDY], "sampling_params"),
        (["ok", ""], GREEDY, "empty"),  # a bad prompt after a good one: nothing is queued
        (["ok"], SamplingParams(stop_token_ids=[10**6]), "stop_token_ids"),
    ],
)
def test_bad_request_raises_and_engine_keeps_serving(llm, llama_dir, prompts, params, message):
    with pytest.raises(ValueError, match=message):
        llm.generate(prompts, params, use_tqdm=False)
    assert not llm.llm_engine.has_unfinished_requests()
    still_correct(llm, llama_dir)


def test_chat_uses_the_template(llm):
    messages = [{"role": "user", "content": "hello"}]
    out = llm.chat(messages, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)[0]
    expected = llm.get_tokenizer().apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True, return_dict=False
    )
    assert out.prompt_token_ids == list(expected)
    assert llm.get_tokenizer().decode(out.prompt_token_ids).startswith("<|im_start|>user\nhello<|im_end|>")
    two = llm.chat([messages, messages], GREEDY, use_tqdm=False)
    assert two[0].outputs[0].token_ids == two[1].outputs[0].token_ids


@pytest.mark.parametrize(
    "kwargs,message",
    [
        ({"block_size": 0}, "block_size"),
        ({"max_model_len": 10**6}, "max_model_len"),
        ({"dtype": "float8"}, "dtype"),
        ({"max_num_seqs": 0}, "max_num_seqs"),
        ({"memory_fraction": 0.0}, "memory_fraction"),
        ({"kv_cache_memory_bytes": 1024}, "KV cache holds"),
        (
            {"max_num_batched_tokens": 16, "max_model_len": 64, "enable_chunked_prefill": False},
            "max_num_batched_tokens=16 is smaller than max_model_len=64 with enable_chunked_prefill=False",
        ),
        ({"max_num_batched_tokens": 16}, "max_num_batched_tokens=16 cannot hold one step of max_num_seqs=256"),
        ({"long_prefill_token_threshold": -1}, "long_prefill_token_threshold"),
        ({"max_num_partial_prefills": 0}, "max_num_partial_prefills"),
        ({"enable_chunked_prefill": "yes"}, "enable_chunked_prefill"),
        ({"load_format": "pickle"}, "load_format"),
    ],
)
def test_invalid_engine_config_names_the_field(llama_dir, kwargs, message):
    with pytest.raises(ValueError, match=message):
        LLM(str(llama_dir), **kwargs)


def test_unknown_engine_argument(llama_dir):
    with pytest.raises(TypeError, match="gpu_magic"):
        LLM(str(llama_dir), gpu_magic=True)


def test_missing_folder_and_unsupported_architecture(tmp_path, llama_dir):
    with pytest.raises(ValueError, match="does not exist"):
        EngineConfig.from_kwargs(str(tmp_path / "nope"))
    bad = tmp_path / "gpt"
    shutil.copytree(llama_dir, bad)
    cfg = json.loads((bad / "config.json").read_text())
    cfg["architectures"] = ["GPTNeoXForCausalLM"]
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="supported architectures: LlamaForCausalLM"):
        EngineConfig.from_kwargs(str(bad))


def test_checkpoint_with_unknown_or_missing_tensors_is_named(tmp_path, llama_dir):
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(llama_dir / "model.safetensors"))
    for case, mutate, message in [
        (
            "extra",
            lambda t: t.update({"model.layers.0.mlp.surprise.weight": t["model.norm.weight"].clone()}),
            "surprise",
        ),
        (
            "missing",
            lambda t: t.pop("model.layers.1.self_attn.k_proj.weight"),
            "missing tensors.*layers.1.self_attn.k_proj",
        ),
        (
            "shape",
            lambda t: t.update({"model.norm.weight": t["model.norm.weight"][:3].clone()}),
            "model.norm.weight.*expected shape",
        ),
    ]:
        folder = tmp_path / case
        shutil.copytree(llama_dir, folder)
        copy = dict(tensors)
        mutate(copy)
        save_file(copy, str(folder / "model.safetensors"))
        with pytest.raises(ValueError, match=message):
            LLM(str(folder))


def test_checkpoint_paths_are_literal_and_special_files_refused(tmp_path, llama_dir):
    """A folder name with pattern characters loads as itself; a FIFO named *.safetensors is refused up front
    instead of blocking the engine, which keeps serving."""
    import os
    import shutil

    weird = tmp_path / "weird[1]*"
    shutil.copytree(llama_dir, weird)
    llm = LLM(str(weird), kv_cache_memory_bytes=1 << 22)
    params = SamplingParams(temperature=0, max_tokens=4)
    before = llm.generate(["hello"], params, use_tqdm=False)[0].outputs[0].token_ids
    fifo = tmp_path / "fifo"
    shutil.copytree(llama_dir, fifo)
    os.mkfifo(fifo / "extra.safetensors")
    with pytest.raises(ValueError, match="not regular files"):
        llm.reload_weights(weights_path=str(fifo))
    with pytest.raises(ValueError, match="not regular files"):
        LLM(str(fifo), kv_cache_memory_bytes=1 << 22)
    assert llm.generate(["hello"], params, use_tqdm=False)[0].outputs[0].token_ids == before
