"""Which path each kernel op takes, decided once per process: the one policy behind the facade (`ops.py`).

The switch is `HOTSWAP_NATIVE_KERNELS` (or `use_mode` in-process, for tests):

- `auto` (default; also 1 / on / yes): an op takes its native kernel only where a calibration measured it
  faster than its torch path on this machine and build (native time / torch time below `WIN_RATIO`). The
  calibration times every calibrated op on the model's shapes (`prepare`, called when a worker builds its model;
  the 125M preset's shapes otherwise) in well under a second, and is cached as JSON beside the build, keyed by
  the shapes, so later processes read it.
- `torch` (also 0 / off / false / no): every op takes its torch path.
- `native` (also force): every op takes its native kernel wherever the kernel applies (tests use it to compare
  the two paths on every build).

Ops that are not calibrated here are decided by a rule, given with its reason in the table: the paged attention
kernels read the paged cache in place, where the torch path gathers it and pads the batch. The decoder stack is
timed as a whole once a worker has its model and KV cache (`calibrate_stack`: one decode step through the
stack against one through the modules, per batch class, also cached); until then it is taken. It runs each
product as the table chose (the native kernel or the BLAS), so it computes what the modules would. The same
timing moves a product to its native kernel where a step with every product native was 5 % faster.
`python -m hotswap.kernels --report` prints the table.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.nn.functional as F

from hotswap.kernels import measurements, native
from hotswap.kernels.measurements import (
    WIN_RATIO,
    cached,
    measured,
    paired_seconds,
    threads_and_isa,
)
from hotswap.kernels.measurements import store as _store
from hotswap.kernels.native import NativeOps

logger = logging.getLogger(__name__)

CALIBRATED = ("rms_norm", "add_rms_norm", "linear", "gated_linear", "silu_and_mul", "rotary", "greedy_sample")
RULED = ("write_kv_cache", "paged_attention", "rope_paged_attention", "decoder_stack")
OPS = CALIBRATED + RULED
_STACK_REASON = "calibrated: one decode step through the stack against one through the modules (taken unless slower)"
# The decoder stack runs the kernels the modules would, without the Python between them: it can only gain, so it is
# taken unless its step measured slower (a flip near 1 costs nothing).
STACK_WIN_RATIO = 1.0
BATCHES = (4, 16, 64)  # the small-batch shape class (decode steps, short prefills) the native kernels serve


@dataclass(frozen=True)
class Shapes:
    """The model dimensions the calibration times: hidden size, MLP intermediate size, q/k/v width, heads,
    head size, vocabulary (the sampled logits' width), layers."""

    hidden: int = 576
    intermediate: int = 1536
    qkv: int = 960
    heads: int = 9
    head_dim: int = 64
    vocab: int = 16384
    layers: int = 30
    dtype: str = "float32"  # the activations' dtype, which the norms, SwiGLU gate and rotary are timed in

    def layer_weight_bytes(self) -> int:
        """float32 bytes of one layer's linear weights (q/k/v, o, gate/up, down)."""
        return 4 * (self.qkv * self.hidden + self.hidden * self.hidden + 3 * self.hidden * self.intermediate)

    @classmethod
    def of(cls, hf_config: dict[str, Any], dtype: torch.dtype = torch.float32) -> Shapes:
        hidden, heads = int(hf_config["hidden_size"]), int(hf_config["num_attention_heads"])
        head_dim = int(hf_config.get("head_dim") or hidden // heads)
        kv = int(hf_config.get("num_key_value_heads") or heads)
        intermediate = int(hf_config.get("intermediate_size") or 4 * hidden)
        layers = int(hf_config.get("num_hidden_layers", 1))
        return cls(
            hidden,
            intermediate,
            (heads + 2 * kv) * head_dim,
            heads,
            head_dim,
            int(hf_config["vocab_size"]),
            layers,
            str(dtype).removeprefix("torch."),
        )

    def key(self) -> str:
        """The cache key: the shapes, the threads the ops run on (a tensor-parallel worker has fewer) and the ISA
        torch's own kernels run (capped by the environment under `emulation`), which the torch paths' times
        depend on."""
        return "x".join(str(v) for v in asdict(self).values()) + threads_and_isa()


@dataclass(frozen=True)
class Decision:
    """Per batch class (the rows of BATCHES; a batch goes to the nearest), whether the op takes its native
    kernel; `ratios`: native time / torch time as calibrated (empty when decided by rule)."""

    op: str
    native: dict[int, bool]
    ratios: dict[int, float]
    reason: str

    @classmethod
    def rule(cls, op: str, native: bool, reason: str) -> Decision:
        return cls(op, dict.fromkeys(BATCHES, native), {}, reason)


def batch_class(rows: int) -> int:
    """The calibrated batch a batch of `rows` is decided by: 4 below 8 rows, 16 below 32, else 64."""
    return 4 if rows < 8 else 16 if rows < 32 else 64


class KernelPolicy:
    """The decision per op and batch class; `uses(op, rows)` is what the facade asks on every call."""

    def __init__(self, mode: str, decisions: dict[str, Decision], shapes: Shapes | None) -> None:
        self.mode = mode
        self.decisions = decisions
        self.shapes = shapes
        self._native = {op: d.native for op, d in decisions.items()}

    def uses(self, op: str, rows: int = 64) -> bool:
        return self._native[op][batch_class(rows)]

    def table(self) -> list[Decision]:
        return [self.decisions[op] for op in OPS]


_lock = threading.Lock()
_policy: list[KernelPolicy] = []  # the resolved policy, once known
_forced: list[str] = []  # use_mode() overrides, innermost last


def mode() -> str:
    """The mode `use_mode` forces if active, else the one HOTSWAP_NATIVE_KERNELS names (read now): "auto",
    "torch" or "native"."""
    if _forced:
        return _forced[-1]
    value = os.environ.get("HOTSWAP_NATIVE_KERNELS", "auto").strip().lower()
    if value in ("0", "off", "false", "no", "torch"):
        return "torch"
    if value in ("native", "force"):
        return "native"
    return "auto"


_env_mode: list[str] = []  # mode() from the environment as last read (by the first policy() or a prepare())


def policy() -> KernelPolicy:
    """The process's policy, resolved on first use (a calibration with default shapes if `prepare` was not
    called first). The environment is read once here; `prepare` (every model build) reads it again. Safe from
    any thread."""
    wanted = _forced[-1] if _forced else (_env_mode[0] if _env_mode else mode())
    current = _policy[-1] if _policy else None
    if current is not None and current.mode == wanted:
        return current
    with _lock:
        if not _forced:
            _env_mode[:] = [wanted]
        if not _policy or _policy[-1].mode != wanted:
            _policy.append(_resolve(wanted, _policy[-1].shapes if _policy else None))
            del _policy[:-1]
        return _policy[-1]


def prepare(hf_config: dict[str, Any], dtype: torch.dtype = torch.float32) -> KernelPolicy:
    """Resolves the policy for a model (its shapes and dtype), reading the switch again; a later model with other
    shapes re-resolves it."""
    shapes = Shapes.of(hf_config, dtype)
    wanted = mode()
    with _lock:
        if not _forced:
            _env_mode[:] = [wanted]
        if not _policy or _policy[-1].shapes != shapes or _policy[-1].mode != wanted:
            _policy.append(_resolve(wanted, shapes))
            del _policy[:-1]
        return _policy[-1]


@contextlib.contextmanager
def use_mode(value: str) -> Iterator[KernelPolicy]:
    """Inside the block every op follows `value` ("auto", "torch" or "native"); restored on exit."""
    if value not in ("auto", "torch", "native"):
        raise ValueError(f"kernel mode must be 'auto', 'torch' or 'native', got {value!r}")
    _forced.append(value)
    try:
        yield policy()
    finally:
        _forced.pop()


def _resolve(mode_: str, shapes: Shapes | None) -> KernelPolicy:
    kernels = native.ops() if mode_ != "torch" else None
    if kernels is None:
        why = "HOTSWAP_NATIVE_KERNELS=0" if mode_ == "torch" else "no native build (see the log)"
        return KernelPolicy(mode_, {op: Decision.rule(op, False, why) for op in OPS}, shapes)
    if mode_ == "native":
        return KernelPolicy(mode_, {op: Decision.rule(op, True, "forced (native mode)") for op in OPS}, shapes)
    shapes = shapes or Shapes()
    ratios = _calibration(kernels, shapes)
    decisions = {}
    for op in CALIBRATED:
        by_batch = {b: round(ratios[op][b], 3) for b in BATCHES}
        native_at = {b: r < WIN_RATIO for b, r in by_batch.items()}
        reason = "calibrated: native where it measured at least 5 % faster"
        decisions[op] = Decision(op, native_at, by_batch, reason)
    attention = "rule: reads the paged cache in place (torch gathers and pads it)"
    for op in ("write_kv_cache", "paged_attention", "rope_paged_attention"):
        decisions[op] = Decision.rule(op, True, attention)
    stack = _cached(shapes.key(), "decoder_stack")
    if stack is not None:
        decisions = _with_stack(decisions, stack, _cached(shapes.key(), "stack_products") or {})
    else:
        decisions["decoder_stack"] = Decision.rule(
            "decoder_stack", True, "rule until timed on a model: taken (it runs the products as chosen above)"
        )
    return KernelPolicy(mode_, decisions, shapes)


def _cached(key: str, op: str, batches: tuple[int, ...] = BATCHES) -> dict[int, float] | None:
    """The cached ratios of `op` for shapes `key` at `batches` (default: the batch classes), or None."""
    return cached(key, op, batches)


# Which products a decode step runs natively, in decoder_layers' order: (linear, gated_linear, silu_and_mul).
Products = tuple[bool, bool, bool]
PRODUCTS = ("linear", "gated_linear")  # the products the stack measurement may move to the native kernels


def products(current: KernelPolicy, rows: int) -> Products:
    """The products' paths on a step of `rows` tokens, as `current` chose them."""
    return current.uses("linear", rows), current.uses("gated_linear", rows), current.uses("silu_and_mul", rows)


def calibrate_stack(
    measure: Callable[[int, Sequence[Products]], tuple[list[float], float] | None],
) -> KernelPolicy:
    """Decides the decoder stack, and where the products of a decode step run, from `measure(rows, variants)` ->
    (seconds of one step of `rows` tokens through the stack with each variant's products, seconds of the same
    step through the modules with the table's), or None where the worker's cache cannot hold such a step; per
    batch class, on the worker's model and cache; cached beside the build with the shapes' other ratios. Only in
    "auto" mode with a resolved policy; returns the policy. The stack is judged against the modules on the
    table's products (the same work), the products by the stack's two steps.

    The variants are the table's products and, where the table put one on the BLAS, every product native. The op
    calibration times products on at most 64 MB of weights, which stay in a large last-level cache, while a
    large model's decode step streams its weights from memory, which the native kernels overlap with their
    arithmetic (they prefetch each weight in the order they read it) and a BLAS does not: the step, on the
    model's own weights, is the better judge. A product moves to its native kernel at a batch class where the
    step measured at least 5 % faster with it (for the modules too: one policy)."""
    current = policy()
    if current.mode != "auto" or current.shapes is None or not any(current.decisions["rms_norm"].native.values()):
        return current
    key = current.shapes.key()
    stack, moved = _cached(key, "decoder_stack"), _cached(key, "stack_products")
    if stack is None or moved is None:
        stack, moved = {}, {}
        for b in BATCHES:
            table = products(current, b)
            variants = [table] + ([(True, True, table[2])] if not all(table[:2]) else [])
            timed = measure(b, variants)
            if timed is None:  # the cache cannot hold the step: decided by rule, nothing cached
                return current
            stack_s, modules_s = timed
            moved[b] = round(stack_s[1] / stack_s[0], 3) if len(stack_s) > 1 else 1.0
            stack[b] = round(stack_s[0] / modules_s, 3)  # both with the table's products
        _store(key, "decoder_stack", stack)
        _store(key, "stack_products", moved)
    with _lock:
        if _policy and _policy[-1] is current:
            _policy[-1] = KernelPolicy(current.mode, _with_stack(current.decisions, stack, moved), current.shapes)
        return _policy[-1] if _policy else current


def _with_stack(
    decisions: dict[str, Decision], stack: dict[int, float], moved: dict[int, float]
) -> dict[str, Decision]:
    """`decisions` with the decoder stack's (`stack`: its step time / the modules', both on the table's products)
    and the products that a decode step measured faster native (`moved`: the stack's step with every product
    native / with the table's products, per batch)."""
    out = dict(
        decisions,
        decoder_stack=Decision(
            "decoder_stack", {b: r < STACK_WIN_RATIO for b, r in stack.items()}, stack, _STACK_REASON
        ),
    )
    for op in PRODUCTS:
        d = decisions[op]
        flips = {b for b, r in moved.items() if r < WIN_RATIO and not d.native[b]}
        if flips:
            out[op] = Decision(
                op,
                {b: d.native[b] or b in flips for b in BATCHES},
                {b: moved[b] if b in flips else d.ratios[b] for b in BATCHES},
                f"{d.reason}; at {', '.join(map(str, sorted(flips)))} rows: on a decode step of "
                "the model, every product native against the table's",
            )
    return out


STREAM_COPY_BYTES = 128 << 20  # what the weight-write gates write: more than most last-level caches hold (a larger
# cache makes ordinary stores look better, so the gate then errs toward torch's path)
SCATTER_FRACTION = 0.02  # the share of the elements the scatter gate writes: an RL step's footprint


def _write_gate(op: str, key: str, measure: Callable[[NativeOps], dict[int, float]]) -> bool:
    """A weight-write gate's verdict (`measured`: native over torch below WIN_RATIO, cached with the calibration;
    the facade keeps it per policy and thread count); False without the native build. `measure(kernels)` returns
    {1: native time / torch time}, the fastest of 3 each, in turn."""
    kernels = native.ops()
    if kernels is None:
        return False
    return measured(op, key, (1,), lambda: measure(kernels))


def _ratio(native_fn: Callable[[], object], torch_fn: Callable[[], object]) -> dict[int, float]:
    native_s, torch_s = paired_seconds(native_fn, torch_fn, 3)
    return {1: native_s / torch_s}


def stream_copy_faster() -> bool:
    """Whether the native streaming-store copy (stream_copy.cpp) measured at least 5 % faster than torch's `copy_`
    for a destination far larger than the caches (STREAM_COPY_BYTES), as a weight update writes. Measured once per
    machine, ISA cap and thread count (about 0.3 s and twice STREAM_COPY_BYTES of memory while it runs)."""

    def measure(kernels: NativeOps) -> dict[int, float]:
        src = torch.ones(STREAM_COPY_BYTES, dtype=torch.uint8)
        dst = torch.zeros_like(src)
        return _ratio(lambda: kernels.stream_copy_(dst, src), lambda: dst.copy_(src))

    return _write_gate("stream_copy", "bytes", measure)


def scatter_faster() -> bool:
    """Whether the native scatter (scatter.cpp) measured at least 5 % faster than torch's `index_copy_` writing
    SCATTER_FRACTION of a float32 destination of STREAM_COPY_BYTES at sorted random positions (a sparse delta).
    Measured once per machine, ISA cap and thread count."""

    def measure(kernels: NativeOps) -> dict[int, float]:
        gen = torch.Generator().manual_seed(0)
        dst = torch.zeros(STREAM_COPY_BYTES // 4)
        count = int(SCATTER_FRACTION * dst.numel())
        indices = torch.randint(0, dst.numel(), (count,), generator=gen).sort().values
        values = torch.ones(count)
        return _ratio(lambda: kernels.scatter_(dst, indices, values), lambda: dst.index_copy_(0, indices, values))

    return _write_gate("sparse_scatter", "float32", measure)


def finite_check_faster() -> bool:
    """Whether the native value check of many tensors at once (`max_magnitude_bits`, magnitudes.cpp) measured at
    least 5 % faster than torch's check of each (`isfinite(t.sum())`, what `all_finite` runs) on STREAM_COPY_BYTES of
    float32 in 2 MB tensors (a model's weights). Measured once per machine, ISA cap and thread count."""

    def measure(kernels: NativeOps) -> dict[int, float]:
        count = max(4, STREAM_COPY_BYTES >> 21)
        tensors = [torch.ones(STREAM_COPY_BYTES // count // 4) for _ in range(count)]
        return _ratio(
            lambda: kernels.max_magnitude_bits(tensors), lambda: [bool(torch.isfinite(t.sum())) for t in tensors]
        )

    return _write_gate("finite_check", "float32", measure)


def _calibration(kernels: NativeOps, shapes: Shapes) -> dict[str, dict[int, float]]:
    """Ratios per calibrated op and batch for these shapes: from the cache beside the build, else measured and
    cached."""
    path = measurements.cache_file()
    try:
        stored = json.loads(path.read_text())
    except (OSError, ValueError):
        stored = {}
    entry = stored.get(shapes.key())
    try:
        return {op: {b: float(entry[op][str(b)]) for b in BATCHES} for op in CALIBRATED}
    except (KeyError, TypeError, ValueError):
        pass
    start = time.perf_counter()
    ratios = calibrate(kernels, shapes)
    logger.info("kernel calibration for %s took %.2f s: %s", shapes.key(), time.perf_counter() - start, ratios)
    for op, by_batch in ratios.items():
        _store(shapes.key(), op, by_batch)
    return ratios


def calibrate(kernels: NativeOps, shapes: Shapes, reps: int = 9) -> dict[str, dict[int, float]]:
    """Times every calibrated op, native against its torch path in turn (`paired_seconds`), at each of BATCHES
    rows; returns native / torch per op and batch. The linear weights cycle through as many copies as the model has
    layers (up to 64 MB of them), so that a product finds its weight where a decode step would: in the cache for
    a small model, streamed from memory for a large one."""
    h, i, qkv = shapes.hidden, shapes.intermediate, shapes.qkv
    gen = torch.Generator().manual_seed(0)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen)

    copies = max(1, min(shapes.layers, (64 << 20) // shapes.layer_weight_bytes()))

    def rows(n: int, k: int) -> int:  # a weight above 64 MB is timed on its first rows (the cost is per row)
        r = max(2, min(n, (64 << 20) // (4 * k)))
        return r - r % 2 if n % 2 == 0 else r  # [gate; up] keeps two halves

    # a bf16 model's products are timed in bf16, against torch's bf16 path (oneDNN-packed where the model's would be)
    wdtype = torch.bfloat16 if shapes.dtype == "bfloat16" else torch.float32
    weights = {
        name: [torch.full((rows(n, k), k), 0.01, dtype=wdtype) for _ in range(copies)]
        for name, (n, k) in (("qkv", (qkv, h)), ("down", (h, i)), ("gate_up", (2 * i, h)))
    }
    torch_weights = {name: [_torch_path_weight(t) for t in ts] for name, ts in weights.items()}
    turn = [0]

    def w(name: str, torch_path: bool = False) -> torch.Tensor:
        turn[0] += 1
        return (torch_weights if torch_path else weights)[name][turn[0] % copies]

    norm_w = randn(h)
    positions_max = 2048
    freqs = torch.arange(positions_max, dtype=torch.float32)[:, None] * torch.rand(shapes.head_dim // 2, generator=gen)
    cos, sin = torch.cat((freqs, freqs), -1).cos(), torch.cat((freqs, freqs), -1).sin()
    ratios: dict[str, dict[int, float]] = {op: {} for op in CALIBRATED}
    for m in BATCHES:
        for op, (native_fn, torch_fn) in _pairs(kernels, shapes, m, randn, w, norm_w, cos, sin, gen).items():
            native_s, torch_s = paired_seconds(native_fn, torch_fn, reps)
            ratios[op][m] = native_s / torch_s
    return ratios


def _torch_path_weight(weight: torch.Tensor) -> torch.Tensor:
    """What torch's path multiplies by: a bf16 weight's oneDNN-packed copy where a model's layer would take one."""
    from hotswap.kernels import packed

    if weight.dtype == torch.bfloat16 and packed.supported() and packed.faster(*weight.shape):
        return packed.pack(weight)
    return weight


def _torch_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """`F.linear(x, weight)` as the layers run it (`weight` from `_torch_path_weight`)."""
    from hotswap.kernels import packed

    return packed.linear(x, weight, None) if weight.is_mkldnn else F.linear(x, weight)


def _pairs(
    kernels: NativeOps,
    shapes: Shapes,
    m: int,
    randn: Callable[..., torch.Tensor],
    w: Callable[..., torch.Tensor],
    norm_w: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    gen: torch.Generator,
) -> dict[str, tuple[Callable[[], object], Callable[[], object]]]:
    """(native call, torch call) per calibrated op, on a batch of `m` rows."""
    h, i = shapes.hidden, shapes.intermediate
    act = getattr(torch, shapes.dtype)
    wide = torch.bfloat16 if act == torch.bfloat16 else torch.float32  # products: float32, or bf16 for a bf16 model
    x, xi, residual = randn(m, h).to(wide), randn(m, i).to(wide), randn(m, h).to(act)
    gu, xa, norm_a = randn(m, 2 * i).to(act), x.to(act), norm_w.to(act)
    logits = randn(m, shapes.vocab)
    q = randn(m, shapes.heads, shapes.head_dim).to(act)
    k = randn(m, max(1, shapes.heads // 3), shapes.head_dim).to(act)
    positions = torch.randint(0, cos.shape[0], (m,), generator=gen)
    return {
        "rms_norm": (lambda: kernels.rms_norm(xa, norm_a, 1e-6), lambda: _torch_rms_norm(xa, norm_a, 1e-6)),
        "add_rms_norm": (
            lambda: kernels.add_rms_norm(xa, residual.clone(), norm_a, 1e-6),
            lambda: _torch_rms_norm(residual.clone() + xa, norm_a, 1e-6),
        ),
        "linear": (
            lambda: (kernels.small_batch_linear(x, w("qkv"), None), kernels.small_batch_linear(xi, w("down"), None)),
            lambda: (_torch_linear(x, w("qkv", True)), _torch_linear(xi, w("down", True))),
        ),
        "gated_linear": (
            lambda: kernels.small_batch_gated_linear(x, w("gate_up"), None),
            lambda: _torch_silu_and_mul(_torch_linear(x, w("gate_up", True))),
        ),
        "silu_and_mul": (lambda: kernels.silu_and_mul(gu), lambda: _torch_silu_and_mul(gu)),
        "rotary": (lambda: kernels.rotary(q, k, positions, cos, sin), lambda: _torch_rotary(q, k, positions, cos, sin)),
        "greedy_sample": (lambda: kernels.greedy_sample(logits), lambda: _torch_greedy(logits)),
    }


# ---- the torch paths the calibration compares against (the facade's own fallbacks compute the same) ------------


def _torch_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    h = x.float()
    return weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def _torch_silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return F.silu(x[..., :half]) * x[..., half:]


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _torch_rotary(
    q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    c, s = cos[positions].to(q.dtype).unsqueeze(1), sin[positions].to(q.dtype).unsqueeze(1)
    return q * c + _rotate_half(q) * s, k * c + _rotate_half(k) * s


def _torch_greedy(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    best = logits.max(dim=-1)
    return best.indices, best.values - logits.logsumexp(dim=-1)
