"""hotswap's HTTP server: OpenAI's routes, vLLM's and SGLang's RL admin routes, on one port.

`app.create_app` builds the FastAPI app around a `state.ServerState`, including the routers by surface:
`openai` (completions, chat, models, tokenize), `vllm_rl` (vLLM's weight-update and admin API), `sglang`
(SGLang's), `fleet` (`/fleet_status`), `health` (`/health`, `/metrics`). `cli_args` holds `hotswap serve`.
"""

from hotswap.entrypoints.server.app import LOOPBACK_NAMES, check_keys, create_app, is_loopback
from hotswap.entrypoints.server.cli_args import add_serve_arguments, serve
from hotswap.entrypoints.server.state import ApiError, RequestLimits, ServerState
from hotswap.entrypoints.server.vllm_rl import RPC_ALLOWLIST, vllm_config

__all__ = [
    "LOOPBACK_NAMES",
    "RPC_ALLOWLIST",
    "ApiError",
    "RequestLimits",
    "ServerState",
    "add_serve_arguments",
    "check_keys",
    "create_app",
    "is_loopback",
    "serve",
    "vllm_config",
]
