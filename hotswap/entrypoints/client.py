"""The trainer's client for the server's admin API.

    client = AdminClient("http://127.0.0.1:8000", admin_key="...")
    version = client.push_weights(model.named_parameters(), backend="shm")   # pause, update, resume
    assert client.verify(model.named_parameters())                           # engine holds exactly these
    client.close()

`push_weights` runs a whole update session: it pauses generation (mode 'keep' by default, so requests in flight
continue on the new weights), sends the tensors over shared memory or torch.distributed, finishes (the server
advances the weight version) and resumes. On failure it aborts the session and resumes before re-raising. With
`target="lora:<name>"` the same session updates a loaded LoRA adapter (its next version; PEFT tensor names).

LoRA adapters: `load_lora_adapter` (a PEFT folder the server can read), `push_lora_adapter` (tensors from this
process, as base64 safetensors through SGLang's `/load_lora_adapter_from_tensors`), `unload_lora_adapter`.
"""

from __future__ import annotations

import base64
import threading
from collections.abc import Iterable
from typing import Any, cast

import httpx
import torch

from hotswap.transfer.shm import ShmSender
from hotswap.transfer.torch_dist import DEFAULT_BUCKET_BYTES, TorchDistSender
from hotswap.weights.checksum import tensor_sha256


class AdminError(RuntimeError):
    """The server refused an admin call; `status` is the HTTP status, the message is the server's."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"{status}: {message}")
        self.status = status


class AdminClient:
    def __init__(self, base_url: str, admin_key: str | None = None, timeout_s: float = 600.0) -> None:
        headers = {"Authorization": f"Bearer {admin_key}"} if admin_key else {}
        self.http = httpx.Client(base_url=base_url.rstrip("/"), headers=headers, timeout=timeout_s)
        self._backend: str | None = None
        self._shm: ShmSender | None = None
        self._dist: TorchDistSender | None = None

    # ---- plain calls ----------------------------------------------------------------------------------------

    def _call(self, method: str, path: str, body: dict[str, Any] | None = None) -> dict[str, Any]:
        return cast("dict[str, Any]", self._request(method, path, body).json())

    def _request(self, method: str, path: str, body: dict[str, Any] | None = None) -> httpx.Response:
        """The server's answer; AdminError (with the server's message) for a 4xx or 5xx."""
        response = self.http.request(method, path, json=body)
        if response.status_code >= 400:
            try:
                answer = response.json()
                message = answer["error"]["message"] if "error" in answer else answer["error_message"]
            except (ValueError, KeyError, TypeError):
                message = response.text
            raise AdminError(response.status_code, message)
        return response

    def reload_weights(self, weights_path: str | None = None, weight_version: int | str | None = None) -> str:
        """Reloads from a folder (None: the current one); returns the new version's label."""
        body = {"weights_path": weights_path, "weight_version": weight_version}
        return str(self._call("POST", "/reload_weights", body)["weight_version"])

    def pause(self, mode: str = "keep", clear_cache: bool = True) -> None:
        self._call("POST", "/pause", {"mode": mode, "clear_cache": clear_cache})

    def resume(self) -> None:
        self._call("POST", "/resume")

    def is_paused(self) -> bool:
        return cast("bool", self._call("GET", "/is_paused")["is_paused"])

    def get_weight_version(self) -> str:
        """The served version's label (its integer as a string when none was given)."""
        return str(self._call("GET", "/get_weight_version")["weight_version"])

    def checksums(self) -> dict[str, str]:
        """SHA-256 per checkpoint tensor name, as the engine holds it."""
        return cast("dict[str, str]", self._call("GET", "/weight_checksums")["checksums"])

    def sleep(self, level: int = 1) -> None:
        self._call("POST", "/sleep", {"level": level})

    def wake_up(self, tags: list[str] | None = None) -> None:
        self._call("POST", "/wake_up", {"tags": tags})

    def reset_prefix_cache(self) -> None:
        self._call("POST", "/reset_prefix_cache")

    # ---- LoRA adapters -----------------------------------------------------------------------------------------

    def load_lora_adapter(self, lora_name: str, lora_path: str, load_inplace: bool = False) -> None:
        """Loads the PEFT folder `lora_path` (read by the server) as adapter `lora_name`; with `load_inplace`, as
        the next version of a loaded one. Requests then name it as their `model`."""
        self._request(
            "POST",
            "/v1/load_lora_adapter",
            {"lora_name": lora_name, "lora_path": lora_path, "load_inplace": load_inplace},
        )

    def push_lora_adapter(
        self,
        lora_name: str,
        named_tensors: Iterable[tuple[str, torch.Tensor]],
        peft_config: dict[str, Any],
        upsert: bool = False,
        pinned: bool = False,
    ) -> dict[str, str]:
        """Loads adapter `lora_name` from this process's tensors (PEFT names, e.g. a PeftModel's lora_A / lora_B
        state) and `peft_config` (adapter_config.json's fields), sent in the request body as safetensors bytes (so
        the server's --max-request-bytes bounds the adapter's size); `upsert` replaces a loaded adapter's weights.
        Returns the loaded adapters, name -> path ("__tensor__" for those loaded from tensors)."""
        from safetensors.torch import save

        tensors = {name: t.detach().cpu().contiguous() for name, t in named_tensors}
        body = {
            "lora_name": lora_name,
            "config_dict": peft_config,
            "upsert": upsert,
            "pinned": pinned,
            "serialized_named_tensors": [base64.b64encode(save(tensors)).decode("ascii")],
        }
        return cast("dict[str, str]", self._call("POST", "/load_lora_adapter_from_tensors", body)["loaded_adapters"])

    def unload_lora_adapter(self, lora_name: str) -> None:
        self._request("POST", "/v1/unload_lora_adapter", {"lora_name": lora_name})

    # ---- a whole update session ------------------------------------------------------------------------------

    def push_weights(
        self,
        named_tensors: Iterable[tuple[str, torch.Tensor]],
        backend: str = "shm",
        pause_mode: str | None = "keep",
        weight_version: int | str | None = None,
        master_address: str = "127.0.0.1",
        master_port: int | None = None,
        bucket_size_bytes: int = DEFAULT_BUCKET_BYTES,
        delta: dict[str, Any] | None = None,
        canary: dict[str, Any] | None = None,
        target: str = "model",
    ) -> str:
        """Sends the tensors to the engine in one session and returns the new version's label (`weight_version`
        if given: an integer or a label; else the next integer, as a string). `backend` is
        "shm" (same host) or "torch_dist" (give `master_port` on first use; this process hosts the rendezvous).
        `pause_mode` None skips pausing (the server refuses if requests are in flight). `delta`: the update_info
        fields of a delta (`DeltaEncoder.encode`'s second result: encoding, base_version, checksums); `canary`:
        probes the engine scores before it commits (hotswap/engine/canary.py). `target` "lora:<name>" updates a
        loaded LoRA adapter instead (PEFT tensor names; the model's version, returned, stays)."""
        named = [(name, t.detach().cpu()) for name, t in named_tensors]
        self._connect(backend, master_address, master_port, bucket_size_bytes)
        if pause_mode is not None:
            self.pause(pause_mode)
        try:
            token = self._call("POST", "/start_weight_update", {"target": target})["session_token"]
            try:
                self._send(backend, named, token, delta or {})
                body = {
                    "weight_version": weight_version,
                    "session_token": token,
                    **({"canary": canary} if canary is not None else {}),
                }
                return str(self._call("POST", "/finish_weight_update", body)["weight_version"])
            except BaseException:
                try:
                    self._call("POST", "/abort_weight_update", {"session_token": token})  # ours only
                except AdminError:
                    pass  # the failed update already ended the session
                if backend == "torch_dist":
                    self._backend, self._dist = None, None  # the server closed the channel; reconnect next time
                raise
        finally:
            if pause_mode is not None:
                self.resume()

    def _connect(self, backend: str, address: str, port: int | None, bucket_size: int) -> None:
        if backend not in ("shm", "torch_dist"):
            raise ValueError(f"backend must be 'shm' or 'torch_dist', got {backend!r}")
        if self._backend == backend:
            return
        if self._dist is not None:  # the engine's new transport replaces the group: this end of it goes too
            self._dist.close()
            self._dist = None
        if backend == "shm":
            self._shm = self._shm or ShmSender()
            self._call("POST", "/init_weight_transfer_engine", {"init_info": {"backend": "shm"}})
        else:
            if port is None:
                raise ValueError("torch_dist needs master_port (a free port on this host)")
            init = {"backend": "torch_dist", "master_address": address, "master_port": port}
            errors: list[BaseException] = []
            workers = self._call("GET", "/get_world_size")["world_size"]

            def post() -> None:
                try:
                    self._call("POST", "/init_weight_transfer_engine", {"init_info": init})
                except BaseException as err:
                    errors.append(err)

            thread = threading.Thread(target=post)
            thread.start()
            try:
                # blocks until every engine worker has joined
                self._dist = TorchDistSender(address, port, bucket_size, num_workers=workers)
            finally:
                thread.join()
            if errors:
                raise errors[0]
        self._backend = backend

    def _send(self, backend: str, named: list[tuple[str, torch.Tensor]], token: str, extra: dict[str, Any]) -> None:
        if backend == "shm":
            assert self._shm is not None
            info = {**self._shm.write(named), **extra}
            self._call("POST", "/update_weights", {"update_info": info, "session_token": token})
            return
        assert self._dist is not None
        info = {**self._dist.update_info(named), **extra}
        errors: list[BaseException] = []

        def post() -> None:
            try:
                self._call("POST", "/update_weights", {"update_info": info, "session_token": token})
            except BaseException as err:
                errors.append(err)

        thread = threading.Thread(target=post)
        thread.start()
        try:
            self._dist.send(named)
        finally:
            thread.join()
        if errors:
            raise errors[0]

    def verify(self, named_tensors: Iterable[tuple[str, torch.Tensor]], dtype: torch.dtype | None = None) -> list[str]:
        """Names whose engine checksum differs from the trainer's tensor (cast to `dtype`, the engine's weight
        dtype, when given). An empty list means the engine holds exactly these tensors."""
        remote = self.checksums()
        return [name for name, t in named_tensors if name in remote and remote[name] != tensor_sha256(t, dtype)] + [
            name for name, _ in named_tensors if name not in remote
        ]

    def close(self) -> None:
        """Releases the transport (server side and this process's shared memory) and the HTTP connection."""
        if self._backend is not None:
            try:
                self._call("POST", "/shutdown_weight_transfer_engine")
            except (AdminError, httpx.HTTPError):
                pass  # the server may be gone already
        if self._shm is not None:
            self._shm.close()
        if self._dist is not None:
            self._dist.close()
        self._backend = None
        self.http.close()
