"""Logprobs on the wire in a compact form: little-endian arrays, base64 (`"logprobs_format": "base64"`).

A compact object describes N scored positions with K top entries each (docs/teacher-scoring.md):

    {"format": "base64", "num_positions": N, "k": K,
     "token_ids": <int32 [N]>,        the token scored at each position (sampled, or the prompt's next token)
     "logprobs": <float32 [N]>,       its logprob
     "ranks": <int32 [N]>,            its rank (1 = most likely)
     "top_ids": <int32 [N, K]>,       the K most likely tokens per position, most likely first (row-major)
     "top_logprobs": <float32 [N, K]>}

Each array is `base64(array.astype("<i4" or "<f4").tobytes())`; decode with
`np.frombuffer(base64.b64decode(s), "<f4").reshape(N, K)`. The values are the engine's float32 bits: the JSON form's
numbers (which are those float32 values printed exactly) decode to the same bits, except -inf (a token a filter
removed), which JSON cannot carry and shows as -9999.0 (vLLM's convention) while the arrays keep -inf.
"""

from __future__ import annotations

import base64
from typing import Any

import numpy as np

from hotswap.outputs import Logprob, TokenScores

JSON_FLOOR = -9999.0  # what JSON shows for -inf (vLLM's)


def json_logprob(value: float) -> float:
    """A logprob as JSON can carry it: -inf (and anything below) as -9999.0, vLLM's convention."""
    return value if value >= JSON_FLOOR else JSON_FLOOR


def b64_int32(values: Any) -> str:
    """`values` as little-endian int32, base64."""
    return base64.b64encode(np.ascontiguousarray(values, dtype="<i4").tobytes()).decode("ascii")


def b64_float32(values: Any) -> str:
    """`values` as little-endian float32, base64 (a float32 value keeps its bits)."""
    return base64.b64encode(np.ascontiguousarray(values, dtype="<f4").tobytes()).decode("ascii")


def compact(token_ids: Any, logprobs: Any, ranks: Any, top_ids: Any, top_logprobs: Any) -> dict[str, Any]:
    """The compact object of N positions: `token_ids`, `logprobs`, `ranks` [N]; `top_ids`, `top_logprobs` [N, K]
    (array-likes; an empty [0, K] is fine)."""
    top = np.asarray(top_logprobs, dtype=np.float32)
    n = len(token_ids)
    k = int(top.shape[1]) if top.ndim == 2 else 0
    return {
        "format": "base64",
        "num_positions": n,
        "k": k,
        "token_ids": b64_int32(token_ids),
        "logprobs": b64_float32(logprobs),
        "ranks": b64_int32(ranks),
        "top_ids": b64_int32(np.asarray(top_ids, dtype=np.int64).reshape(n, k)),
        "top_logprobs": b64_float32(top.reshape(n, k)),
    }


def decode(obj: dict[str, Any]) -> dict[str, np.ndarray]:
    """The arrays of a compact object (the client's side; the tests use it): `token_ids`, `logprobs`, `ranks`
    [N] and `top_ids`, `top_logprobs` [N, K]."""
    n, k = int(obj["num_positions"]), int(obj["k"])

    def arr(name: str, dtype: str, shape: tuple[int, ...]) -> np.ndarray:
        return np.frombuffer(base64.b64decode(obj[name]), dtype=dtype).reshape(shape)

    return {
        "token_ids": arr("token_ids", "<i4", (n,)),
        "logprobs": arr("logprobs", "<f4", (n,)),
        "ranks": arr("ranks", "<i4", (n,)),
        "top_ids": arr("top_ids", "<i4", (n, k)),
        "top_logprobs": arr("top_logprobs", "<f4", (n, k)),
    }


def entries_compact(token_ids: list[int], entries: list[dict[int, Logprob]], k: int) -> dict[str, Any]:
    """The compact object of positions whose logprobs are vLLM's dicts (`CompletionOutput.logprobs`, prompt
    logprobs without the leading None): entry i holds `token_ids[i]` and the top `k` (ranks 1..k, the scored
    token among them where it is one). Top entries come out by rank; tokens of exactly equal logprob may swap."""
    n = len(token_ids)
    chosen = np.empty(n, dtype=np.float32)
    ranks = np.empty(n, dtype=np.int32)
    top_ids = np.zeros((n, k), dtype=np.int32)
    top_values = np.zeros((n, k), dtype=np.float32)
    for i, (token, entry) in enumerate(zip(token_ids, entries, strict=True)):
        lp = entry[token]
        chosen[i], ranks[i] = lp.logprob, lp.rank or 0
        items = list(entry.items())
        if len(items) > k:  # the scored token is outside the top k: it was put first
            items = items[1:]
        items.sort(key=lambda item: item[1].rank or 0)  # stable: ties keep the order they were given
        for j, (tid, top) in enumerate(items[:k]):
            top_ids[i, j], top_values[i, j] = tid, top.logprob
    return compact(token_ids, chosen, ranks, top_ids, top_values)


def scores_json(scores: TokenScores, index: int, fmt: str) -> dict[str, Any]:
    """One sequence's entry of `/v1/score_tokens`: the compact object (fmt "base64") or the same fields as JSON
    lists (-inf as -9999.0), with its `index` and `num_tokens`."""
    head = {"object": "token_scores", "index": index, "num_tokens": len(scores.token_ids)}
    scored = scores.token_ids[1:]
    if fmt == "base64":
        return {**head, **compact(scored, scores.logprobs, scores.ranks, scores.top_ids, scores.top_logprobs)}
    return {
        **head,
        "format": "json",
        "num_positions": len(scored),
        "k": int(scores.top_ids.shape[1]),
        "token_ids": list(scored),
        "logprobs": [json_logprob(v) for v in scores.logprobs.tolist()],
        "ranks": scores.ranks.tolist(),
        "top_ids": scores.top_ids.tolist(),
        "top_logprobs": [[json_logprob(v) for v in row] for row in scores.top_logprobs.tolist()],
    }
