"""Tensor-parallel workers in their own processes, forming a torch.distributed group (gloo on CPU).

Workers are started as `python -m hotswap.executor.multiproc` (so the caller's script is never re-imported and
needs no `__main__` guard) and connect back over an authenticated local socket. Each runs a loop: receive
(method, args, kwargs), run it on its Worker, send the result or the exception back. Every call goes to all
workers; results come back in rank order.
- A worker that dies, or a call that outlives `timeout`, makes that call raise; the executor is then broken (the
  group may be out of step) and every later call raises at once. Shutting down stops the remaining workers.
- Workers exit when the parent's end of their pipe closes, so no worker outlives the engine's process, even if
  that process is killed.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import signal
import subprocess
import sys
import time
import weakref
from multiprocessing.connection import Client, Connection, Listener
from typing import Any

import cloudpickle

from hotswap.config import EngineConfig
from hotswap.executor.base import Executor, RpcMethod
from hotswap.kernels import policy as kernel_policy

_POLL_S = 0.05


def _worker_main(conn: Connection) -> None:
    import torch
    from torch._C._distributed_c10d import TCPStore
    from torch.distributed import ProcessGroupGloo

    from hotswap.distributed import ParallelContext
    from hotswap.transfer.base import interrupt_waits
    from hotswap.worker.worker import Worker

    signal.signal(signal.SIGUSR1, lambda *_: interrupt_waits())  # see MultiprocExecutor.interrupt_waits
    config, rank, size, port = cloudpickle.loads(conn.recv_bytes())
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // size))
    timeout = datetime.timedelta(seconds=config.parallel_config.rpc_timeout_s)
    if rank == 0:  # hosts the group's store on a port the OS picks (port 0), and tells the engine which
        store = TCPStore("127.0.0.1", 0, world_size=size, is_master=True, timeout=timeout, wait_for_workers=False)
        conn.send_bytes(cloudpickle.dumps(("store", store.port)))
    else:
        store = TCPStore("127.0.0.1", port, world_size=size, is_master=False, timeout=timeout)
    group = ProcessGroupGloo(store, rank, size, timeout)
    worker = Worker(config, rank, ParallelContext(rank, size, group))
    conn.send_bytes(cloudpickle.dumps(("ok", os.getpid())))
    while True:
        try:
            message = conn.recv_bytes()
        except (EOFError, OSError):
            break  # the engine is gone
        call = cloudpickle.loads(message)
        if call is None:
            break
        method, args, kwargs = call
        try:
            reply = ("ok", worker.execute_method(method, *args, **kwargs))
        except BaseException as err:  # sent to the engine, which re-raises it
            reply = ("error", err)
        try:
            conn.send_bytes(cloudpickle.dumps(reply))
        except Exception as err:  # an unpicklable result or exception
            conn.send_bytes(cloudpickle.dumps(("error", RuntimeError(f"worker {rank}: {reply[1]!r} ({err})"))))
    conn.close()
    os._exit(0)  # skip interpreter teardown: the process group's threads must not be destroyed while running


class MultiprocExecutor(Executor):
    def __init__(self, config: EngineConfig) -> None:
        super().__init__(config)
        # build and calibrate the kernels (if not cached) once here, before the workers would each wait for it
        kernel_policy.prepare(config.model_config.hf_config, config.model_config.torch_dtype)
        size = config.parallel_config.tensor_parallel_size
        port = 0  # the store's, known once rank 0 listens (no port is picked here and bound later by another process)
        authkey = os.urandom(32)
        self.processes: list[subprocess.Popen[bytes]] = []
        self.conns: list[Connection] = []
        self.broken: str | None = None
        with Listener(("127.0.0.1", 0), authkey=authkey) as listener:
            host, listen_port = listener.address
            env = {**os.environ, "HOTSWAP_WORKER_AUTHKEY": authkey.hex()}
            for _ in range(size):
                self.processes.append(
                    subprocess.Popen(
                        [sys.executable, "-m", "hotswap.executor.multiproc", host, str(listen_port)], env=env
                    )
                )
            self._finalizer = weakref.finalize(self, _stop, self.processes, self.conns)
            listener._listener._socket.settimeout(config.parallel_config.rpc_timeout_s)  # type: ignore[attr-defined]
            for rank in range(size):
                conn = listener.accept()
                conn.send_bytes(cloudpickle.dumps((config, rank, size, port)))
                self.conns.append(conn)
                if rank == 0:
                    port = self._store_port(conn, config.parallel_config.rpc_timeout_s)
        self._gather(config.parallel_config.rpc_timeout_s, "start")

    def collective_rpc(
        self,
        method: RpcMethod,
        args: tuple[object, ...] = (),
        kwargs: dict[str, object] | None = None,
        timeout: float | None = None,
    ) -> list[Any]:
        if self.broken:
            raise RuntimeError(f"the tensor-parallel workers are unusable ({self.broken}); create a new LLM")
        payload = cloudpickle.dumps((method, args, kwargs or {}))
        for rank, conn in enumerate(self.conns):
            try:
                conn.send_bytes(payload)
            except OSError:
                self._break(f"worker {rank} is gone")
        name = method if isinstance(method, str) else getattr(method, "__name__", "callable")
        return self._gather(timeout or self.config.parallel_config.rpc_timeout_s, name)

    def _gather(self, timeout: float, name: str) -> list[Any]:
        deadline = time.monotonic() + timeout
        results: list[Any] = [None] * len(self.conns)
        errors: list[BaseException] = []
        for rank, (conn, proc) in enumerate(zip(self.conns, self.processes, strict=True)):
            while not conn.poll(_POLL_S):
                if proc.poll() is not None:
                    self._break(f"worker {rank} (pid {proc.pid}) died with exit code {proc.returncode} during {name}()")
                if time.monotonic() > deadline:  # out of step: no worker is expected to answer, stop them at once
                    self._break(f"{name}() timed out after {timeout:.0f} s waiting for worker {rank}", grace_s=0.5)
            try:
                status, value = cloudpickle.loads(conn.recv_bytes())
            except (EOFError, OSError):
                self._break(f"worker {rank} (pid {proc.pid}) died during {name}()")
            if status == "error":
                errors.append(value)
            else:
                results[rank] = value
        if errors:
            raise errors[0]
        return results

    def _store_port(self, conn: Connection, timeout: float) -> int:
        """The port rank 0's store listens on, as it reports it. Stops the workers and raises if it does not."""
        deadline = time.monotonic() + timeout
        while not conn.poll(_POLL_S):
            dead = [proc.pid for proc in self.processes if proc.poll() is not None]
            if dead or time.monotonic() > deadline:
                why = f"worker pid {dead[0]} died" if dead else f"no answer within {timeout:g} s"
                self._break(f"rank 0 did not start the group's store ({why})")
        kind, port = cloudpickle.loads(conn.recv_bytes())
        assert kind == "store", kind
        return int(port)

    def _break(self, reason: str, grace_s: float = 5.0) -> None:
        self.broken = reason
        _stop(self.processes, self.conns, grace_s)
        raise RuntimeError(f"{reason}; the workers were stopped, create a new LLM")

    def interrupt_waits(self) -> None:
        for proc in self.processes:  # each worker's SIGUSR1 handler counts it (see transfer.base)
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):  # it exited meanwhile
                    os.kill(proc.pid, signal.SIGUSR1)

    def health_problem(self) -> str | None:
        if self.broken:
            return self.broken
        for rank, proc in enumerate(self.processes):
            if proc.poll() is not None:
                return f"worker {rank} (pid {proc.pid}) exited with code {proc.returncode}"
        return None

    def shutdown(self) -> None:
        self._finalizer()


def _stop(processes: list[subprocess.Popen[bytes]], conns: list[Connection], grace_s: float = 5.0) -> None:
    """Asks workers to exit, then terminates the ones that do not within `grace_s`, then kills those that still
    do not (a stopped or hung worker)."""
    for conn in conns:
        try:
            conn.send_bytes(cloudpickle.dumps(None))
        except OSError:
            pass
    for proc in processes:
        try:
            proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            proc.terminate()
            try:
                proc.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
    for conn in conns:
        conn.close()


if __name__ == "__main__":
    _worker_main(Client((sys.argv[1], int(sys.argv[2])), authkey=bytes.fromhex(os.environ["HOTSWAP_WORKER_AUTHKEY"])))
