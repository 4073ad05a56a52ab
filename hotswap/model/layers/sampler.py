"""Batched token sampling with per-row settings, on the logits' device (only the sampled ids and the asked
logprobs come back to the host).

Sampling inverts the cumulative distribution: one uniform number per row picks the token where the row's running
sum of probabilities (in float64) passes it, which draws exactly from p at the cost of one pass over the vocabulary
(torch's CPU `exponential_`, used by the exponential race argmax(p / E), costs about 1 us per element: 60 ms for 64
rows of a 39k vocabulary against 1 ms here). A row with a seed draws its uniform from a generator keyed by (seed,
sample index, output position), so its tokens do not depend on what else is in the batch, on batch order, or on
preemption. Logprobs are those of the model's raw
distribution (before temperature and filters), as in vLLM, or what `logprobs_mode` names (`reported`); prompt
logprobs (`prompt_logprobs_of`) are the raw distribution's, or under a processed mode the same processed distribution
as sampled ones. Top-k entries are one `topk` over the rows that ask for the same k (no loop over rows).
"""

from __future__ import annotations

import torch

from hotswap.kernels import ops
from hotswap.wire import PromptLogprobs, PromptLogprobsAsk, SampleResult, SampleSpec


def _row_seed(seed: int, index: int, position: int) -> int:
    # SplitMix64 over the three keys: distinct streams per sample and per position.
    x = (seed * 0x9E3779B97F4A7C15 + index * 0xBF58476D1CE4E5B9 + position * 0x94D049BB133111EB) & (2**64 - 1)
    x ^= x >> 31
    x = (x * 0xBF58476D1CE4E5B9) & (2**64 - 1)
    x ^= x >> 27
    return x & (2**63 - 1)


def apply_filters(logits: torch.Tensor, specs: list[SampleSpec]) -> torch.Tensor:
    """Applies min-p, then top-k and top-p, per row (vLLM's order); filtered entries become -inf."""
    device = logits.device
    top_k = torch.tensor([s.top_k if s.top_k > 0 else logits.shape[1] for s in specs], device=device)
    top_p = torch.tensor([s.top_p for s in specs], dtype=logits.dtype, device=device)
    min_p = torch.tensor([s.min_p for s in specs], dtype=logits.dtype, device=device)
    if any(s.min_p > 0 for s in specs):  # decided on the host: no device read
        probs = logits.softmax(dim=-1)
        threshold = probs.max(dim=-1, keepdim=True).values * min_p[:, None]
        logits = logits.masked_fill(probs < threshold, float("-inf"))
    if any(0 < s.top_k < logits.shape[1] or s.top_p < 1.0 for s in specs):
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        ranks = torch.arange(logits.shape[1], device=device)[None, :]
        drop = ranks >= top_k[:, None]
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        probs = sorted_logits.softmax(dim=-1)
        # Keep the smallest prefix whose mass reaches top_p (always at least the first token).
        # rows with top_p 1 keep everything top-k left (float rounding can make the mass ahead of a token of
        # negligible probability reach 1)
        drop |= ((probs.cumsum(dim=-1) - probs) >= top_p[:, None]) & (top_p[:, None] < 1.0)
        drop[:, 0] = False
        logits = logits.scatter(1, order, sorted_logits.masked_fill(drop, float("-inf")))
    return logits


def adjusted(logits: torch.Tensor, specs: list[SampleSpec]) -> torch.Tensor:
    """`logits` with each row's logit bias, then its penalties applied (vLLM's order; a copy when any row has
    them): repetition over the prompt and output tokens, presence and frequency over the output tokens."""
    if not any(spec.adjusts for spec in specs):
        return logits
    logits = logits.clone()
    for row, spec in enumerate(specs):
        if spec.logit_bias:
            ids = torch.tensor(list(spec.logit_bias), dtype=torch.long, device=logits.device)
            logits[row, ids] += torch.tensor(list(spec.logit_bias.values()), dtype=logits.dtype, device=logits.device)
        if spec.seen_token_ids is None:
            continue
        line = logits[row]
        if spec.repetition_penalty != 1.0 and spec.seen_token_ids:
            seen = torch.tensor(sorted(set(spec.seen_token_ids)), dtype=torch.long, device=logits.device)
            values = line[seen]
            line[seen] = torch.where(values > 0, values / spec.repetition_penalty, values * spec.repetition_penalty)
        outputs = spec.seen_token_ids[spec.num_prompt_tokens :]
        if outputs and (spec.presence_penalty or spec.frequency_penalty):
            ids = torch.tensor(outputs, dtype=torch.long, device=logits.device)
            counts = torch.bincount(ids, minlength=line.shape[0]).to(line.dtype)
            line -= spec.frequency_penalty * counts + spec.presence_penalty * (counts > 0).to(line.dtype)
    return logits


def processed_logits(logits: torch.Tensor, specs: list[SampleSpec]) -> torch.Tensor:
    """The logits each row samples from: logit bias, penalties and banned tokens; then, for rows with a
    temperature, the temperature and min-p/top-k/top-p (filtered entries -inf). Greedy rows keep their adjusted
    logits (their argmax is the token)."""
    processed = banned(adjusted(logits, specs), specs)
    rows = [r for r, s in enumerate(specs) if s.temperature > 0]
    if rows:
        index = torch.tensor(rows, dtype=torch.long, device=logits.device)
        sub = [specs[r] for r in rows]
        scaled = processed[index]
        if any(s.temperature != 1.0 for s in sub):  # x / 1 is x
            scaled = scaled / temperatures(sub, logits)
        processed = processed.index_copy(0, index, apply_filters(scaled, sub))
    return processed


def reported(logits: torch.Tensor, specs: list[SampleSpec], mode: str) -> torch.Tensor:
    """The [R, V] values a sampled token's logprobs report under `mode` (see `ModelConfig.logprobs_mode`): the raw
    log-softmax or logits, or those of what each row samples from (`processed_logits`: the tensor the draw
    reads)."""
    values = logits if mode.startswith("raw") else processed_logits(logits, specs)
    return values.log_softmax(dim=-1) if mode.endswith("logprobs") else values


def sample(
    logits: torch.Tensor, specs: list[SampleSpec], mode: str = "raw_logprobs", deterministic: bool = False
) -> list[SampleResult]:
    """Samples one token per row of `logits` [R, V] (float32) following `specs[r]`; the logprobs report what
    `mode` (the model's `logprobs_mode`) names. `deterministic`: the model's mode (no greedy kernel: every row's
    logprob is the general path's)."""
    if not specs:  # a step that only prefills
        return []
    plain_greedy = all(
        s.temperature == 0 and not s.banned_token_ids and s.allowed is None and s.num_logprobs is None and not s.adjusts
        for s in specs
    )
    if plain_greedy and mode == "raw_logprobs" and ops.greedy_native(logits, deterministic):
        # The common decode step: argmax and its logprob in one pass, without the [R, V] log-softmax.
        greedy, chosen = ops.greedy_sample(logits, deterministic)
        return [SampleResult(t, lp) for t, lp in zip(greedy.tolist(), chosen.tolist(), strict=True)]
    logprobs = logits.log_softmax(dim=-1) if mode == "raw_logprobs" else reported(logits, specs, mode)
    logits = banned(adjusted(logits, specs), specs)
    random_rows = [r for r, s in enumerate(specs) if s.temperature > 0]
    # rows drawn from, as an index (None: every row, taken whole: no gather, and no argmax pass for greedy rows)
    index = (
        None if len(random_rows) == len(specs) else torch.tensor(random_rows, dtype=torch.long, device=logits.device)
    )
    tokens: torch.Tensor | None = None if index is None else logits.max(dim=-1).indices  # the first maximum
    kept: dict[int, list[int]] = {}
    if random_rows:
        sub_specs = specs if index is None else [specs[r] for r in random_rows]
        scaled = logits if index is None else logits[index]
        if any(s.temperature != 1.0 for s in sub_specs):  # x / 1 is x: the common case skips the pass
            scaled = scaled / temperatures(sub_specs, logits)
        filtered = apply_filters(scaled, sub_specs)
        # the uniforms are drawn on the host (a seeded row's from its own generator), so a seeded sample is the
        # same token on any device
        drawn = draw(filtered.softmax(dim=-1), uniforms_for(sub_specs).to(logits.device))
        if tokens is None:
            tokens = drawn
        else:
            tokens[index] = drawn
        kept = kept_sets(filtered, sub_specs, random_rows)  # from the very tensor the draw used
    assert tokens is not None
    results = results_for(logprobs, tokens, specs)
    for row, ids in kept.items():
        results[row].kept = ids
    return results


def filters(spec: SampleSpec, vocab: int) -> bool:
    """Whether min-p, top-k, top-p or a grammar can remove a token from this row's distribution."""
    return 0 < spec.top_k < vocab or spec.top_p < 1.0 or spec.min_p > 0.0 or spec.allowed is not None


def kept_sets(filtered: torch.Tensor, specs: list[SampleSpec], rows: list[int]) -> dict[int, list[int]]:
    """For each of `filtered`'s rows [R, V] (after temperature, filters and banned tokens) whose spec asks for the
    sampling mask and filters: `rows[j]` -> its finite token ids, ascending. Rows that filter nothing are left out
    (their mask is the whole vocabulary, `SampleResult.kept` None, whatever min_tokens bans)."""
    wanted = [j for j, s in enumerate(specs) if s.return_mask and filters(s, filtered.shape[1])]
    if not wanted:
        return {}
    finite = torch.isfinite(filtered[torch.tensor(wanted, device=filtered.device)])
    return {rows[j]: finite[i].nonzero().squeeze(1).tolist() for i, j in enumerate(wanted)}


def results_for(logprobs: torch.Tensor, tokens: torch.Tensor, specs: list[SampleSpec]) -> list[SampleResult]:
    """One SampleResult per row: `tokens[r]` with its logprob under `logprobs` [R, V] (what the mode reports), and
    its rank and the top-k (most likely first) where `specs[r].num_logprobs` asks: one `topk` per distinct k over
    the rows asking for it, so a row's entries do not depend on what the other rows ask."""
    chosen = logprobs.gather(1, tokens[:, None]).squeeze(1)
    token_list, chosen_list = tokens.tolist(), chosen.tolist()
    results = [SampleResult(t, lp) for t, lp in zip(token_list, chosen_list, strict=True)]
    asked = [r for r, spec in enumerate(specs) if spec.num_logprobs is not None]
    if not asked:
        return results
    index = torch.tensor(asked, dtype=torch.long, device=logprobs.device)
    rows = logprobs if len(asked) == len(specs) else logprobs[index]
    ranks = ((rows > chosen[index, None]).sum(dim=1) + 1).tolist()
    by_k: dict[int, list[int]] = {}
    for j, r in enumerate(asked):
        results[r].rank = ranks[j]
        k = min(specs[r].num_logprobs or 0, logprobs.shape[1])
        if k > 0:
            by_k.setdefault(k, []).append(j)
    for k, members in by_k.items():
        sub = rows if len(members) == len(asked) else rows[torch.tensor(members, device=logprobs.device)]
        ids, values = top_entries(sub, k)
        for j, row_ids, row_values in zip(members, ids, values, strict=True):
            results[asked[j]].top_ids, results[asked[j]].top_logprobs = row_ids, row_values
    return results


def top_entries(values: torch.Tensor, k: int) -> tuple[list[list[int]], list[list[float]]]:
    """The `k` largest entries of each row of `values` [R, V] (k <= V), largest first: their ids and values, as
    lists (one `topk` and one transfer each for the whole tensor)."""
    top = values.topk(k, dim=-1)
    return top.indices.tolist(), top.values.tolist()


def prompt_logprobs_of(logits: torch.Tensor, targets: list[int], ask: PromptLogprobsAsk) -> PromptLogprobs:
    """The prompt logprobs `ask` wants of a chunk of rows: `logits` [R, V] (float32) are the logits after R
    consecutive prompt tokens, `targets[j]` the token that follows row j. Reports, per row, the target's value, its
    rank (1 + the number of strictly larger values) and the `ask.top_k` largest values with their ids (k clipped to
    V; V: the whole vocabulary, sorted).

    The values are the raw log-softmax when `ask.spec` is None (vLLM's prompt logprobs), else `reported(logits,
    [ask.spec] * R, ask.mode)`: the very function sampled tokens' logprobs come from, so a prompt position and a
    sampled one at the same context and settings are the same bits (logits / T, then min-p/top-k/top-p; a
    filtered token's logprob is -inf)."""
    if len(targets) != logits.shape[0]:
        raise ValueError(f"{len(targets)} targets for {logits.shape[0]} rows of logits")
    if ask.spec is None:
        values = logits.log_softmax(dim=-1)
    else:
        values = reported(logits, [ask.spec] * logits.shape[0], ask.mode)
    wanted = torch.tensor(targets, dtype=torch.long, device=logits.device)[:, None]
    chosen = values.gather(1, wanted)
    out = PromptLogprobs(chosen.squeeze(1).tolist(), ((values > chosen).sum(dim=1) + 1).tolist(), [], [])
    k = min(ask.top_k, values.shape[1])
    if k > 0 and targets:
        out.top_ids, out.top_logprobs = top_entries(values, k)
    return out


def banned(logits: torch.Tensor, specs: list[SampleSpec]) -> torch.Tensor:
    """`logits` with each row's banned tokens (min_tokens) and the tokens its grammar disallows at -inf (a copy
    when any row bans). Where min_tokens would ban every token the grammar allows (it allows only EOS once
    complete), the grammar wins: the output must stay valid."""
    if any(spec.banned_token_ids or spec.allowed is not None for spec in specs):
        logits = logits.clone()
        for row, spec in enumerate(specs):
            if spec.allowed is not None:
                allowed = unpack(spec.allowed.to(logits.device), logits.shape[1])
                if spec.banned_token_ids:
                    kept = allowed.clone()
                    kept[spec.banned_token_ids] = False
                    allowed = kept if kept.any() else allowed
                logits[row].masked_fill_(~allowed, float("-inf"))
            elif spec.banned_token_ids:
                logits[row, spec.banned_token_ids] = float("-inf")
    return logits


def unpack(words: torch.Tensor, vocab: int) -> torch.Tensor:
    """bool [vocab] from a grammar's packed mask: bit t % 32 of word t // 32 says whether token t is allowed."""
    bits = (words.to(torch.int64)[:, None] >> torch.arange(32, device=words.device)) & 1
    return bits.flatten()[:vocab].bool()


def distribution(logits: torch.Tensor, specs: list[SampleSpec]) -> torch.Tensor:
    """The distribution each row samples from (after banned tokens, temperature, min-p, top-k, top-p): a point
    mass on the argmax for greedy rows. `logits` [R, V] float32."""
    processed = processed_logits(logits, specs)
    probs = torch.zeros_like(processed)
    greedy = [r for r, s in enumerate(specs) if s.temperature == 0]
    if greedy:
        rows = torch.tensor(greedy, device=logits.device)
        probs[rows, processed[rows].argmax(dim=-1)] = 1.0
    random_rows = [r for r, s in enumerate(specs) if s.temperature > 0]
    if random_rows:
        rows = torch.tensor(random_rows, device=logits.device)
        probs[rows] = processed[rows].softmax(dim=-1)
    return probs


def temperatures(specs: list[SampleSpec], logits: torch.Tensor) -> torch.Tensor:
    """[R, 1] of the rows' temperatures, in `logits`' dtype and on its device."""
    return torch.tensor([s.temperature for s in specs], dtype=logits.dtype, device=logits.device)[:, None]


def uniforms_for(specs: list[SampleSpec], stream: int = 0) -> torch.Tensor:
    """One uniform number in [0, 1) per row (float32, on the host whatever the logits' device, so that a seeded
    draw does not depend on the device): a seeded row's from its keyed generator (see `uniform_for`), the
    others' from the process's generator."""
    uniforms = torch.rand(len(specs))
    for i, spec in enumerate(specs):
        if spec.seed is not None:
            uniforms[i] = uniform_for(spec, stream)
    return uniforms


def uniform_for(spec: SampleSpec, stream: int = 0, position: int | None = None) -> float:
    """A uniform number in [0, 1) for one row: from the request's seed (keyed by sample index, output position and
    `stream`, so it never depends on the batch) or, unseeded, from the process's generator."""
    if spec.seed is None:
        return float(torch.rand(()))
    pos = spec.position if position is None else position
    gen = torch.Generator().manual_seed(_row_seed(spec.seed ^ stream, spec.sample_index, pos))
    return float(torch.rand((), generator=gen))


DRAW_BLOCK = 256  # columns per block of the two-level search in `draw`


def draw(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """For each row of `probs` [R, V] (non-negative, positive total, not necessarily normalized), the index where
    the row's running sum passes `uniforms[r]` (in [0, 1), float32) times the row's total: a draw from the
    normalized row. Adding a zero changes no sum, so a zero-probability entry is never drawn; and u <= 1 - 2^-24
    keeps the target below the total, so an index always exists.

    Two levels, so that no [R, V] float64 tensor is made (a float64 cumsum over a 39k vocabulary cost 36 ms at 128
    rows, as much as the step's products): each block of DRAW_BLOCK columns is summed (float32, pairwise: about
    1e-7 of the block's mass, the rounding the probabilities themselves carry), the running sum over blocks
    (float64) picks the block, and the target's place within that block's mass is found on the block's own
    float64 running sum, scaled to it, so no part of the block is skipped or favoured."""
    rows, vocab = probs.shape
    probs = probs.contiguous()
    full = vocab // DRAW_BLOCK  # whole blocks; a last partial one is summed apart (no padded copy of the rows)
    mass = probs[:, : full * DRAW_BLOCK].view(rows, full, DRAW_BLOCK).sum(dim=-1)
    if full * DRAW_BLOCK < vocab:
        mass = torch.cat([mass, probs[:, full * DRAW_BLOCK :].sum(dim=-1, keepdim=True)], dim=1)
    mass = mass.double()  # [R, blocks]
    blocks = mass.shape[1]
    block_cum = mass.cumsum(dim=-1)
    target = uniforms.to(torch.float64)[:, None] * block_cum[:, -1:]
    block = torch.searchsorted(block_cum, target, right=True).clamp_(max=blocks - 1)  # [R, 1]
    before = block_cum.gather(1, (block - 1).clamp(min=0)).masked_fill_(block == 0, 0.0)
    fraction = ((target - before) / mass.gather(1, block)).clamp_(0.0, 1.0)  # the chosen block has mass
    columns = block * DRAW_BLOCK + torch.arange(DRAW_BLOCK, device=probs.device)  # [R, DRAW_BLOCK], past the end
    inside = probs.gather(1, columns.clamp(max=vocab - 1)).masked_fill_(columns >= vocab, 0.0)
    cum = inside.double().cumsum(dim=-1)
    offset = torch.searchsorted(cum, fraction * cum[:, -1:], right=True).squeeze(1)
    last_with_mass = DRAW_BLOCK - 1 - (inside.flip(-1) > 0).int().argmax(dim=-1)
    offset = torch.where(offset >= DRAW_BLOCK, last_with_mass, offset)  # fraction 1 (a rounding at the edge)
    return (block.squeeze(1) * DRAW_BLOCK + offset).clamp_(max=vocab - 1)
