"""Prompts and their sampling params, normalized once: what `LLM` and the fleet both take.

A prompt is a string, or a dict with "prompt_token_ids" (and optionally "prompt", the text, "cache_salt" and
"session_id"), or a dict with "prompt" alone. `stage` turns one into `Staged`: its text, token ids, cache salt and
session, each checked.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from hotswap.lora.request import LoRARequest
from hotswap.sampling_params import SamplingParams

PromptType = str | dict[str, Any]


class Tokenizer(Protocol):
    """What hotswap calls on a Hugging Face tokenizer (`AutoTokenizer.from_pretrained`'s result)."""

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...

    def decode(self, token_ids: list[int], skip_special_tokens: bool = False) -> str: ...

    def apply_chat_template(self, conversation: object, **kwargs: Any) -> Any: ...


@dataclass(frozen=True)
class Staged:
    """A prompt as the engine takes it: its text (None when given as ids), token ids and cache salt."""

    text: str | None
    token_ids: list[int]
    cache_salt: str | None = None
    session_id: str | None = None  # the conversation it is a turn of (hotswap/engine/sessions.py)

    def as_dict(self) -> dict[str, Any]:
        """{"prompt", "prompt_token_ids", "cache_salt"?, "session_id"?}: the prompt as a replica takes it."""
        out: dict[str, Any] = {"prompt": self.text, "prompt_token_ids": self.token_ids}
        if self.cache_salt is not None:
            out["cache_salt"] = self.cache_salt
        if self.session_id is not None:
            out["session_id"] = self.session_id
        return out


def stage(prompt: PromptType, tokenizer: Tokenizer) -> Staged:
    """Tokenizes a string prompt (special tokens added) and checks the rest. Raises ValueError naming the field."""
    if isinstance(prompt, str):
        return Staged(prompt, list(tokenizer.encode(prompt, add_special_tokens=True)))
    if not isinstance(prompt, dict):
        raise ValueError(f"a prompt must be a string or a dict with 'prompt_token_ids', got {type(prompt).__name__}")
    salt, session = prompt.get("cache_salt"), prompt.get("session_id")
    for name, value in (("cache_salt", salt), ("session_id", session)):
        if value is not None and (not isinstance(value, str) or not value):
            raise ValueError(f"{name} must be a non-empty string, got {value!r}")
    if "prompt_token_ids" in prompt:
        ids = prompt["prompt_token_ids"]
        if not isinstance(ids, (list, tuple)) or any(not isinstance(t, int) or isinstance(t, bool) for t in ids):
            raise ValueError("prompt_token_ids must be a list of integers")
        text = prompt.get("prompt")
        return Staged(text if isinstance(text, str) else None, list(ids), salt, session)
    if isinstance(prompt.get("prompt"), str):
        ids = list(tokenizer.encode(prompt["prompt"], add_special_tokens=True))
        return Staged(prompt["prompt"], ids, salt, session)
    raise ValueError("a prompt must be a string or a dict with 'prompt_token_ids' (or a 'prompt' string)")


def per_prompt(
    prompts: PromptType | Sequence[PromptType], sampling_params: SamplingParams | Sequence[SamplingParams] | None
) -> tuple[list[PromptType], list[SamplingParams]]:
    """The prompts as a list, with their sampling params: one for all (default SamplingParams()) or one per prompt.
    Raises ValueError when the counts differ."""
    prompts = [prompts] if isinstance(prompts, (str, dict)) else list(prompts)
    if sampling_params is None or isinstance(sampling_params, SamplingParams):
        return prompts, [sampling_params or SamplingParams()] * len(prompts)
    params_list = list(sampling_params)
    if len(params_list) != len(prompts):
        raise ValueError(
            f"got {len(params_list)} sampling_params for {len(prompts)} prompts; give one or one per prompt"
        )
    return prompts, params_list


def per_prompt_lora(
    lora_request: LoRARequest | Sequence[LoRARequest | None] | None, count: int
) -> list[LoRARequest | None]:
    """One LoRARequest (or None) per prompt. Raises ValueError when a list's length differs from the prompts'."""
    if lora_request is None or isinstance(lora_request, LoRARequest):
        return [lora_request] * count
    loras = list(lora_request)
    if len(loras) != count:
        raise ValueError(f"got {len(loras)} lora_requests for {count} prompts; give one or one per prompt")
    return loras


def chat_prompts(
    tokenizer: Tokenizer,
    messages: list[dict[str, Any]] | list[list[dict[str, Any]]],
    add_generation_prompt: bool = True,
    chat_template: str | None = None,
) -> list[PromptType]:
    """One conversation or a list of them, through the tokenizer's chat template, as token-id prompts."""
    conversations = [messages] if messages and isinstance(messages[0], dict) else messages
    return [
        {
            "prompt_token_ids": list(
                tokenizer.apply_chat_template(
                    c,
                    add_generation_prompt=add_generation_prompt,
                    chat_template=chat_template,
                    tokenize=True,
                    return_dict=False,
                )
            )
        }
        for c in conversations
    ]
