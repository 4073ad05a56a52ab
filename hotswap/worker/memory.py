"""Returning memory to the operating system without moving tensors."""

from __future__ import annotations

import ctypes
import mmap
import sys

import torch

_MADV_DONTNEED = 4


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
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    if libc.madvise(ctypes.c_void_p(first), ctypes.c_size_t(last - first), _MADV_DONTNEED) != 0:
        return 0
    return last - first
