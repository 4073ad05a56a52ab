"""Where tensors' memory lives: returning it to the operating system without moving tensors, and placing the
weights in transparent huge pages."""

from __future__ import annotations

import ctypes
import mmap
import sys
from collections.abc import Sequence
from typing import cast

import torch

_MADV_DONTNEED = 4
_MADV_HUGEPAGE = 14
_HUGE_PAGE = 2 << 20  # x86-64 and arm64 (4 KiB base pages)
_ALIGN = 64  # every parameter starts on a cache line


def discard_pages(tensor: torch.Tensor) -> int:
    """Releases the whole pages inside `tensor`'s memory to the OS (Linux `madvise(MADV_DONTNEED)`); the
    tensor keeps its address and reads zeros from the released pages afterwards. Returns the bytes released
    (0 where this is unsupported: not Linux, not CPU, or smaller than a page)."""
    if not sys.platform.startswith("linux") or tensor.device.type != "cpu" or not tensor.is_contiguous():
        return 0
    page = mmap.PAGESIZE
    start = tensor.data_ptr()
    end = start + tensor.numel() * tensor.element_size()
    first, last = (start + page - 1) // page * page, end // page * page
    if last <= first:
        return 0
    if _madvise(first, last - first, _MADV_DONTNEED) != 0:
        return 0
    return last - first


def place_in_huge_pages(module: torch.nn.Module) -> int:
    """Rebinds every parameter of `module` (CPU, before its weights are loaded: contents become zeros) to a view
    of one anonymous mapping advised for transparent huge pages (Linux `MADV_HUGEPAGE`). A decode step streams
    every weight, and with 2 MiB pages it needs one TLB entry per 2 MiB instead of per 4 KiB (the measured gain is
    in docs/performance.md). Parameters keep their shape, dtype and
    attributes, and their storage from then on (updates copy into it). Returns the bytes placed (0 where this is
    unsupported: not Linux, or a parameter off the CPU)."""
    params = list(module.parameters())  # shared (tied) parameters once
    if not sys.platform.startswith("linux") or not params or any(p.device.type != "cpu" for p in params):
        return 0
    for param, placed in zip(params, huge_page_tensors(params), strict=True):
        param.data = placed
    return sum((p.numel() * p.element_size() + _ALIGN - 1) // _ALIGN * _ALIGN for p in params)


def huge_page_tensors(like: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """New tensors of `like`'s shapes and dtypes (contents zero), views of one anonymous mapping advised for
    transparent huge pages (Linux; elsewhere, or where THP is off, ordinary pages of the same mapping)."""
    sizes = [(t.numel() * t.element_size() + _ALIGN - 1) // _ALIGN * _ALIGN for t in like]
    total = sum(sizes)
    buffer = mmap.mmap(-1, total + _HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    raw = torch.frombuffer(buffer, dtype=torch.uint8)  # the views below keep the mapping alive
    offset = -raw.data_ptr() % _HUGE_PAGE
    # THP may be off or absent (the call fails): the tensors then sit in ordinary pages of the same mapping
    if sys.platform.startswith("linux"):
        _madvise(raw.data_ptr() + offset, total, _MADV_HUGEPAGE)
    out = []
    for tensor, size in zip(like, sizes, strict=True):
        nbytes = tensor.numel() * tensor.element_size()
        out.append(raw[offset : offset + nbytes].view(tensor.dtype).view(tensor.shape))
        offset += size
    return out


def _madvise(address: int, length: int, advice: int) -> int:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return cast("int", libc.madvise(ctypes.c_void_p(address), ctypes.c_size_t(length), advice))
