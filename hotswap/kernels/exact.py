"""Differentiable native kernels: a kernel's result forward and a reference formula's gradient backward, so that
the trainer's forward (`hotswap.train.token_logprobs`) computes the engine's bits and still back-propagates. The
facade (`ops.py`) wraps its deterministic-mode calls in these; autograd never sees a kernel without them."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import torch

R = TypeVar("R")


def needs_grad(*tensors: torch.Tensor | None) -> bool:
    """Whether autograd records and one of `tensors` requires grad (a native kernel alone has no backward)."""
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


class _Exact(torch.autograd.Function):
    """The kernel's result forward, the reference formula's gradient backward (see `exact`)."""

    @staticmethod
    def forward(ctx: Any, kernel: Callable[..., object], reference: Callable[..., object], *inputs: object) -> object:
        ctx.reference = reference
        ctx.tensor_at = [i for i, a in enumerate(inputs) if isinstance(a, torch.Tensor)]
        ctx.others = [None if isinstance(a, torch.Tensor) else a for a in inputs]
        ctx.save_for_backward(*(inputs[i] for i in ctx.tensor_at))
        return kernel(*inputs)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        args = list(ctx.others)
        leaves = []
        with torch.enable_grad():
            for i, saved in zip(ctx.tensor_at, ctx.saved_tensors, strict=True):
                args[i] = saved.detach().requires_grad_(saved.requires_grad)
                leaves.append(args[i])
            out = ctx.reference(*args)
            outs = out if isinstance(out, tuple) else (out,)
            live = [(o, g) for o, g in zip(outs, grads, strict=True) if o.requires_grad]  # others: no gradient
            wanted = [t for t in leaves if t.requires_grad]
            found = iter(torch.autograd.grad([o for o, _ in live], wanted, [g for _, g in live], allow_unused=True))
        result: list[torch.Tensor | None] = [None] * len(args)
        for i, leaf in zip(ctx.tensor_at, leaves, strict=True):
            if leaf.requires_grad:
                result[i] = next(found)
        return (None, None, *result)


def exact(kernel: Callable[..., R], reference: Callable[..., R], *inputs: object) -> R:
    """`kernel(*inputs)`; where autograd is recording, differentiable with the gradient of `reference(*inputs)`
    (the same function written in torch ops). The trainer's forward (`hotswap.train.token_logprobs`) thus computes
    the engine's bits and still back-propagates."""
    if not needs_grad(*(a for a in inputs if isinstance(a, torch.Tensor))):
        return kernel(*inputs)
    result: R = _Exact.apply(kernel, reference, *inputs)  # type: ignore[no-untyped-call]
    return result


class _Product(torch.autograd.Function):
    """A product's kernel forward (`x · weightᵀ + bias` in the kernel's bits), F.linear's gradient backward, computed
    from the saved inputs without running the product again."""

    @staticmethod
    def forward(
        ctx: Any, kernel: Callable[..., torch.Tensor], x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
    ) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        return kernel(x, weight, bias)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, weight = ctx.saved_tensors
        grad_x = grad @ weight if ctx.needs_input_grad[1] else None
        grad_w = grad.t() @ x if ctx.needs_input_grad[2] else None
        grad_b = grad.sum(0) if ctx.has_bias and ctx.needs_input_grad[3] else None
        return None, grad_x, grad_w, grad_b


def product(
    kernel: Callable[..., torch.Tensor], x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """`kernel(x, weight, bias)`, a product equal to F.linear up to rounding; differentiable where autograd records."""
    if not needs_grad(x, weight, bias):
        return kernel(x, weight, bias)
    out: torch.Tensor = _Product.apply(kernel, x, weight, bias)  # type: ignore[no-untyped-call]
    return out
