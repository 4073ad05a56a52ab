"""Small random-weight Hugging Face checkpoints for tests, benchmarks and demos.

Everything is generated locally and deterministically: a byte-level BPE
tokenizer trained on a built-in synthetic English-like corpus, and a
randomly initialised decoder-only model of one of :data:`SUPPORTED_ARCHS`,
saved in the standard Hugging Face layout (``config.json``,
``model.safetensors``, ``generation_config.json`` and tokenizer files).

The weights are initialised so that the models are useful as references for
exact greedy-decoding comparisons: logits are peaked (top-1/top-2 near-ties
are rare), special tokens and padded vocabulary rows are rarely the argmax,
norm weights and biases are non-trivial, and the output depends on context.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import pathlib
import random
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from typing import Any

import torch

SUPPORTED_ARCHS: tuple[str, ...] = ("llama", "qwen2", "qwen3", "mistral", "qwen3_moe", "qwen2_moe", "mixtral")

#: Mixture-of-experts defaults per arch (8 experts, top-2, every layer sparse), before the preset's overrides.
_MOE_DEFAULTS: dict[str, dict[str, Any]] = {
    "qwen3_moe": {
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 48,
        "norm_topk_prob": True,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
    },
    "qwen2_moe": {
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 48,
        "shared_expert_intermediate_size": 96,
        "norm_topk_prob": False,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
    },
    "mixtral": {"num_local_experts": 8, "num_experts_per_tok": 2},
}

EOS_TOKEN = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS: tuple[str, ...] = (EOS_TOKEN, IM_START, IM_END)  # ids 0, 1, 2
EOS_TOKEN_ID = 0

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

#: Named size presets: config overrides applied before the caller's overrides.
PRESETS: dict[str, dict[str, Any]] = {
    "tiny": {
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 1024,
        "vocab_size": 512,
        "initializer_range": 0.1,
    },
    "9m": {
        "hidden_size": 256,
        "intermediate_size": 1216,
        "num_hidden_layers": 6,
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
        "max_position_embeddings": 2048,
        "vocab_size": 4096,
        "initializer_range": 0.06,
    },
    "125m": {  # SmolLM2-135M shape with a smaller vocabulary
        "hidden_size": 576,
        "intermediate_size": 1536,
        "num_hidden_layers": 30,
        "num_attention_heads": 9,
        "num_key_value_heads": 3,
        "max_position_embeddings": 2048,
        "vocab_size": 16384,
        "tie_word_embeddings": True,
        "initializer_range": 0.04,
    },
}

_MAX_TOKENIZER_VOCAB = 4096
_LOGIT_STD = 8.0  # target standard deviation of the output logits
_SPECIAL_ROW_SCALE = 0.1  # shrinks lm_head rows of special / padded-vocab tokens
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

_WORDS_TEXT = """
the of and to a in is it you that he was for on are with as his they be at one have
this from or had by word but what some we can out other were all there when up use
your how said an each she which do their time if will way about many then them write
would like so these her long make thing see him two has look more day could go come
did number sound no most people my over know water than call first who may down side
been now find any new work part take get place made live where after back little only
round man year came show every good me give our under name very through just form
sentence great think say help low line differ turn cause much mean before move right
boy old too same tell does set three want air well also play small end put home read
hand port large spell add even land here must big high such follow act why ask men
change went light kind off need house picture try us again animal point mother world
near build self earth father head stand own page should country found answer school
grow study still learn plant cover food sun four between state keep eye never last let
thought city tree cross farm hard start might story saw far sea draw left late run
while press close night real life few north open seem together next white children
begin got walk example ease paper group always music those both mark often letter
until mile river car feet care second book carry took science eat room friend began
idea fish mountain stop once base hear horse cut sure watch color face wood main enough
plain girl usual young ready above ever red list though feel talk bird soon body dog
family direct pose leave song measure door product black short numeral class wind
question happen complete ship area half rock order fire south problem piece told knew
pass since top whole king space heard best hour better true during hundred five
remember step early hold west ground interest reach fast verb sing listen six table
travel less morning ten simple several vowel toward war lay against pattern slow
center love person money serve appear road map rain rule govern pull cold notice voice
unit power town fine certain fly fall lead cry dark machine note wait plan figure star
box noun field rest correct able pound done beauty drive stood contain front teach
week final gave green quick develop ocean warm free minute strong special mind behind
clear tail produce fact street inch multiply nothing course stay wheel full force blue
object decide surface deep moon island foot system busy test record boat common gold
"""
_SYLLABLES_TEXT = "ka ri to men sa lo vi dar en tu pe ol quin bra ste nor gal fi ze mu tho wen rik las cor hal bel"
_WORDS, _SYLLABLES = _WORDS_TEXT.split(), _SYLLABLES_TEXT.split()
_tokenizer_cache: dict[int, str] = {}


def _corpus(n_sentences: int = 4000, seed: int = 1234) -> list[str]:
    """Return a deterministic English-like corpus (words, pseudo-words, numbers, punctuation)."""
    rng = random.Random(seed)
    pseudo = ["".join(rng.choice(_SYLLABLES) for _ in range(rng.randint(2, 4))) for _ in range(600)]
    lines = []
    for _ in range(n_sentences):
        words = []
        for _ in range(rng.randint(4, 16)):
            r = rng.random()
            if r < 0.8:
                w = rng.choice(_WORDS)
            elif r < 0.92:
                w = rng.choice(pseudo)
            elif r < 0.97:
                w = str(rng.randint(0, 10 ** rng.randint(1, 4)))
            else:
                w = f"{rng.randint(0, 99)}.{rng.randint(0, 99):02d}"
            if rng.random() < 0.06:
                w += rng.choice([",", ",", ";", ":"])
            words.append(w)
        words[0] = words[0].capitalize()
        if rng.random() < 0.05:
            words[-1] = f'"{words[-1]}"' if rng.random() < 0.5 else f"({words[-1]})"
        lines.append(" ".join(words) + rng.choice([".", ".", ".", "?", "!"]))
    return lines


def _train_tokenizer(vocab_size: int) -> str:
    """Train (or fetch from the in-process cache) a byte-level BPE; returns its JSON."""
    if vocab_size not in _tokenizer_cache:
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=vocab_size,
            special_tokens=list(SPECIAL_TOKENS),
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        )
        tok.train_from_iterator(_corpus(), trainer=trainer)
        _tokenizer_cache[vocab_size] = tok.to_str()
    return _tokenizer_cache[vocab_size]


def _tokenizer_size(vocab_size: int) -> int:
    """Actual number of tokens of the tokenizer trained for ``vocab_size``."""
    from tokenizers import Tokenizer

    return Tokenizer.from_str(_train_tokenizer(vocab_size)).get_vocab_size(with_added_tokens=True)


def make_tokenizer(path: str | pathlib.Path, vocab_size: int = 512) -> None:
    """Train a deterministic byte-level BPE tokenizer and save it into folder ``path``.

    The tokenizer has at most ``vocab_size`` tokens (fewer if the corpus runs out
    of merges). Special tokens: ``<|endoftext|>`` (id 0; eos, bos and pad),
    ``<|im_start|>`` (id 1) and ``<|im_end|>`` (id 2). No token is added
    automatically when encoding. A ChatML chat template is included, and
    ``transformers.AutoTokenizer.from_pretrained(path)`` loads it offline.
    """
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    min_size = 256 + len(SPECIAL_TOKENS) + 1
    if vocab_size < min_size:
        raise ValueError(f"vocab_size must be at least {min_size}, got {vocab_size}")
    tok = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer.from_str(_train_tokenizer(vocab_size)),
        bos_token=EOS_TOKEN,
        eos_token=EOS_TOKEN,
        pad_token=EOS_TOKEN,
        additional_special_tokens=[IM_START, IM_END],
        add_bos_token=False,
        add_eos_token=False,
        clean_up_tokenization_spaces=False,
        model_max_length=1 << 30,
        chat_template=CHAT_TEMPLATE,
    )
    tok.save_pretrained(str(path), save_jinja_files=False)  # template in tokenizer_config.json
    (pathlib.Path(path) / "special_tokens_map.json").write_text(json.dumps(tok.special_tokens_map, indent=2) + "\n")


def _config_and_class(arch: str, preset: str, dtype: str, overrides: dict[str, Any]) -> tuple[Any, Any]:
    """Resolve the transformers config and model class for ``arch`` and ``preset``."""
    import transformers

    if arch not in SUPPORTED_ARCHS:
        raise ValueError(f"unknown arch {arch!r}; supported archs: {', '.join(SUPPORTED_ARCHS)}")
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; available presets: {', '.join(PRESETS)}")
    if dtype not in _DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; supported dtypes: {', '.join(_DTYPES)}")
    kw: dict[str, Any] = {"tie_word_embeddings": False, **_MOE_DEFAULTS.get(arch, {}), **PRESETS[preset]}
    if arch == "qwen3" and preset == "tiny":
        kw["head_dim"] = 32  # deliberately != hidden_size / num_attention_heads
    if arch in ("mistral", "mixtral"):
        kw["sliding_window"] = None
    if arch in ("qwen2", "qwen3", "qwen2_moe", "qwen3_moe"):
        kw["use_sliding_window"] = False
    kw.update(overrides)
    kw.setdefault("head_dim", kw["hidden_size"] // kw["num_attention_heads"])
    kw.update(bos_token_id=EOS_TOKEN_ID, eos_token_id=EOS_TOKEN_ID, pad_token_id=EOS_TOKEN_ID, dtype=dtype)
    prefix = {
        "llama": "Llama",
        "qwen2": "Qwen2",
        "qwen3": "Qwen3",
        "mistral": "Mistral",
        "qwen3_moe": "Qwen3Moe",
        "qwen2_moe": "Qwen2Moe",
        "mixtral": "Mixtral",
    }[arch]
    config = getattr(transformers, f"{prefix}Config")(**kw)
    return config, getattr(transformers, f"{prefix}ForCausalLM")


@torch.no_grad()
def _shape_weights(model: Any, n_tokens: int) -> None:
    """Adjust a freshly initialised model in place for exact greedy comparisons.

    Norm weights become U(0.8, 1.2) and biases N(0, initializer_range), so that
    neither is a no-op; the final norm is scaled so the logits have a standard
    deviation of about ``_LOGIT_STD`` (rare top-1/top-2 near-ties); the input
    rows of special tokens are redrawn (the pad row would otherwise be zero);
    and the output rows of special tokens and of ids ``>= n_tokens`` are shrunk
    so they are rarely the argmax.
    """
    cfg = model.config
    std = cfg.initializer_range
    for name, p in model.named_parameters():
        if name.endswith("norm.weight"):
            p.uniform_(0.8, 1.2)  # non-trivial norm weights
        elif name.endswith(".bias"):
            p.normal_(0.0, std)
    # RMS-normed final hidden states have unit scale, so logits ~ N(0, (k * sqrt(H) * std)^2).
    model.model.norm.weight.mul_(_LOGIT_STD / (math.sqrt(cfg.hidden_size) * std))
    special = torch.arange(len(SPECIAL_TOKENS))
    model.get_input_embeddings().weight[special] = torch.randn(len(special), cfg.hidden_size) * std
    out = model.get_output_embeddings().weight
    out[special] *= _SPECIAL_ROW_SCALE
    out[n_tokens:] *= _SPECIAL_ROW_SCALE  # padded vocabulary rows


def make_tiny_model(
    path: str | pathlib.Path,
    arch: str = "llama",
    *,
    preset: str = "tiny",
    seed: int = 0,
    dtype: str = "float32",
    **config_overrides: Any,
) -> pathlib.Path:
    """Write a random-weight checkpoint of ``arch`` into folder ``path`` and return it.

    ``arch`` is one of :data:`SUPPORTED_ARCHS`; ``preset`` names an entry of
    :data:`PRESETS`; ``config_overrides`` are transformers config fields that win
    over the preset (e.g. ``tie_word_embeddings=True``, ``num_hidden_layers=3``).
    Weights are saved in ``dtype`` ("float32", "bfloat16" or "float16") as
    ``model.safetensors``, next to ``config.json``, ``generation_config.json`` and
    the tokenizer files (trained with ``min(vocab_size, 4096)`` tokens; the
    model's vocab may be larger, like a padded vocabulary). The same arguments
    always give bit-identical files. Raises ``ValueError`` for an unknown arch,
    preset or dtype.
    """
    from transformers import GenerationConfig
    from transformers.utils import logging as hf_logging

    config, model_cls = _config_and_class(arch, preset, dtype, config_overrides)
    path = pathlib.Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tok_vocab = min(config.vocab_size, _MAX_TOKENIZER_VOCAB)
    make_tokenizer(path, tok_vocab)

    with torch.random.fork_rng(devices=[]):  # leave the caller's RNG state untouched
        torch.manual_seed(seed)
        model = model_cls(config).eval()
        _shape_weights(model, _tokenizer_size(tok_vocab))
    model.generation_config = GenerationConfig(
        bos_token_id=EOS_TOKEN_ID, eos_token_id=EOS_TOKEN_ID, pad_token_id=EOS_TOKEN_ID
    )
    progress_bar = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        model.to(_DTYPES[dtype]).save_pretrained(str(path), max_shard_size="1000GB")
    finally:
        if progress_bar:
            hf_logging.enable_progress_bar()
    if not (path / "generation_config.json").exists():
        model.generation_config.save_pretrained(str(path))
    config_file = path / "config.json"  # also record the legacy dtype key for older readers
    config_json = json.loads(config_file.read_text())
    config_json["torch_dtype"] = dtype
    config_file.write_text(json.dumps(config_json, indent=2, sort_keys=True) + "\n")
    return path


def free_port() -> int:
    """A TCP port free on loopback now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def running_server(
    model_dir: str | pathlib.Path, *args: str, log: pathlib.Path | None = None, start_timeout_s: float = 180.0
) -> Iterator[tuple[str, subprocess.Popen[str]]]:
    """Runs `python -m hotswap serve model_dir --port 0 *args` on loopback; yields (its base URL, the process) once
    `/health` answers 200; stops it afterwards (SIGTERM, then SIGKILL after 30 s). The server binds its port before
    it loads the model and prints it; the URL is read from that line, so no other process can take the port in
    between. The server's output goes to `log` (a temporary file without it), shown if it exits before it is
    healthy."""
    import httpx

    with contextlib.ExitStack() as stack:
        if log is None:
            log = pathlib.Path(stack.enter_context(tempfile.TemporaryDirectory())) / "server.log"
        out = stack.enter_context(open(log, "w"))
        proc = subprocess.Popen(
            [sys.executable, "-m", "hotswap", "serve", str(model_dir), "--port", "0", *args],
            stdout=out,
            stderr=subprocess.STDOUT,
            text=True,
            env={**os.environ, "TOKENIZERS_PARALLELISM": "false"},
        )
        try:
            deadline = time.monotonic() + start_timeout_s
            base: str | None = None
            while True:
                if proc.poll() is not None:
                    raise RuntimeError(f"server exited early:\n{log.read_text()[-3000:]}")
                if base is None:
                    found = re.search(r"serving .* on (http://\S+:\d+) ", log.read_text())
                    base = found.group(1) if found else None
                if base is not None:
                    with contextlib.suppress(httpx.HTTPError):
                        if httpx.get(f"{base}/health", timeout=1).status_code == 200:
                            break
                if time.monotonic() > deadline:
                    raise TimeoutError(f"server did not become healthy:\n{log.read_text()[-3000:]}")
                time.sleep(0.2)
            yield base, proc
        finally:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def make_tiny_lora(
    base: str | pathlib.Path,
    path: str | pathlib.Path,
    *,
    rank: int = 8,
    alpha: int = 16,
    target_modules: list[str] | str | None = None,
    target_parameters: list[str] | None = None,
    use_rslora: bool = False,
    seed: int = 0,
    std: float = 0.05,
) -> pathlib.Path:
    """Write a random LoRA adapter for the checkpoint at ``base`` into folder ``path`` with PEFT's own
    ``save_pretrained`` (``adapter_config.json`` and ``adapter_model.safetensors``) and return it. Both factors are
    drawn from N(0, std) (PEFT's default init leaves lora_B zero, an adapter that changes nothing). Default
    targets: every attention and MLP projection (PEFT adds a transformers 5 Qwen3-MoE's fused experts itself);
    ``target_parameters`` names expert parameters to adapt too (e.g. "mlp.experts.gate_up_proj"). Needs the
    ``peft`` package (a test dependency)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    targets = target_modules or ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    model = AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32)
    config = LoraConfig(
        r=rank,
        lora_alpha=alpha,
        target_modules=targets,
        target_parameters=target_parameters,
        use_rslora=use_rslora,
        lora_dropout=0.0,
        task_type="CAUSAL_LM",
    )
    peft_model = get_peft_model(model, config)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * std)
    path = pathlib.Path(path)
    peft_model.save_pretrained(str(path))
    return path
