"""Request bodies of hotswap's admin routes (vLLM's RL API) and of /tokenize and /detokenize.

They are lenient, as vLLM's and RL frameworks' clients need (TRL sends `is_checkpoint_format`, AReaL a
`pp_rank`): unknown fields are ignored, and logged once per body model and field."""

from __future__ import annotations

import logging
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, StrictInt, StrictStr, model_validator

logger = logging.getLogger(__name__)

_IGNORED_LOGGED: set[tuple[str, str]] = set()

# A weight version a client gives: a label or an integer (bools and floats are a 400 naming the field). The string
# form first, as in SGLang's models: Python reuses a union equal to one made before (whatever the order of its
# members), so one order for all makes the order of validation errors and schema alternatives stable.
VersionField = StrictStr | StrictInt | None


class _Body(BaseModel):
    """A body that ignores unknown fields, logging each (model, field) once (at most 256 logged in all)."""

    model_config = ConfigDict(extra="ignore")

    @model_validator(mode="before")
    @classmethod
    def _log_ignored(cls, data: Any) -> Any:
        if isinstance(data, dict):
            for key in sorted(set(data) - set(cls.model_fields))[:8]:
                if (cls.__name__, key) not in _IGNORED_LOGGED and len(_IGNORED_LOGGED) < 256:
                    _IGNORED_LOGGED.add((cls.__name__, key))
                    logger.info("ignoring field %r of a %s request (not used by hotswap)", key[:64], cls.__name__)
        return data


class ReloadBody(_Body):
    weights_path: str | None = None
    target: str = Field(default="model", pattern="^(model|draft|lora:.+)$")  # "lora:<name>": a loaded adapter
    weight_version: VersionField = None
    encoding: str | None = Field(default=None, pattern="^(full|overwrite|xor|sparse)$")  # a folder of deltas
    base_version: VersionField = None
    checksums: dict[str, str] | None = None


class InitBody(_Body):
    init_info: dict[str, Any]


class StartBody(_Body):
    target: str = Field(default="model", pattern="^(model|draft|all|lora:.+)$")  # "lora:<name>": a loaded adapter


class UpdateBody(_Body):
    update_info: dict[str, Any] | list[dict[str, Any]]  # vLLM: one per worker, or empty to repeat the last
    session_token: str | None = None


class TensorUpdateBody(_Body):
    """SGLang's /update_weights_from_tensor: `serialized_named_tensors`, one base64 pickle of shared-tensor handles per
    tensor-parallel rank (SGLang's MultiprocessingSerializer, or `CudaIpcSender.sglang_payload`), read only by
    hotswap.transfer.safe_pickle; `load_format` null ((name, tensor) pairs) or "flattened_bucket"; `flush_cache` is
    accepted (the prefix cache is always invalidated on a weight change); a delta's fields as on SGLang's other
    weight routes."""

    serialized_named_tensors: list[str] = Field(min_length=1)
    load_format: str | None = None
    flush_cache: bool = True
    abort_all_requests: bool = False
    weight_version: VersionField = None
    encoding: str | None = Field(default=None, pattern="^(full|overwrite|xor|sparse)$")
    base_version: VersionField = None
    checksums: dict[str, str] | None = None


class FinishBody(_Body):
    weight_version: VersionField = None  # a label (vLLM and SGLang send strings) or an integer
    session_token: str | None = None
    canary: dict[str, Any] | None = None  # probes scored before the commit (hotswap/engine/canary.py)


class RenameBody(_Body):
    """vLLM's and SGLang's /update_weight_version."""

    new_version: StrictInt | StrictStr
    abort_all_requests: bool = False  # SGLang defaults to true; here a rename never ends work unless asked


class AbortRequestsBody(_Body):
    request_ids: list[str] | None = None
    prefix: str | None = Field(default=None, min_length=1)  # every request whose id starts with it


class TokenizeBody(_Body):
    prompt: str | None = None
    messages: list[dict[str, Any]] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


class DetokenizeBody(_Body):
    tokens: list[int]


class AbortBody(_Body):
    session_token: str | None = None


class PauseBody(_Body):
    mode: str = Field(default="abort", pattern="^(abort|wait|keep)$")
    clear_cache: bool = True


class SleepBody(_Body):
    level: int = Field(default=1, ge=1, le=2)


class WakeBody(_Body):
    tags: list[str] | None = None


class RpcBody(_Body):
    method: str
    args: list[Any] = Field(default_factory=list)
    kwargs: dict[str, Any] = Field(default_factory=dict)
    timeout: float | None = None


class LoadLoRABody(_Body):
    """vLLM's /v1/load_lora_adapter. The name and path default to "" so that a missing one gets vLLM's message."""

    lora_name: str = ""
    lora_path: str = ""
    load_inplace: bool = False


class UnloadLoRABody(_Body):
    """vLLM's /v1/unload_lora_adapter (its `lora_int_id` is accepted and ignored: the name says which)."""

    lora_name: str = ""
    lora_int_id: int | None = None


class AddReplicasBody(_Body):
    """/fleet/add_replicas: how many replicas join the fleet."""

    n: StrictInt = Field(default=1, ge=1)


class RemoveReplicasBody(_Body):
    """/fleet/remove_replicas: `n` replicas (those down first, then the newest), or the ones `indices` names;
    their requests in flight get `drain_timeout_s` to finish."""

    n: StrictInt | None = Field(default=None, ge=1)
    indices: list[StrictInt] | None = None
    drain_timeout_s: float = Field(default=120.0, ge=0)
