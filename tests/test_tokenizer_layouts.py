"""The engine tokenizes as the trainer does: for every checkpoint layout, `LLM(path).get_tokenizer()` is the class
`AutoTokenizer.from_pretrained(path)` returns and encodes, decodes and applies the chat template exactly as it does,
on a corpus with whitespace runs, newlines, tabs, unicode, special and added tokens.

The layouts: the generic `TokenizersBackend` class (what saving a `PreTrainedTokenizerFast` writes) in a llama, qwen2,
qwen3, mistral and MoE checkpoint (transformers 5 gives a qwen2 checkpoint `Qwen2Tokenizer`, whose pre-tokenizer
splits a newline from the spaces after it: the engine once loaded `TokenizersBackend` and encoded
`'def add(a, b):\\n    return'` differently), a model-specific class, a slow-only (pure Python) class, added and
special tokens, and no tokenizer_config.json. The tokenizer is trained on code, so whitespace merges exist."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from conftest import hf_greedy
from hotswap import LLM, SamplingParams
from hotswap.testing import CHAT_TEMPLATE, make_tiny_model
from server_helpers import post, running_server

CORPUS = [
    "def add(a, b):\n    return a + b\n",
    "class Stack:\n    def push(self, x):\n        self.items.append(x)\n\n\n    def pop(self):\n\treturn 1",
    "  leading and trailing   spaces  ",
    "tabs\t\tand\r\nwindows\r\nlines",
    "héllo wörld — naïve café, 日本語のテキスト, emoji 🙂🚀 and ÅØ",
    "I'm sure they'll go; we've said it's done. DON'T SHOUT",
    "<|im_start|>user\nhi there<|im_end|>\n<|im_start|>assistant\n",
    "numbers 12345 3.14159 -7 1e-9",
    "",
    " ",
    "\n\n\n",
]
MESSAGES = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "def f():\n    pass\n  ok?"}]
ARCHS = ("llama", "qwen2", "qwen3", "mistral", "qwen3_moe")


def code_tokenizer():
    """A byte-level BPE (at most 480 tokens: fits the tiny models' 512) trained on code and text, saved the way
    `PreTrainedTokenizerFast.save_pretrained` saves it (tokenizer_class "TokenizersBackend")."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=480,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS[:6] * 40, trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|endoftext|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=["<|im_start|>", "<|im_end|>"],
        clean_up_tokenization_spaces=False,
        chat_template=CHAT_TEMPLATE,
    )


def write_layout(model: Path, folder: Path, layout: str) -> Path:
    """A copy of checkpoint `model` (its weights and config) with the tokenizer files of `layout`."""
    shutil.copytree(
        model, folder, ignore=shutil.ignore_patterns("tokenizer*", "special_tokens_map.json", "vocab.*", "merges.txt")
    )
    tok = code_tokenizer()
    if layout == "added":
        tok.add_tokens(["<tool_call>", "    return", "🙂🚀"])
        tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>", "<|box|>"]})
    tok.save_pretrained(str(folder))
    config_file = folder / "tokenizer_config.json"
    config = json.loads(config_file.read_text())
    if layout == "model_class":
        config["tokenizer_class"] = "Qwen2Tokenizer"  # what Qwen's own checkpoints name
    elif layout == "no_config":
        config_file.unlink()
        return folder
    elif layout == "slow_only":  # a pure-Python WordPiece class: vocab.txt, no tokenizer.json
        for name in ("tokenizer.json", "special_tokens_map.json"):
            (folder / name).unlink(missing_ok=True)
        words = sorted({w for text in CORPUS for w in text.lower().split()} | set("abcdefghijklmnopqrstuvwxyz"))
        (folder / "vocab.txt").write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *words]) + "\n")
        config = {"tokenizer_class": "BertTokenizerLegacy", "do_lower_case": True, "chat_template": CHAT_TEMPLATE}
    config_file.write_text(json.dumps(config))
    return folder


LAYOUTS = [(f"generic_{arch}", arch, "generic") for arch in ARCHS] + [
    ("model_class_qwen2", "qwen2", "model_class"),
    ("slow_only_llama", "llama", "slow_only"),
    ("added_tokens_qwen2", "qwen2", "added"),
    ("no_tokenizer_config_qwen2", "qwen2", "no_config"),
]


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tokenizer_models")
    return {arch: make_tiny_model(root / arch, arch=arch) for arch in ARCHS}


def same_as_autotokenizer(ours, auto) -> None:
    """Asserts that two tokenizers encode, decode and template the corpus identically."""
    assert type(ours) is type(auto)
    for text in CORPUS:
        for special in (True, False):
            ids = auto.encode(text, add_special_tokens=special)
            assert ours.encode(text, add_special_tokens=special) == ids, (text, special)
            for skip in (True, False):
                assert ours.decode(ids, skip_special_tokens=skip) == auto.decode(ids, skip_special_tokens=skip)
    assert ours.convert_ids_to_tokens(list(range(len(auto)))) == auto.convert_ids_to_tokens(list(range(len(auto))))
    assert ours.all_special_ids == auto.all_special_ids and ours.eos_token_id == auto.eos_token_id
    if auto.chat_template is not None:
        for tokenize in (False, True):
            kw = {"add_generation_prompt": True, "tokenize": tokenize}
            if tokenize:
                kw["return_dict"] = False
            assert ours.apply_chat_template(MESSAGES, **kw) == auto.apply_chat_template(MESSAGES, **kw)


@pytest.mark.parametrize(("name", "arch", "layout"), LAYOUTS, ids=[n for n, _, _ in LAYOUTS])
def test_the_engine_tokenizes_as_autotokenizer(models, tmp_path, name, arch, layout):
    folder = write_layout(models[arch], tmp_path / name, layout)
    auto = AutoTokenizer.from_pretrained(str(folder))
    llm = LLM(str(folder), kv_cache_memory_bytes=1 << 21)
    same_as_autotokenizer(llm.get_tokenizer(), auto)


def test_the_generic_qwen2_layout_is_one_where_the_classes_differ(models, tmp_path):
    """The layout above is not vacuous: the tokenizer the engine once loaded (the class tokenizer_config.json names)
    encodes code differently from AutoTokenizer's."""
    from transformers import TokenizersBackend

    folder = write_layout(models["qwen2"], tmp_path / "q", "generic")
    named, auto = TokenizersBackend.from_pretrained(str(folder)), AutoTokenizer.from_pretrained(str(folder))
    assert type(auto).__name__ == "Qwen2Tokenizer"
    assert named.encode(CORPUS[0]) != auto.encode(CORPUS[0])


def test_greedy_tokens_and_the_tokenize_route_match_the_trainer(models, tmp_path):
    """On the generic qwen2 layout: prompts given as text are encoded as the trainer encodes them, so the engine's
    greedy continuations are transformers' on AutoTokenizer's ids; the server's /tokenize and /detokenize agree."""
    folder = write_layout(models["qwen2"], tmp_path / "q", "generic")
    auto = AutoTokenizer.from_pretrained(str(folder))
    prompts = [text for text in CORPUS if text.strip()]
    llm = LLM(str(folder), kv_cache_memory_bytes=1 << 22)
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    for prompt, out in zip(prompts, outs, strict=True):
        ids = auto.encode(prompt)
        assert out.prompt_token_ids == ids
        assert out.outputs[0].token_ids == hf_greedy(str(folder), tuple(ids), 8)[0], prompt
    with running_server(str(folder)) as base:
        for text in CORPUS[:6]:
            got = post(base, "/tokenize", prompt=text).json()["tokens"]
            assert got == auto.encode(text)
            assert post(base, "/detokenize", tokens=got).json()["prompt"] == auto.decode(got)
        chat = post(base, "/tokenize", messages=MESSAGES).json()["tokens"]
        assert chat == auto.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=True, return_dict=False)
