"""The trainer's side of on-policy rollouts: what a trainer's own transformers model needs to replay a rollout."""

from hotswap.train.routing_replay import replay_routes

__all__ = ["replay_routes"]
