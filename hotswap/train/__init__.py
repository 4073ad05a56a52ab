"""The trainer's side of on-policy rollouts: what a trainer's own transformers model needs to replay a rollout
(`replay_routes`) and to score it with the engine's exact bits (`token_logprobs`)."""

from hotswap.train.logprobs import token_logprobs
from hotswap.train.routing_replay import replay_routes

__all__ = ["replay_routes", "token_logprobs"]
