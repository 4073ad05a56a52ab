"""The engine's tokenizer: exactly what a trainer gets from `AutoTokenizer.from_pretrained(path)`.

RL trainers (TRL, verl, OpenRLHF) and vLLM tokenize with `AutoTokenizer`; a prompt the engine encodes differently
would be scored on tokens it never sampled. So the engine does not pick a class itself: a checkpoint whose
tokenizer_config.json names the generic `TokenizersBackend` (what saving a `PreTrainedTokenizerFast` writes) gets,
from transformers 5, the model type's own class (a qwen2 checkpoint: `Qwen2Tokenizer`, whose pre-tokenizer splits
newlines and spaces apart), and only `AutoTokenizer`, which reads the model config, knows that. Reading the config
costs ~0.25 s of a fresh process's start-up (docs/log.md)."""

from __future__ import annotations

from typing import Any


def load_tokenizer(path: str) -> Any:
    """`transformers.AutoTokenizer.from_pretrained(path)`: the same class, vocabulary, special tokens and chat
    template as the trainer's. The engine, the server's /tokenize and /detokenize routes and a fleet's router all
    load theirs here. Raises what transformers raises for a folder without a tokenizer."""
    from transformers import AutoTokenizer  # imported here: `import hotswap` stays without transformers

    return AutoTokenizer.from_pretrained(path)
