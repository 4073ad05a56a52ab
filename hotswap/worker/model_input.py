"""What the engine sends a worker each step: plain data, picklable for worker processes."""

from __future__ import annotations

from dataclasses import dataclass, field

from hotswap.model.layers.sampler import SampleResult, SampleSpec


@dataclass
class ModelInput:
    """A flat batch. Sequence i contributes `query_lens[i]` tokens of `input_ids`/`positions`, has
    `context_lens[i]` tokens in total and its KV in `block_tables[i]`. `sample_rows[j]` is the sequence whose
    last-token logits sample row j, following `sample_specs[j]`. `block_copies` run before the forward pass."""

    input_ids: list[int]
    positions: list[int]
    query_lens: list[int]
    context_lens: list[int]
    block_tables: list[list[int]]
    sample_rows: list[int]
    sample_specs: list[SampleSpec]
    block_copies: list[tuple[int, int]] = field(default_factory=list)


ModelOutput = list[SampleResult]
