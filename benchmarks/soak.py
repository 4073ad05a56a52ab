"""A soak: `hotswap serve` (or a fleet of replicas behind one endpoint) under RL-shaped mixed load for a set time.

Clients, each in its own thread, send one request after another: OpenAI completions streamed and not, with `n` up to
8, SGLang `/generate` (streamed, single and batched), all at temperature 1; about one in five goes away on purpose
at a random point (a stream closed after a few chunks, a whole-response request given up by a short read timeout).
Meanwhile a trainer, every few seconds, does one thing of a fixed rotation: a full update over shm or torch_dist, a
partial update (a few tensors), an update that must fail (a wrong shape, a NaN), a trainer process killed at a
random point of its torch_dist push, a pause in each mode ('abort', 'wait', 'keep') then resume, sleep (level 1 or
2) then wake (level 2: a full update restores the weights), a prefix-cache reset. After every committed update the
server's checksums must equal the trainer's tensors; after every failed one they must be unchanged.

A request is *served* when it ends with every sample finished ('length' or 'stop') and, for the OpenAI routes, its
version spans cover its tokens. Expected non-successes are counted apart: a disconnect on purpose, 'abort' for a
request alive during an 'abort' pause, and a 503 with Retry-After while the trainer holds generation in an
'abort'/'wait' pause or asleep (vLLM's answer; the client waits and retries). Anything else is *lost*; an HTTP 5xx
outside those windows is counted as `unexpected_5xx`. The server's log is scanned for tracebacks and ERROR lines.
The server's process tree (the replicas' Ray workers included) is sampled for RSS and open file descriptors.

    python -m benchmarks.soak [--minutes 30] [--replicas 1] [--clients 6] [--preset tiny] [--update-every 3]

Prints progress, a summary, and a final JSON line.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import torch
from safetensors.torch import load_file

from hotswap.entrypoints.client import AdminClient, AdminError
from hotswap.testing import free_port, make_tiny_model, running_server

Named = list[tuple[str, torch.Tensor]]


@contextlib.contextmanager
def serving(model: Path, log: Path, replicas: int = 1, admin_key: str = "k") -> Iterator[tuple[str, int]]:
    """`hotswap serve` of `model` (a fleet of `replicas` on a local Ray when above 1), its output in `log`;
    yields (base URL, pid)."""
    args = [
        "--admin-key",
        admin_key,
        "--served-model-name",
        "m",
        "--kv-cache-memory-bytes",
        str(1 << 23),
        "--log-level",
        "info",
    ]
    if replicas > 1:
        args += ["--data-parallel-size", str(replicas), "--num-gpus-per-worker", "0"]
    with running_server(model, *args, log=log) as (base, proc):
        yield base, proc.pid


# ---- the process tree's memory and file descriptors ----------------------------------------------------------


def process_tree(root: int) -> list[int]:
    """`root` and every process descended from it (read from /proc)."""
    parents: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            with contextlib.suppress(OSError):
                with open(f"/proc/{entry}/stat") as f:
                    parents[int(entry)] = int(f.read().rsplit(")", 1)[1].split()[1])
    tree, frontier = [root], [root]
    while frontier:
        children = [pid for pid, parent in parents.items() if parent in frontier]
        tree += children
        frontier = children
    return tree


def processes(root: int) -> dict[int, tuple[str, int, int]]:
    """(a short command line, resident bytes, open file descriptors) per process of `root`'s tree, by pid."""
    out = {}
    for pid in process_tree(root):
        with contextlib.suppress(OSError):
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                words = [w.decode(errors="replace") for w in f.read().split(b"\0") if w]
            with open(f"/proc/{pid}/statm") as f:
                rss = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
            name = " ".join(Path(w).name if i == 0 else w for i, w in enumerate(words[:3]))[:60]
            out[pid] = (name, rss, len(os.listdir(f"/proc/{pid}/fd")))
    return out


def totals(tree: dict[int, tuple[str, int, int]]) -> tuple[int, int]:
    """Resident bytes and open file descriptors summed over a `processes` result."""
    return sum(rss for _, rss, _ in tree.values()), sum(fds for _, _, fds in tree.values())


# ---- clients -------------------------------------------------------------------------------------------------


@dataclass
class Outcome:
    """One request as its client saw it. `kind`: served, disconnected, abort, refused (503 + Retry-After), error
    (anything else); `status`: the HTTP status where one came."""

    route: str
    start: float
    end: float
    kind: str
    status: int | None = None
    detail: str = ""


def valid_spans(spans: list[list[Any]], tokens: int) -> bool:
    """Version spans cover [0, tokens) in order, without gaps, with versions (integers as strings) going up."""
    position, version = 0, -1
    for label, start, end in spans:
        v = int(label)
        if start != position or end <= start or v <= version:
            return False
        position, version = end, v
    return position == tokens


def check_choices(choices: list[dict[str, Any]], max_tokens: int) -> str:
    """Why these completion choices are not a served request ('' if they are)."""
    for choice in choices:
        finish = choice.get("finish_reason")
        if finish == "abort":
            return "abort"
        if finish not in ("length", "stop"):
            return f"finish_reason {finish!r}"
        spans = choice.get("weight_versions")
        if finish == "length" and (spans is None or not valid_spans(spans, max_tokens)):
            return f"version spans {spans} for {max_tokens} tokens"
    return ""


def completion(http: httpx.Client, rng: random.Random, stream: bool) -> tuple[str, int | None, str]:
    """One OpenAI completion; returns (kind, status, detail)."""
    n = rng.choice([1, 1, 2, 4, 8])
    max_tokens = rng.randint(4, 48)
    body = {
        "model": "m",
        "prompt": f"count {rng.randint(0, 999)} and {rng.randint(0, 99)}",
        "n": n,
        "max_tokens": max_tokens,
        "temperature": 1.0,
        "ignore_eos": True,
        "stream": stream,
    }
    leave = rng.random() < 0.2
    if not stream:
        timeout = httpx.Timeout(120, read=rng.uniform(0.05, 0.6)) if leave else 120
        try:
            response = http.post("/v1/completions", json=body, timeout=timeout)
        except httpx.ReadTimeout:
            return ("disconnected", None, "") if leave else ("error", None, "read timeout")
        return classify(response, lambda: check_choices(response.json()["choices"], max_tokens))
    chunks_before_leaving = rng.randint(0, 6) if leave else -1
    choices: dict[int, dict[str, Any]] = {}
    with http.stream("POST", "/v1/completions", json=body, timeout=120) as response:
        if response.status_code != 200:
            response.read()
            return classify(response, lambda: "")
        seen = 0
        for line in response.iter_lines():
            if not line.startswith("data: {"):
                continue
            if seen == chunks_before_leaving:
                return "disconnected", 200, ""  # leaving the block closes the connection mid-stream
            seen += 1
            for choice in json.loads(line[6:])["choices"]:
                merged = choices.setdefault(choice["index"], {})
                merged["finish_reason"] = choice.get("finish_reason") or merged.get("finish_reason")
                merged["weight_versions"] = choice.get("weight_versions", merged.get("weight_versions"))
    if leave:
        return "disconnected", 200, "finished before leaving"
    if len(choices) != n:
        return "error", 200, f"{len(choices)} of {n} samples"
    problem = check_choices(list(choices.values()), max_tokens)
    return ("served", 200, "") if not problem else ("abort" if problem == "abort" else "error", 200, problem)


def sglang_generate(http: httpx.Client, rng: random.Random) -> tuple[str, int | None, str]:
    """One SGLang /generate: a single prompt streamed, or a batch of 1-4 prompts; returns (kind, status, detail)."""
    params = {"max_new_tokens": rng.randint(4, 32), "temperature": 1.0, "ignore_eos": True}
    stream = rng.random() < 0.5
    text: Any = "count" if stream else [f"count {i}" for i in range(rng.randint(1, 4))]
    body = {"text": text, "sampling_params": params, "stream": stream}
    if not stream:
        response = http.post("/generate", json=body, timeout=120)

        def problem() -> str:
            finishes = [(r["meta_info"]["finish_reason"] or {}).get("type") for r in response.json()]
            return (
                ""
                if all(f in ("length", "stop") for f in finishes)
                else ("abort" if "abort" in finishes else f"finish {finishes}")
            )

        return classify(response, problem)
    finish = None
    with http.stream("POST", "/generate", json=body, timeout=120) as response:
        if response.status_code != 200:
            response.read()
            return classify(response, lambda: "")
        for line in response.iter_lines():
            if line.startswith("data: {"):
                finish = (json.loads(line[6:])["meta_info"]["finish_reason"] or {}).get("type", finish)
    if finish in ("length", "stop"):
        return "served", 200, ""
    return ("abort" if finish == "abort" else "error"), 200, f"finish {finish}"


def classify(response: httpx.Response, problem: Any) -> tuple[str, int | None, str]:
    """(kind, status, detail) of a whole response; `problem()` says what is wrong with a 200's body."""
    status = response.status_code
    if status == 200:
        why = problem()
        return ("served", status, "") if not why else ("abort" if why == "abort" else "error", status, why)
    if status == 503 and "retry-after" in response.headers:
        return "refused", status, response.text[:200]
    return "error", status, response.text[:300]


def client_loop(base: str, seed: int, stop: threading.Event, outcomes: list[Outcome], lock: threading.Lock) -> None:
    rng = random.Random(seed)
    with httpx.Client(base_url=base) as http:
        while not stop.is_set():
            route = rng.choice(["stream", "stream", "whole", "whole", "sglang"])
            start = time.monotonic()
            try:
                if route == "sglang":
                    kind, status, detail = sglang_generate(http, rng)
                else:
                    kind, status, detail = completion(http, rng, stream=route == "stream")
            except Exception as err:  # a lost request
                kind, status, detail = "error", None, repr(err)[:300]
            with lock:
                outcomes.append(Outcome(route, start, time.monotonic(), kind, status, detail))
            if kind == "refused":
                time.sleep(rng.uniform(0.2, 1.0))  # Retry-After, shortened: the trainer's holds are short


# ---- the trainer ---------------------------------------------------------------------------------------------


KILLED_TRAINER = """
import os, sys, threading, time
from safetensors.torch import load_file
from hotswap.entrypoints.client import AdminClient
base, path, port, how = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
admin = AdminClient(base, admin_key="k")
named = list(load_file(path).items())
print("ready", flush=True)
if how == "anywhere":  # the parent kills this process at a random moment of a whole push
    admin.push_weights(named, backend="torch_dist", master_port=port, bucket_size_bytes=1 << 12)
    time.sleep(60)
else:  # dies mid-stream: the engine is receiving, half the buckets came
    admin._connect("torch_dist", "127.0.0.1", port, 1 << 12)
    admin.pause("keep")
    token = admin._call("POST", "/start_weight_update", {"target": "model"})["session_token"]
    info = admin._dist.update_info(named)
    body = {"update_info": info, "session_token": token}
    threading.Thread(target=admin._call, args=("POST", "/update_weights", body), daemon=True).start()
    time.sleep(0.3)
    admin._dist.send(named[: len(named) // 2])
    os._exit(1)
"""


@dataclass
class Trainer:
    """Runs the rotation of weight and control actions against the server; `expected` is what the engine must
    hold; `windows` the (start, end, kind) of each hold that may refuse or abort requests."""

    base: str
    checkpoints: dict[str, Path]
    replicas: int
    expected: dict[str, torch.Tensor] = field(default_factory=dict)
    windows: list[tuple[float, float, str]] = field(default_factory=list)
    counts: dict[str, int] = field(default_factory=dict)
    mismatches: list[str] = field(default_factory=list)
    update_seconds: list[float] = field(default_factory=list)
    rng: random.Random = field(default_factory=lambda: random.Random(7))

    ROTATION = (
        "full_shm",
        "partial_shm",
        "bad_shape",
        "full_dist",
        "pause_abort",
        "partial_dist",
        "nan",
        "pause_wait",
        "killed_trainer",
        "pause_keep",
        "sleep",
        "reset_cache",
    )

    def __post_init__(self) -> None:
        self.named = {k: list(load_file(str(p / "model.safetensors")).items()) for k, p in self.checkpoints.items()}
        self.expected = dict(self.named["A"])
        self.admin = AdminClient(self.base, admin_key="k")

    def count(self, what: str) -> None:
        self.counts[what] = self.counts.get(what, 0) + 1

    def verify(self, after: str) -> None:
        """The engine must hold `expected`, bit for bit, and (a fleet) every replica the same version."""
        wrong = self.admin.verify(list(self.expected.items()))
        if wrong:
            self.mismatches.append(f"after {after}: {wrong[:3]}")
        if self.replicas > 1:
            state = self.admin.http.get("/fleet_status").json()["replicas"]
            if len({r["weight_version"] for r in state}) != 1 or not all(r["routable"] for r in state):
                self.mismatches.append(f"after {after}: replicas uneven {state}")

    def push(self, named: Named, backend: str, what: str) -> None:
        start = time.monotonic()
        self.admin.push_weights(named, backend=backend, master_port=free_port())  # the port: a new group only
        self.update_seconds.append(time.monotonic() - start)
        self.expected.update(named)
        self.count(what)
        self.verify(what)

    def other(self) -> Named:
        """The checkpoint the engine does not hold now (its first tensor tells)."""
        name, tensor = self.named["A"][0]
        return self.named["B"] if torch.equal(self.expected[name], tensor) else self.named["A"]

    def partial(self) -> Named:
        """A few tensors (one layer's worth) taken from the other checkpoint."""
        source = self.other()
        layer = self.rng.randrange(2)
        return [(n, t) for n, t in source if f"layers.{layer}." in n][: self.rng.randint(1, 6)]

    def refused(self, named: Named, what: str) -> None:
        try:
            self.admin.push_weights(named, backend="shm")
        except AdminError as err:
            if err.status == 400:
                self.count(what)
            else:
                self.mismatches.append(f"{what}: HTTP {err.status} {err}")
        else:
            self.mismatches.append(f"{what}: committed")
        self.verify(what)

    def hold(self, kind: str, body: Any) -> None:
        start = time.monotonic()
        try:
            body()
        finally:
            self.windows.append((start, time.monotonic(), kind))

    def act(self, action: str) -> None:
        admin = self.admin
        if action == "full_shm":
            self.push(self.other(), "shm", action)
        elif action == "full_dist":
            self.push(self.other(), "torch_dist", action)
        elif action == "partial_shm":
            self.push(self.partial(), "shm", action)
        elif action == "partial_dist":
            self.push(self.partial(), "torch_dist", action)
        elif action == "bad_shape":
            name, tensor = self.other()[0]
            self.refused([(name, tensor[:1])], action)
        elif action == "nan":
            name, tensor = self.other()[1]
            bad = tensor.clone()
            bad.view(-1)[self.rng.randrange(bad.numel())] = float("nan")
            self.refused([(name, bad)], action)
        elif action.startswith("pause_"):
            mode = action.removeprefix("pause_")

            def pause() -> None:
                admin.pause(mode)
                try:
                    time.sleep(self.rng.uniform(0.2, 1.0))
                finally:
                    admin.resume()

            self.hold(mode, pause)
            self.count(action)
        elif action == "sleep":
            level = 1 + self.counts.get(action, 0) % 2

            def sleep() -> None:
                admin.pause("wait")  # requests that had started finish; queued ones are held through the sleep
                try:
                    admin.sleep(level)
                    time.sleep(0.3)
                    admin.wake_up()
                    if level == 2:  # the weights' memory was returned: a full update restores them
                        admin.push_weights(list(self.expected.items()), backend="shm", pause_mode=None)
                finally:
                    admin.resume()

            self.hold("sleep", sleep)
            self.count(action)
            self.verify(f"sleep level {level}")
        elif action == "reset_cache":
            admin.reset_prefix_cache()
            self.count(action)
        elif action == "killed_trainer":
            self.killed_trainer()
        else:  # pragma: no cover - the rotation names only the actions above
            raise ValueError(action)

    def killed_trainer(self) -> None:
        """A trainer process pushing the other checkpoint over torch_dist that dies: killed at a random moment, or
        (every other time) exiting mid-stream with half its buckets sent; then what a supervisor does: abort
        whatever session it left, resume if it left generation paused. The engine holds either the old weights or
        (had it committed) the new ones, never a mix."""
        source = "B" if self.other() is self.named["B"] else "A"
        before = self.admin.get_weight_version()
        self.admin.close()  # its torch_dist group would be replaced by the other trainer's
        how = "anywhere" if self.counts.get("killed_trainer", 0) % 2 else "mid-stream"
        self.count("killed_trainer")
        proc = subprocess.Popen(
            [
                sys.executable,
                "-c",
                KILLED_TRAINER,
                self.base,
                str(self.checkpoints[source] / "model.safetensors"),
                str(free_port()),
                how,
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
        )
        assert proc.stdout is not None
        proc.stdout.readline()  # imported and loaded: the push starts now
        start = time.monotonic()
        try:
            proc.wait(timeout=self.rng.uniform(0.05, 1.5) if how == "anywhere" else 60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        self.admin = AdminClient(self.base, admin_key="k")
        try:
            self.admin._call("POST", "/abort_weight_update")
            if self.admin.is_paused():
                self.admin.resume()
        finally:
            self.windows.append((start, time.monotonic(), "keep"))
        if self.admin.get_weight_version() != before:
            self.expected.update(self.named[source])
            self.count("killed_trainer_committed")
        else:
            self.count("killed_trainer_rolled_back")
        self.verify("a killed trainer")

    def run(self, stop: threading.Event, every_s: float) -> None:
        i = 0
        while not stop.wait(self.rng.uniform(0.5, 1.5) * every_s):
            action = self.ROTATION[i % len(self.ROTATION)]
            i += 1
            try:
                self.act(action)
            except Exception as err:
                self.mismatches.append(f"{action} raised {err!r}"[:400])


# ---- the soak ------------------------------------------------------------------------------------------------


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


def explained(outcome: Outcome, windows: list[tuple[float, float, str]], kinds: tuple[str, ...]) -> bool:
    """Whether the request overlapped a trainer hold of one of `kinds` (with a second of slack either side)."""
    return any(s - 1.0 <= outcome.end and outcome.start <= e + 1.0 for s, e, k in windows if k in kinds)


def soak(
    checkpoints: dict[str, Path],
    minutes: float,
    replicas: int = 1,
    clients: int = 6,
    update_every_s: float = 3.0,
    sample_every_s: float = 10.0,
    log: Path | None = None,
    progress: bool = True,
) -> dict[str, Any]:
    """Runs the soak for `minutes` against a server of checkpoint A (pushing A and B); returns the figures."""
    log = log or Path(tempfile.mkdtemp()) / "server.log"
    seconds = minutes * 60
    with serving(checkpoints["A"], log, replicas) as (base, pid):
        trainer = Trainer(base, checkpoints, replicas)

        def warm(route: str, body: dict[str, Any]) -> None:
            httpx.post(f"{base}{route}", json=body, timeout=120).raise_for_status()

        # as many requests at once as there will be clients, on both routes: the connection pools (the fleet
        # router's to its replicas, Ray's between processes) reach their working size before the first sample
        with ThreadPoolExecutor(2 * clients) as pool:
            list(
                pool.map(
                    lambda i: warm(
                        *(
                            ("/v1/completions", {"model": "m", "prompt": "hi", "max_tokens": 4})
                            if i % 2
                            else ("/generate", {"text": "hi", "sampling_params": {"max_new_tokens": 4}})
                        )
                    ),
                    range(2 * clients),
                )
            )
        trainer.act("full_dist")  # the torch_dist group exists before the first sample
        trainer.act("full_shm")
        samples: list[tuple[float, int, int]] = []
        t0 = time.monotonic()
        at_start = processes(pid)
        samples.append((0.0, *totals(at_start)))
        by_process: dict[int, tuple[str, int, int]] = {}  # after warm-up (the first sample at 1 minute or later)
        stop, lock, outcomes = threading.Event(), threading.Lock(), []
        threads = [
            threading.Thread(target=client_loop, args=(base, i, stop, outcomes, lock), daemon=True)
            for i in range(clients)
        ]
        threads.append(threading.Thread(target=trainer.run, args=(stop, update_every_s), daemon=True))
        for thread in threads:
            thread.start()
        while time.monotonic() - t0 < seconds:
            time.sleep(min(sample_every_s, max(0.0, seconds - (time.monotonic() - t0))))
            tree = processes(pid)
            samples.append((time.monotonic() - t0, *totals(tree)))
            if not by_process and samples[-1][0] >= min(60.0, seconds / 2):
                by_process = tree
            if progress:
                with lock:
                    done = len(outcomes)
                print(
                    f"{samples[-1][0]:7.0f} s  requests {done:6d}  rss {samples[-1][1] / 2**20:7.1f} MiB  "
                    f"fds {samples[-1][2]:4d}  trainer {dict(sorted(trainer.counts.items()))}",
                    flush=True,
                )
        stop.set()
        for thread in threads:
            thread.join(timeout=300)
        hung = sum(thread.is_alive() for thread in threads)
        trainer.verify("the end")
        trainer.act("full_shm")  # the state of the first sample: shm open, no torch_dist group (its sockets closed)
        time.sleep(1.0)  # the last connections close
        end_by_process = processes(pid)
        end_rss, end_fds = totals(end_by_process)
        trainer.admin.close()
    text = log.read_text(errors="replace")
    exceptions = [line for line in text.splitlines() if re.search(r"Traceback|^ERROR|\bERROR:", line)]
    lost = [
        o
        for o in outcomes
        if o.kind == "error"
        or (o.kind == "abort" and not explained(o, trainer.windows, ("abort",)))
        or (o.kind == "refused" and not explained(o, trainer.windows, ("abort", "wait", "sleep")))
    ]
    latencies = [o.end - o.start for o in outcomes if o.kind == "served"]
    five = min(samples, key=lambda s: abs(s[0] - 300))
    return {
        "minutes": minutes,
        "replicas": replicas,
        "clients": clients,
        "requests": len(outcomes),
        "served": sum(o.kind == "served" for o in outcomes),
        "disconnected_on_purpose": sum(o.kind == "disconnected" for o in outcomes),
        "aborted_by_abort_pause": sum(o.kind == "abort" for o in outcomes) - sum(o.kind == "abort" for o in lost),
        "refused_while_held": sum(o.kind == "refused" for o in outcomes) - sum(o.kind == "refused" for o in lost),
        "lost": len(lost),
        "lost_examples": [o.__dict__ for o in lost[:5]],
        "unexpected_5xx": sum(o in lost and (o.status or 0) >= 500 for o in outcomes),
        "exceptions_logged": len(exceptions),
        "exception_examples": exceptions[:5],
        "hung_threads": hung,
        "p50_s": round(percentile(latencies, 0.5), 3),
        "p99_s": round(percentile(latencies, 0.99), 3),
        "trainer": dict(sorted(trainer.counts.items())),
        "checksum_mismatches": trainer.mismatches,
        "update_p50_s": round(statistics.median(trainer.update_seconds), 3) if trainer.update_seconds else None,
        "rss_mib": [[round(t), round(r / 2**20, 1)] for t, r, _ in samples],
        "fds": [[round(t), f] for t, _, f in samples],
        "rss_mib_at_5_min": round(five[1] / 2**20, 1),
        "rss_mib_at_end": round(end_rss / 2**20, 1),
        "fds_at_start": samples[0][2],
        "fds_at_end": end_fds,
        # Descriptors gained by each process alive at the start (a leak per request shows here) and the processes
        # started since (Ray starts and retires workers of its own; a process per request would show as many).
        "fds_growth_by_process": dict(
            sorted(
                (
                    (f"{pid} {name}", fds - at_start[pid][2])
                    for pid, (name, _, fds) in end_by_process.items()
                    if pid in at_start
                ),
                key=lambda item: -item[1],
            )[:6]
        ),
        "processes_started_since": sorted(
            f"{pid} {name} ({fds} fds)" for pid, (name, _, fds) in end_by_process.items() if pid not in at_start
        ),
        "processes_ended_since": sorted(
            f"{pid} {name}" for pid, (name, _, _) in at_start.items() if pid not in end_by_process
        ),
        "rss_growth_mib_by_process": dict(
            sorted(  # since warm-up; a process started since: all of its RSS
                (
                    (f"{pid} {name}", round((rss - by_process.get(pid, ("", 0, 0))[1]) / 2**20, 1))
                    for pid, (name, rss, _) in end_by_process.items()
                ),
                key=lambda item: -item[1],
            )[:6]
        ),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--minutes", type=float, default=30.0)
    parser.add_argument("--replicas", type=int, default=1, help="2: a fleet on a local Ray behind one endpoint")
    parser.add_argument("--clients", type=int, default=6)
    parser.add_argument("--preset", default="tiny", help="hotswap.testing preset of the random-weight llama")
    parser.add_argument("--update-every", type=float, default=3.0, help="seconds between trainer actions (mean)")
    parser.add_argument("--sample-every", type=float, default=30.0, help="seconds between RSS / fd samples")
    parser.add_argument("--log", type=Path, default=None, help="where the server's output goes")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        checkpoints = {
            "A": make_tiny_model(root / "A", preset=args.preset, seed=0),
            "B": make_tiny_model(root / "B", preset=args.preset, seed=1),
        }
        figures = soak(
            checkpoints, args.minutes, args.replicas, args.clients, args.update_every, args.sample_every, args.log
        )
    print(
        f"requests {figures['requests']}: served {figures['served']}, disconnected on purpose "
        f"{figures['disconnected_on_purpose']}, aborted by abort pauses {figures['aborted_by_abort_pause']}, "
        f"503 while held {figures['refused_while_held']}, lost {figures['lost']}, unexpected 5xx "
        f"{figures['unexpected_5xx']}, exceptions logged {figures['exceptions_logged']}"
    )
    print(
        f"latency p50 {figures['p50_s']} s p99 {figures['p99_s']} s; trainer {figures['trainer']}; checksum "
        f"mismatches {len(figures['checksum_mismatches'])}"
    )
    print(
        f"RSS {figures['rss_mib_at_5_min']} MiB at 5 min, {figures['rss_mib_at_end']} MiB at the end; fds "
        f"{figures['fds_at_start']} at start, {figures['fds_at_end']} at the end"
    )
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
