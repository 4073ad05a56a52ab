"""`/v1/score_tokens`: teacher scoring over HTTP (docs/teacher-scoring.md).

A body names token sequences (`input_ids`, SGLang's name for token-id input: a list of lists); the answer is, per
sequence, each token's logprob given the tokens before it under log_softmax(logits / temperature) after the
request's top-k/top-p/min-p, its rank and the `top_logprobs` most likely tokens per position (-1: the whole
vocabulary, bounded by --max-logprobs), without generating (`AsyncLLMEngine.score_tokens`, between steps). Bad
input is a 400 and the engine goes on serving; an open weight update, sleep or invalid weights a 409 (a paused
engine scores). Served for one engine; in front of a fleet the route answers 501."""

from __future__ import annotations

from typing import Literal

from fastapi import APIRouter
from pydantic import BaseModel, ConfigDict, Field, StrictInt

from hotswap.entrypoints.logprobs_wire import scores_json
from hotswap.entrypoints.server.state import ApiError, StateDep

router = APIRouter()


class ScoreTokensRequest(BaseModel):
    """The body of `/v1/score_tokens`. `model` is the served model's name. Unknown fields are ignored."""

    model_config = ConfigDict(extra="ignore")

    model: str
    input_ids: list[list[StrictInt]] = Field(..., min_length=1)
    temperature: float = 1.0
    top_logprobs: StrictInt = 0
    top_k: StrictInt = -1
    top_p: float = 1.0
    min_p: float = 0.0
    logprobs_format: Literal["json", "base64"] = "json"


@router.post("/v1/score_tokens")
async def score_tokens(body: ScoreTokensRequest, state: StateDep) -> dict[str, object]:
    """{"object": "list", "model", "weight_version" (the label of the weights that scored), "data": one entry per
    sequence (`logprobs_wire.scores_json`: JSON lists, or with logprobs_format "base64" the compact arrays),
    "usage"}."""
    if body.model != state.served_model_name:
        raise ApiError(404, f"The model `{body.model}` does not exist.", "NotFoundError")
    engine = state.engine.local
    if engine is None:
        raise ApiError(501, "/v1/score_tokens is served by one engine, not in front of a fleet", "not_implemented")
    scores = await engine.score_tokens(
        [list(ids) for ids in body.input_ids],
        body.temperature,
        body.top_logprobs,
        body.top_k,
        body.top_p,
        body.min_p,
    )
    tokens = sum(len(ids) for ids in body.input_ids)
    return {
        "object": "list",
        "model": body.model,
        "weight_version": scores[0].weight_version_label,
        "data": [scores_json(s, i, body.logprobs_format) for i, s in enumerate(scores)],
        "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
    }
