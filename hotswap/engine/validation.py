"""What the engine refuses before it queues a request: an empty or too long prompt, token ids outside the
vocabulary, logprobs beyond `max_logprobs`, filters or `n` beyond the model's or the scheduler's limits, routes asked
of a dense model or forced in the wrong shape, and invalid grammars. Each refusal is a ValueError that names the
field and the limit."""

from __future__ import annotations

import numpy as np

from hotswap.config import EngineConfig
from hotswap.engine.batch import num_logprobs
from hotswap.engine.grammar import Grammars
from hotswap.sampling_params import SamplingParams


def validate_prompt(
    config: EngineConfig,
    routing_shape: tuple[int, int, int] | None,
    grammars: Grammars,
    prompt_token_ids: list[int],
    params: SamplingParams,
) -> None:
    """Raises ValueError for a prompt the engine of `config` cannot serve (`routing_shape`: the model's (sparse
    layers, top_k, experts), None for a dense one; `grammars`: its compiled-grammar cache)."""
    if not prompt_token_ids:
        raise ValueError("the prompt is empty; give at least one token")
    max_len = config.model_config.max_model_len
    assert max_len is not None
    if len(prompt_token_ids) >= max_len:
        raise ValueError(
            f"the prompt has {len(prompt_token_ids)} tokens; max_model_len={max_len} leaves no room to generate"
        )
    vocab = config.model_config.hf_config["vocab_size"]
    bad = [t for t in prompt_token_ids if not 0 <= t < vocab]
    if bad:
        raise ValueError(f"prompt token ids out of range [0, {vocab}): {bad[:10]}")
    if any(t >= vocab for t in params.stop_token_ids or []):
        raise ValueError(f"stop_token_ids must be below the vocabulary size {vocab}")
    if any(t >= vocab for t in params.logit_bias or {}):
        raise ValueError(f"logit_bias token ids must be below the vocabulary size {vocab}")
    limit = config.model_config.max_logprobs
    for name in ("logprobs", "prompt_logprobs"):
        value = num_logprobs(getattr(params, name), int(vocab))
        if value is not None and value > (vocab if limit == -1 else min(limit, vocab)):
            raise ValueError(
                f"{name}={value} exceeds max_logprobs={limit} (vocabulary: {vocab}); raise it with "
                "LLM(max_logprobs=...) or --max-logprobs (-1: the whole vocabulary)"
            )
    if params.top_k > vocab:
        raise ValueError(f"top_k={params.top_k} exceeds the vocabulary size {vocab} (use -1 to disable top-k)")
    if params.n > config.scheduler_config.max_num_seqs:
        raise ValueError(f"n={params.n} exceeds max_num_seqs={config.scheduler_config.max_num_seqs}")
    if (params.return_routed_experts or params.forced_routed_experts is not None) and routing_shape is None:
        name = "return_routed_experts" if params.return_routed_experts else "forced_routed_experts"
        raise ValueError(f"{name} needs a mixture-of-experts model; {config.model_config.architecture} routes no token")
    if params.forced_routed_experts is not None:
        assert routing_shape is not None
        check_forced_routes(routing_shape, params.forced_routed_experts, len(prompt_token_ids))
    if params.grammar is not None:
        grammars.compile(params.grammar)  # an invalid schema, regex or grammar is refused here


def check_forced_routes(routing_shape: tuple[int, int, int], forced: np.ndarray, num_prompt_tokens: int) -> None:
    """Raises ValueError unless `forced` holds at most one row per prompt token, from the first, each naming
    `top_k` distinct experts of the model for every sparse layer."""
    layers, top_k, experts = routing_shape
    rows = forced.shape[0]
    if forced.shape[1:] != (layers, top_k):
        raise ValueError(
            f"forced_routed_experts has shape {list(forced.shape)}; this model needs [tokens, "
            f"{layers}, {top_k}] (sparse layers, experts per token)"
        )
    if rows > num_prompt_tokens:
        raise ValueError(
            f"forced_routed_experts has {rows} rows for a prompt of {num_prompt_tokens} tokens; give "
            "at most one row per prompt token, from the first"
        )
    if forced.min() < 0 or forced.max() >= experts:
        raise ValueError(
            f"forced_routed_experts holds expert ids outside [0, {experts}): {int(forced.min())}..{int(forced.max())}"
        )
    if any(len(set(row)) != top_k for row in forced.reshape(-1, top_k).tolist()):
        raise ValueError("forced_routed_experts names an expert twice for one token and layer")
