"""Routing replay and sampling masks on the wire, in vLLM's and SGLang's shapes.

vLLM (completions and chat choices): `routed_experts` is a base64 `.npy` file of the [tokens - 1, sparse layers,
top_k] array (decoded with `np.load(io.BytesIO(base64.b64decode(s)))`); `sampling_mask` a list with one entry per
generated token: its kept token ids, or null where the whole vocabulary was kept. SGLang (`/generate`'s
`meta_info`): `routed_experts` base64 of the int32 rows from `routed_experts_start_len` on, flattened;
`top_p_token_ids` / `top_p_token_offsets` the kept ids in CSR form (token i's are ids[offsets[i]:offsets[i+1]]),
with `top_p_token_full` marking the tokens whose empty span means the whole vocabulary.

Requests may force routes (`forced_routed_experts`) as nested lists [tokens, layers, top_k] or as the base64 `.npy`
string vLLM's responses carry.
"""

from __future__ import annotations

import base64
import binascii
import io
from typing import Any

import numpy as np

from hotswap.outputs import SamplingMask
from hotswap.sampling_params import forced_routes_array


def npy_base64(array: np.ndarray) -> str:
    """vLLM's `routed_experts` string: a `.npy` file, base64."""
    buffer = io.BytesIO()
    np.save(buffer, array, allow_pickle=False)
    return base64.b64encode(buffer.getvalue()).decode("ascii")


def int32_base64(array: np.ndarray) -> str:
    """SGLang's `routed_experts`: the rows as flat int32, base64."""
    return base64.b64encode(np.ascontiguousarray(array, dtype=np.int32).tobytes()).decode("ascii")


def forced_routes(value: Any) -> np.ndarray | None:
    """A request's `forced_routed_experts`: nested lists, or a base64 `.npy` string. Raises ValueError."""
    if value is None:
        return None
    if isinstance(value, str):
        try:
            value = np.load(io.BytesIO(base64.b64decode(value, validate=True)), allow_pickle=False)
        except (binascii.Error, ValueError, OSError) as err:
            raise ValueError(f"forced_routed_experts: not a base64 .npy array ({err})") from None
    return forced_routes_array(value)


def mask_lists(mask: SamplingMask) -> list[list[int] | None]:
    """vLLM's `sampling_mask`: per generated token, its kept ids or None (the whole vocabulary)."""
    return [mask.row(i) for i in range(len(mask.full))]


def sglang_mask(mask: SamplingMask) -> dict[str, Any]:
    return {"top_p_token_ids": mask.token_ids, "top_p_token_offsets": mask.offsets, "top_p_token_full": mask.full}
