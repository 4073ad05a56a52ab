"""The post-update canary: probe sequences scored with the new weights before they are committed.

A trainer that knows what its weights should give passes `canary` to `finish_weight_update` (or a fleet's): probe
token sequences and either the logprobs its own forward gives each probe's tokens 1.. (`logprobs`, compared
within `atol`) or a bound on each probe's mean negative logprob (`max_nll`, a sanity bound the user sets). The
engine post-processes the new weights, keeps its rollback copies, scores the probes (prompt logprobs, through the
same workers and kernels as generation), and commits only if every probe passes; otherwise every rank (and every
replica of a fleet) rolls back, and the error names the probe that failed and by how much. A wrong update that
checksums cannot see, such as a trainer sending transposed tensors of the right shape, fails here.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

MAX_PROBES, MAX_PROBE_TOKENS = 16, 4096


@dataclass(frozen=True)
class Canary:
    """Probes and what they must give (see the module doc)."""

    token_ids: list[list[int]]
    logprobs: list[list[float]] | None = None
    atol: float = 1e-3
    max_nll: float | None = None

    @classmethod
    def parse(cls, value: object, vocab: int, max_model_len: int) -> Canary:
        """From a dict {"token_ids", "logprobs" and/or "max_nll", "atol"?}. Raises ValueError naming the field."""
        if isinstance(value, Canary):
            return value
        if not isinstance(value, dict):
            raise ValueError(
                f"canary must be a dict with 'token_ids' and 'logprobs' or 'max_nll', got {type(value).__name__}"
            )
        unknown = sorted(set(value) - {"token_ids", "logprobs", "atol", "max_nll"})
        if unknown:
            raise ValueError(f"canary: unknown field(s) {unknown}")
        probes = value.get("token_ids")
        if (
            not isinstance(probes, list)
            or not 0 < len(probes) <= MAX_PROBES
            or any(not isinstance(p, list) or len(p) < 2 for p in probes)
        ):
            raise ValueError(f"canary.token_ids must be 1..{MAX_PROBES} probes of at least 2 token ids each")
        if sum(map(len, probes)) > MAX_PROBE_TOKENS:
            raise ValueError(f"canary probes hold more than {MAX_PROBE_TOKENS} tokens")
        if max(map(len, probes)) > max_model_len:
            raise ValueError(f"a canary probe is longer than max_model_len={max_model_len}")
        if any(not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab for p in probes for t in p):
            raise ValueError(f"canary.token_ids must be token ids in [0, {vocab})")
        expected, bound = value.get("logprobs"), value.get("max_nll")
        if expected is None and bound is None:
            raise ValueError(
                "canary needs 'logprobs' (the trainer's values for tokens 1.. of each probe) or "
                "'max_nll' (a bound on each probe's mean negative logprob)"
            )
        if expected is not None and (
            not isinstance(expected, list)
            or len(expected) != len(probes)
            or any(not isinstance(e, list) or len(e) != len(p) - 1 for e, p in zip(expected, probes, strict=False))
            or any(not isinstance(x, (int, float)) or not math.isfinite(x) for e in expected for x in e)
        ):
            raise ValueError("canary.logprobs must hold, per probe, one finite logprob for each token after the first")
        atol = value.get("atol", 1e-3)
        if isinstance(atol, bool) or not isinstance(atol, (int, float)) or not atol > 0:
            raise ValueError(f"canary.atol must be a positive number, got {atol!r}")
        if bound is not None and (isinstance(bound, bool) or not isinstance(bound, (int, float)) or not bound > 0):
            raise ValueError(f"canary.max_nll must be a positive number, got {bound!r}")
        return cls(
            [list(p) for p in probes],
            None if expected is None else [[float(x) for x in e] for e in expected],
            float(atol),
            None if bound is None else float(bound),
        )

    def check(self, scored: list[list[float]]) -> None:
        """Raises ValueError naming the first probe whose scores break the expectation."""
        for i, got in enumerate(scored):
            if not all(math.isfinite(x) for x in got):
                raise ValueError(f"canary probe {i} scored non-finite logprobs with the new weights")
            if self.logprobs is not None:
                diff = max(abs(a - b) for a, b in zip(got, self.logprobs[i], strict=True))
                if diff > self.atol:
                    raise ValueError(
                        f"canary probe {i}: the new weights' logprobs differ from the trainer's by up "
                        f"to {diff:.3g} (atol {self.atol:g})"
                    )
            if self.max_nll is not None:
                nll = -sum(got) / len(got)
                if nll > self.max_nll:
                    raise ValueError(
                        f"canary probe {i}: mean negative logprob {nll:.3f} exceeds max_nll {self.max_nll:g}"
                    )
