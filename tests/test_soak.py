"""The soak (`benchmarks/soak.py`) for one minute against a server and one minute against a 2-replica fleet: mixed
streaming and whole-response clients at temperature 1 with n up to 8, clients leaving at random points, a trainer
pushing full and partial updates over shm and torch_dist, failing ones (a wrong shape, a NaN, a killed trainer),
pauses in every mode, sleep and wake, prefix-cache resets. Nothing lost, no 5xx outside the holds, no exception in
the server's log, the engine's checksums equal to the trainer's after every update, file descriptors flat."""

from __future__ import annotations

import pytest

from benchmarks.soak import soak

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("replicas", [1, 2])
def test_soak_loses_nothing(ckpts, tmp_path, replicas):
    if replicas > 1:
        pytest.importorskip("ray")
    figures = soak(
        ckpts,
        minutes=1.0,
        replicas=replicas,
        clients=6,
        update_every_s=1.5,
        sample_every_s=5.0,
        log=tmp_path / "server.log",
        progress=False,
    )
    summary = {k: v for k, v in figures.items() if k not in ("rss_mib", "fds")}
    assert figures["lost"] == 0 and figures["unexpected_5xx"] == 0, summary
    assert figures["exceptions_logged"] == 0 and figures["hung_threads"] == 0, summary
    assert figures["checksum_mismatches"] == [], summary
    assert figures["served"] > 50 and figures["disconnected_on_purpose"] > 0, summary
    trainer = figures["trainer"]
    for action in ("full_shm", "partial_shm", "full_dist", "bad_shape", "nan", "pause_abort", "pause_wait"):
        assert trainer.get(action, 0) >= 1, summary  # every kind ran, and each failing one was refused (400)
    # No descriptor kept per request (over a thousand requests, a leak on one in a hundred shows). Both ends are
    # measured in the same transport state (shm open, no torch_dist group). A fleet's Ray processes open a few
    # connections of their own on first use (its raylet 3, each replica 1-2: measured, the same in every run).
    assert figures["fds_at_end"] <= figures["fds_at_start"] + 8 * replicas, summary
    assert all(growth <= 8 for growth in figures["fds_growth_by_process"].values()), summary
