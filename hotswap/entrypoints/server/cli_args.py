"""The `hotswap serve` command: its arguments, and `serve`, which checks them, builds the engine (one
`AsyncLLMEngine`, or an `AsyncFleet` on Ray with --data-parallel-size > 1 or --ray-address) and runs the app."""

from __future__ import annotations

import argparse
import json
import socket

from hotswap.config import LoRAConfig
from hotswap.engine.async_llm_engine import AsyncLLMEngine
from hotswap.engine.client import EngineClient
from hotswap.entrypoints.chat_output import REASONING_PARSERS
from hotswap.entrypoints.server.app import LOOPBACK_NAMES, check_keys, create_app, is_loopback
from hotswap.entrypoints.server.join import JoinSource
from hotswap.entrypoints.server.state import ChatSettings, RequestLimits
from hotswap.entrypoints.tools import PARSERS
from hotswap.fleet.async_fleet import AsyncFleet


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    """Adds the options of `hotswap serve` to `parser`."""
    parser.add_argument("model", help="Hugging Face checkpoint folder")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000, help="0: any free port (the line printed at start names it)")
    parser.add_argument("--api-key", default=None, help="required as 'Authorization: Bearer' on /v1 routes")
    parser.add_argument("--admin-key", default=None, help="required as 'Authorization: Bearer' on admin routes")
    parser.add_argument(
        "--admin-auth",
        default="key",
        choices=["key", "none"],
        help="'none' opens the admin routes without a key (loopback hosts, or with --trusted-network)",
    )
    parser.add_argument(
        "--trusted-network",
        action="store_true",
        help="allow --admin-auth none on a non-loopback address: everyone who can reach the port "
        "may change the weights (frameworks send no key; a private network only)",
    )
    parser.add_argument(
        "--allowed-host",
        action="append",
        default=[],
        help="a Host header name admin routes answer to, besides localhost / 127.0.0.1 / ::1 (repeatable)",
    )
    parser.add_argument("--disable-admin", action="store_true", help="serve only the OpenAI routes")
    parser.add_argument("--served-model-name", default=None)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument(
        "--device",
        default="cpu",
        help="cpu (default), cuda or cuda:N: where the model and its KV cache live (docs/gpu.md)",
    )
    parser.add_argument(
        "--gpu-memory-utilization",
        type=float,
        default=0.9,
        help="on a GPU: the share of its memory the engine may take (weights, activations, KV cache)",
    )
    parser.add_argument("--max-model-len", type=int, default=None)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=None,
        help="tokens one step may run (default 2048 with chunked prefill)",
    )
    parser.add_argument(
        "--enable-chunked-prefill",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="run long prompts in chunks beside the running decodes (default on)",
    )
    parser.add_argument(
        "--long-prefill-token-threshold",
        type=int,
        default=0,
        help="the most tokens of one prompt a step runs (0: no cap)",
    )
    parser.add_argument(
        "--max-num-partial-prefills",
        type=int,
        default=1,
        help="prompts that may be part-way through their prefill at once",
    )
    parser.add_argument("--tensor-parallel-size", type=int, default=1)
    parser.add_argument(
        "--data-parallel-size",
        type=int,
        default=1,
        help="engine replicas on Ray behind this server (a fleet; needs hotswap[ray])",
    )
    parser.add_argument(
        "--ray-address",
        default=None,
        help="a Ray cluster to run the fleet on ('auto', 'ray://host:port'; default: a local Ray)",
    )
    parser.add_argument(
        "--num-cpus-per-worker",
        type=float,
        default=1.0,
        help="CPUs each worker of a fleet replica reserves in its placement group",
    )
    parser.add_argument(
        "--num-gpus-per-worker",
        type=float,
        default=None,
        help="GPUs each worker of a fleet replica reserves (default: 1 where CUDA is available)",
    )
    parser.add_argument(
        "--join",
        default=None,
        metavar="URL",
        help="a live hotswap server (http://host:port) whose committed version (weights, LoRA "
        "adapters, live config, version label) this one copies, checksums checked, before it serves; "
        "/health answers 503 until then (SGLang's analogue: --load-format remote_instance)",
    )
    parser.add_argument(
        "--join-admin-key", default=None, help="the live server's admin key, for --join (default: --admin-key)"
    )
    parser.add_argument(
        "--join-timeout-s",
        type=float,
        default=600.0,
        help="how long --join may take, retries while the live server updates included",
    )
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--kv-cache-memory-bytes", type=int, default=None)
    parser.add_argument(
        "--kv-cache-dtype",
        default="auto",
        help="dtype K and V are stored and attended in: auto (float32 on the CPU, the weights' "
        "dtype on a GPU), bfloat16 or float16",
    )
    parser.add_argument("--quantization", default=None, choices=[None, "fp8"])
    parser.add_argument(
        "--deterministic",
        "--enable-deterministic-inference",
        action="store_true",
        help="batch-invariant forward pass: every request's tokens and logprobs are the same bits "
        "whatever else runs, and equal to hotswap.train.token_logprobs (docs/determinism.md); "
        "--enable-deterministic-inference is SGLang's spelling",
    )
    parser.add_argument("--prefix-cache-policy", default="reset", choices=["reset", "salt"])
    parser.add_argument(
        "--update-staging",
        default="in_place",
        choices=["in_place", "shadow"],
        help="shadow: weight updates are received into staging copies while requests keep "
        "generating, and committed between two steps (one more copy of the weights an update "
        "changes); in_place (default): updates write the served weights (pause generation first)",
    )
    parser.add_argument(
        "--on-weight-update",
        default="keep",
        choices=["keep", "recompute"],
        help="a running request's KV cache at a weight commit, unless the request says: keep it, or "
        "recompute it on the new weights",
    )
    parser.add_argument(
        "--staging-slice-ms",
        type=float,
        default=3.0,
        help="with --update-staging shadow: how long an update is received between two steps",
    )
    parser.add_argument("--max-request-bytes", type=int, default=RequestLimits.max_request_bytes)
    parser.add_argument("--max-stop-strings", type=int, default=RequestLimits.max_stop_strings)
    parser.add_argument("--max-stop-string-chars", type=int, default=RequestLimits.max_stop_string_chars)
    parser.add_argument("--max-n", type=int, default=RequestLimits.max_n, help="samples one request may ask for")
    parser.add_argument(
        "--max-tokens",
        type=int,
        default=None,
        help="tokens one request may generate (default: up to the context length)",
    )
    parser.add_argument(
        "--logprobs-mode",
        default="raw_logprobs",
        choices=["raw_logprobs", "processed_logprobs", "raw_logits", "processed_logits"],
        help="what sampled tokens' logprobs report (vLLM's): the raw or the sampled-from "
        "distribution, or the logits; the processed modes apply to prompt logprobs too",
    )
    parser.add_argument(
        "--max-logprobs", type=int, default=20, help="log probabilities one token may return (-1: the whole vocabulary)"
    )
    parser.add_argument(
        "--max-pause-wait-s",
        type=float,
        default=RequestLimits.max_pause_wait_s,
        help="how long a request waits while generation is paused before it gets 503",
    )
    parser.add_argument(
        "--shutdown-timeout-s",
        type=float,
        default=5.0,
        help="on SIGTERM, how long requests in flight may take before they are cut",
    )
    parser.add_argument(
        "--speculative-config",
        type=json.loads,
        default=None,
        help='speculative decoding as JSON, e.g. \'{"method": "ngram", "num_speculative_tokens": 3}\' '
        'or \'{"method": "draft_model", "model": DRAFT_DIR}\'',
    )
    parser.add_argument(
        "--tool-call-parser",
        default=None,
        choices=sorted(PARSERS),
        help="parse tool calls from chat outputs in this format (needed for tool_choice 'auto')",
    )
    parser.add_argument(
        "--enable-auto-tool-choice",
        action="store_true",
        help="accepted for vLLM compatibility (tool_choice 'auto' needs only --tool-call-parser)",
    )
    parser.add_argument(
        "--reasoning-parser",
        default=None,
        choices=REASONING_PARSERS,
        help="split <think> reasoning into reasoning_content",
    )
    parser.add_argument(
        "--session-cache-fraction",
        type=float,
        default=0.5,
        help="share of the KV blocks that open sessions' cached prefixes may hold with priority",
    )
    lora = parser.add_argument_group(
        "LoRA adapters",
        "requests name an adapter as their OpenAI `model` (vLLM) or "
        "`lora_path` (SGLang's /generate); admin routes load and unload them",
    )
    lora.add_argument("--enable-lora", action="store_true", help="serve LoRA adapters (implied by --lora-modules)")
    lora.add_argument(
        "--max-loras",
        "--max-loras-per-batch",
        type=int,
        default=LoRAConfig.max_loras,
        help="adapter versions one engine step may use together (SGLang: --max-loras-per-batch)",
    )
    lora.add_argument(
        "--max-lora-rank", type=int, default=LoRAConfig.max_lora_rank, help="the largest adapter rank accepted"
    )
    lora.add_argument(
        "--max-cpu-loras",
        "--max-loaded-loras",
        type=int,
        default=None,
        help="adapter versions held at once, those still in use by requests included (default "
        "--max-loras; SGLang: --max-loaded-loras); a load past it is refused, never evicts",
    )
    lora.add_argument(
        "--lora-version-policy",
        default=LoRAConfig.lora_version_policy,
        choices=["finish_on_old", "switch"],
        help="when an adapter is reloaded in place, requests running on it finish on the version they "
        "started with, or switch to the new one",
    )
    lora.add_argument(
        "--lora-modules",
        nargs="+",
        action="extend",
        type=vllm_lora_module,
        default=[],
        metavar="NAME=PATH",
        help='adapters loaded at start: name=path, or JSON {"name": ..., "path": ...} (vLLM\'s forms)',
    )
    lora.add_argument(
        "--lora-paths",
        nargs="+",
        action="extend",
        type=sglang_lora_path,
        dest="lora_modules",
        metavar="[NAME=]PATH",
        help='SGLang\'s spelling of --lora-modules: PATH, NAME=PATH, or JSON {"lora_name": ..., "lora_path": ...}',
    )
    parser.add_argument("--log-level", default="warning")


def vllm_lora_module(item: str) -> tuple[str, str]:
    """A `--lora-modules` entry as (name, path): `name=path`, or JSON `{"name": ..., "path": ...}` (vLLM's
    LoRAModulePath; its `base_model_name` is accepted). Raises argparse.ArgumentTypeError."""
    if "=" in item and not item.lstrip().startswith("{"):
        name, path = item.split("=", 1)
        if not name or not path:
            raise argparse.ArgumentTypeError(f"expected name=path, got {item!r}")
        return name, path
    return _lora_json(item)


def sglang_lora_path(item: str) -> tuple[str, str]:
    """A `--lora-paths` entry as (name, path): PATH (named by itself), NAME=PATH, or JSON `{"lora_name": ...,
    "lora_path": ..., "pinned": ...}` (SGLang's forms)."""
    if item.lstrip().startswith("{"):
        return _lora_json(item)
    if "=" in item:
        return vllm_lora_module(item)
    return item, item


def _lora_json(item: str) -> tuple[str, str]:
    try:
        entry = json.loads(item)
    except json.JSONDecodeError as err:
        raise argparse.ArgumentTypeError(f"not name=path nor JSON: {item!r} ({err})") from None
    if not isinstance(entry, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {item!r}")
    unknown = sorted(set(entry) - {"name", "path", "lora_name", "lora_path", "base_model_name", "pinned"})
    name, path = entry.get("name", entry.get("lora_name")), entry.get("path", entry.get("lora_path"))
    if unknown or not isinstance(name, str) or not isinstance(path, str) or not name or not path:
        raise argparse.ArgumentTypeError(f'expected {{"name": str, "path": str}}, got {item!r}')
    return name, path


def serve(args: argparse.Namespace) -> int:
    """Runs the server until interrupted. Refuses admin routes on a non-loopback host without an admin key."""
    import os

    import uvicorn

    enable_admin = not args.disable_admin
    check_keys(args.api_key, args.admin_key)
    trusted = getattr(args, "trusted_network", False)
    if enable_admin and args.admin_auth == "none" and not is_loopback(args.host) and not trusted:
        raise ValueError(
            f"--admin-auth none is refused on non-loopback host {args.host!r}; use --admin-key (or "
            "--trusted-network on a private network)"
        )
    if (
        enable_admin
        and args.admin_key is None
        and not is_loopback(args.host)
        and not (trusted and args.admin_auth == "none")
    ):
        raise ValueError(f"admin routes on non-loopback host {args.host!r} need --admin-key (or pass --disable-admin)")
    # bound to loopback, only loopback names are expected (another Host is a DNS-rebinding page); on a public
    # address the admin key protects the routes, and --allowed-host narrows the names if given
    allowed: frozenset[str] | None = None
    if is_loopback(args.host) or args.allowed_host:
        allowed = frozenset(LOOPBACK_NAMES | {args.host, *args.allowed_host})
    engine_kwargs = dict(
        dtype=args.dtype,
        device=args.device,
        gpu_memory_utilization=args.gpu_memory_utilization,
        max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        enable_chunked_prefill=args.enable_chunked_prefill,
        long_prefill_token_threshold=args.long_prefill_token_threshold,
        max_num_partial_prefills=args.max_num_partial_prefills,
        block_size=args.block_size,
        kv_cache_memory_bytes=args.kv_cache_memory_bytes,
        kv_cache_dtype=args.kv_cache_dtype,
        quantization=args.quantization,
        deterministic=args.deterministic,
        prefix_cache_policy=args.prefix_cache_policy,
        update_staging=args.update_staging,
        staging_slice_ms=args.staging_slice_ms,
        on_weight_update=args.on_weight_update,
        session_cache_fraction=args.session_cache_fraction,
        tensor_parallel_size=args.tensor_parallel_size,
        max_logprobs=args.max_logprobs,
        logprobs_mode=args.logprobs_mode,
        speculative_config=args.speculative_config,
        enable_lora=args.enable_lora or bool(args.lora_modules),
        max_loras=args.max_loras,
        max_lora_rank=args.max_lora_rank,
        max_cpu_loras=args.max_cpu_loras,
        lora_version_policy=args.lora_version_policy,
    )
    engine: EngineClient
    if args.data_parallel_size < 1:
        raise ValueError(f"--data-parallel-size must be at least 1, got {args.data_parallel_size}")
    # the port is bound before the engine starts: a port in use fails at once, and the worker processes (Ray's
    # among them) cannot take it while the model loads
    join_source = None
    if args.join is not None:
        if args.data_parallel_size > 1 or args.ray_address is not None or args.lora_modules:
            raise ValueError(
                "--join starts one engine with the live server's adapters: leave out "
                "--data-parallel-size, --ray-address and --lora-modules (a fleet adds replicas with "
                "POST /fleet/add_replicas)"
            )
        join_source = JoinSource(args.join, args.join_admin_key or args.admin_key, args.join_timeout_s)
    sock = bind_socket(args.host, args.port)
    if args.data_parallel_size > 1 or args.ray_address is not None:
        from hotswap.fleet import Fleet

        engine = AsyncFleet(
            Fleet(
                args.model,
                num_replicas=args.data_parallel_size,
                address=args.ray_address,
                num_cpus_per_worker=args.num_cpus_per_worker,
                num_gpus_per_worker=args.num_gpus_per_worker,
                **engine_kwargs,
            )
        )
    else:
        engine = AsyncLLMEngine.from_kwargs(args.model, **engine_kwargs)
    name = args.served_model_name or os.path.basename(os.path.normpath(args.model))
    limits = RequestLimits(
        args.max_request_bytes,
        args.max_stop_strings,
        args.max_stop_string_chars,
        args.max_pause_wait_s,
        args.max_n,
        args.max_tokens,
    )
    chat = ChatSettings(args.tool_call_parser, args.reasoning_parser)
    app = create_app(
        engine,
        name,
        args.api_key,
        args.admin_key,
        enable_admin,
        args.admin_auth,
        allowed,
        limits,
        chat,
        args.lora_modules,
        join_source,
    )
    port = sock.getsockname()[1]
    print(
        f"serving {name!r} on http://{args.host}:{port} (admin routes {'on' if enable_admin else 'off'}"
        f"{f'; catching up with {args.join} first' if args.join else ''})",
        flush=True,
    )
    config = uvicorn.Config(
        app,
        host=args.host,
        port=port,
        log_level=args.log_level,
        timeout_graceful_shutdown=max(1, round(args.shutdown_timeout_s)),
    )
    with sock:
        uvicorn.Server(config).run(sockets=[sock])
    return 0


def bind_socket(host: str, port: int) -> socket.socket:
    """A listening TCP socket on (host, port), port 0 meaning any free one. Raises OSError naming the address if it
    is taken."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(2048)
    except OSError as e:
        sock.close()
        raise OSError(e.errno, f"cannot listen on {host}:{port}: {e.strerror}") from None
    sock.set_inheritable(False)
    return sock
