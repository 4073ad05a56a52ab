"""Speculative decoding's sampling: drawing a draft's proposals, and verifying them against the target.

Proposal j of a sequence, drawn from the draft's distribution q_j (a point mass for prompt lookup), is accepted
with probability min(1, p_j(d) / q_j(d)), where p_j is the target's distribution at that position after
temperature, filters and banned tokens, exactly as the plain sampler draws. At the first rejection the token is
drawn from norm(max(0, p_j - q_j)); when all are accepted, one more is drawn from the target's next distribution.
The emitted tokens then follow the target's distribution exactly, whatever the draft (Leviathan et al., Chen et
al., 2023). Greedy rows accept while the proposal is the target's argmax and emit the argmax at the first
mismatch: their tokens are those of decoding without speculation. Seeded rows draw every random number from
streams keyed by (seed, sample index, output position), so their outputs do not depend on the batch. Logprobs are
the target's, of its raw distribution, as without speculation.

The arithmetic runs on the logits' device; the uniforms are drawn on the host (`sampler.uniforms_for`,
`uniform_for`: a seeded row's token is the same on any device), and the host reads back the tokens, the asked
logprobs and, for unseeded sampled rows, the probabilities of the proposals in one transfer per step.
"""

from __future__ import annotations

import torch

from hotswap.kernels import ops
from hotswap.model.layers.sampler import (
    adjusted,
    apply_filters,
    banned,
    distribution,
    draw,
    kept_sets,
    reported,
    results_for,
    uniform_for,
    uniforms_for,
)
from hotswap.wire import SampleResult, SampleSpec


def propose(logits: torch.Tensor, specs: list[SampleSpec]) -> tuple[list[int], torch.Tensor | None]:
    """One draft token per row of `logits` [R, V], drawn from the distribution q that row's settings give the
    draft's logits (greedy rows: the argmax). Returns the tokens and q [R, V] (None when every row is greedy:
    greedy verification needs no q)."""
    logits = logits.float()
    if all(s.temperature == 0 for s in specs):
        return banned(adjusted(logits, specs), specs).argmax(dim=-1).tolist(), None
    q = distribution(logits, specs)
    # a seeded row's uniform is the target's own at this position: the coupling (drawn on the host)
    return draw(q, uniforms_for(specs).to(q.device)).tolist(), q


def one_draw(probs: torch.Tensor, uniform: float) -> int:
    """`draw` for one row [V], with `uniform` drawn on the host."""
    return int(draw(probs[None], torch.tensor([uniform], dtype=torch.float32, device=probs.device))[0])


def _chances(
    p: torch.Tensor, proposals: list[list[int]], draft_probs: list[torch.Tensor | None], specs: list[list[SampleSpec]]
) -> dict[tuple[int, int], tuple[float, float]]:
    """(p_j(d), q_j(d)) by (sequence, j) for each proposal d that an unseeded sampled row accepts by chance, read
    back to the host in one transfer (q_j(d) is 1 for a point mass): the acceptance test draws on the host."""
    keys: list[tuple[int, int]] = []
    rows: list[int] = []
    tokens: list[int] = []
    q_values: list[torch.Tensor] = []
    offset = 0
    for i, (props, q, seq_specs) in enumerate(zip(proposals, draft_probs, specs, strict=True)):
        js = [j for j in range(len(props)) if seq_specs[j].temperature > 0 and seq_specs[j].seed is None]
        if js:
            keys += [(i, j) for j in js]
            rows += [offset + j for j in js]
            tokens += [props[j] for j in js]
            if q is None:
                q_values.append(torch.ones(len(js), dtype=p.dtype, device=p.device))
            else:
                at = torch.tensor([[j, props[j]] for j in js], dtype=torch.long, device=q.device)
                q_values.append(q[at[:, 0], at[:, 1]].to(p.dtype))
        offset += len(props) + 1
    if not keys:
        return {}
    at = torch.tensor([rows, tokens], dtype=torch.long, device=p.device)
    p_at, q_at = torch.stack([p[at[0], at[1]], torch.cat(q_values)]).tolist()
    return {key: (pv, qv) for key, pv, qv in zip(keys, p_at, q_at, strict=True)}


def verify(
    logits: torch.Tensor,
    proposals: list[list[int]],
    draft_probs: list[torch.Tensor | None],
    specs: list[list[SampleSpec]],
    mode: str = "raw_logprobs",
    deterministic: bool = False,
) -> list[list[SampleResult]]:
    """The tokens each sequence emits this step: its accepted proposals, then one drawn by the target; their
    logprobs report what `mode` (the model's `logprobs_mode`) names (`deterministic`: the model's mode).

    Sequence i owns len(proposals[i]) + 1 consecutive rows of `logits` [N, V] (the target at its last token and
    at each proposal) and as many `specs[i]` (one per output position). `draft_probs[i]` [len(proposals[i]), V]
    is the distribution each proposal was drawn from, None for a point mass (prompt lookup)."""
    flat = [spec for seq_specs in specs for spec in seq_specs]
    assert logits.shape[0] == len(flat) == sum(len(p) + 1 for p in proposals), "one row per verified position"
    logits = logits.float()
    plain = all(
        s.temperature == 0 and not s.banned_token_ids and s.num_logprobs is None and not s.adjusts for s in flat
    )
    if plain and mode == "raw_logprobs" and ops.greedy_native(logits, deterministic):
        tokens, chosen = ops.greedy_sample(logits, deterministic)
        argmax, chosen_list = tokens.tolist(), chosen.tolist()
        out: list[list[SampleResult]] = []
        offset = 0
        for props in proposals:
            accepted = 0
            while accepted < len(props) and argmax[offset + accepted] == props[accepted]:
                accepted += 1
            out.append([SampleResult(argmax[r], chosen_list[r]) for r in range(offset, offset + accepted + 1)])
            offset += len(props) + 1
        return out
    p = distribution(logits, flat)
    chances = _chances(p, proposals, draft_probs, specs)
    argmax = p.argmax(dim=-1).tolist()
    for row, spec in enumerate(flat):  # seeded rows: the token plain sampling draws here (see the module doc)
        if spec.temperature > 0 and spec.seed is not None:
            argmax[row] = one_draw(p[row], uniform_for(spec))
    rows: list[int] = []
    tokens_out: list[int] = []
    counts: list[int] = []
    offset = 0
    for i, (props, q, seq_specs) in enumerate(zip(proposals, draft_probs, specs, strict=True)):
        emitted = 0
        for j, d in enumerate(props):
            row, spec = offset + j, seq_specs[j]
            if spec.temperature == 0 or spec.seed is not None:
                token = argmax[row]
            else:
                pd, qd = chances[i, j]
                if qd > 0 and uniform_for(spec) * qd < pd:  # unseeded: the process's generator
                    token = d
                else:
                    residual = p[row].clone()
                    if q is None:
                        residual[d] = 0.0
                    else:
                        residual = (residual - q[j]).clamp_min_(0.0)
                    residual = torch.where(residual.sum() > 0, residual, p[row])  # no mass left: p itself
                    token = one_draw(residual, uniform_for(spec))
            rows.append(row)
            tokens_out.append(token)
            emitted += 1
            if token != d:
                break
        else:
            row, spec = offset + len(props), seq_specs[len(props)]
            random_draw = spec.temperature > 0 and spec.seed is None
            token = one_draw(p[row], uniform_for(spec)) if random_draw else argmax[row]
            rows.append(row)
            tokens_out.append(token)
            emitted += 1
        counts.append(emitted)
        offset += len(props) + 1
    index = torch.tensor(rows, dtype=torch.long, device=logits.device)
    emitted_specs = [flat[r] for r in rows]
    values = reported(logits[index], emitted_specs, mode)
    results = results_for(values, torch.tensor(tokens_out, dtype=torch.long, device=logits.device), emitted_specs)
    masked = [j for j, spec in enumerate(emitted_specs) if spec.return_mask and spec.temperature > 0]
    if masked:  # an emitted token's support is the target's at its position (p_j's), filtered as `distribution`
        sub = [emitted_specs[j] for j in masked]
        rows_logits = banned(adjusted(logits[index[torch.tensor(masked, device=logits.device)]], sub), sub)
        temps = torch.tensor([s.temperature for s in sub], dtype=rows_logits.dtype, device=logits.device)
        for j, ids in kept_sets(apply_filters(rows_logits / temps[:, None], sub), sub, masked).items():
            results[j].kept = ids
    out = []
    start = 0
    for count in counts:
        out.append(results[start : start + count])
        start += count
    return out
