"""How far the engine's distributions are from the trainer's, per mode (`hotswap parity`).

For each token sequence, the engine scores it as a prompt (its full-vocabulary prompt logprobs) and the trainer
scores it with its forward; over every position: the largest |difference| of the next token's logprob, and the
full-vocabulary KL(engine || trainer) and total variation, mean and max. Two modes:
- "default": the engine as it serves by default beside the trainer's own transformers forward (what a trainer
  gets today);
- "deterministic": the engine with `deterministic=True` beside `hotswap.train.token_logprobs`'s forward (zero
  everywhere, bit for bit, when the promise holds).
"""

from __future__ import annotations

import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from hotswap.train.logprobs import sequence_logprobs

MODES = ("default", "deterministic")


@dataclass
class ParityReport:
    mode: str
    positions: int
    max_abs_logprob_diff: float
    mean_kl: float
    max_kl: float
    mean_tv: float
    max_tv: float
    bitwise_equal: bool  # every full-vocabulary row equal, bit for bit

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def _engine_rows(
    model_dir: str, tokenizer: str | None, sequences: list[list[int]], deterministic: bool, vocab: int
) -> list[torch.Tensor]:
    """The engine's full-vocabulary log-softmax after each token but the last of every sequence."""
    from hotswap.entrypoints.llm import LLM
    from hotswap.sampling_params import SamplingParams

    llm = LLM(model_dir, tokenizer=tokenizer, dtype="float32", deterministic=deterministic, max_logprobs=-1)
    try:
        params = SamplingParams(max_tokens=1, prompt_logprobs=vocab, temperature=0.0)
        outs = llm.generate([{"prompt_token_ids": s} for s in sequences], params, use_tqdm=False)
    finally:
        llm.shutdown()
    rows = []
    for out in outs:
        entries = out.prompt_logprobs or []  # asked for: one entry per prompt token, None for the first
        table = torch.full((max(len(entries) - 1, 0), vocab), float("-inf"), dtype=torch.float32)
        for i, entry in enumerate(entries[1:]):
            assert entry is not None  # only the first prompt token has no logprobs
            ids = torch.tensor(list(entry))
            table[i, ids] = torch.tensor([entry[t].logprob for t in entry], dtype=torch.float32)
        rows.append(table)
    return rows


def _trainer_rows(model: nn.Module, sequences: list[list[int]], deterministic: bool) -> list[torch.Tensor]:
    with torch.no_grad():
        if deterministic:
            return sequence_logprobs(model, [torch.tensor(s) for s in sequences])
        out = []
        for s in sequences:
            logits = model(input_ids=torch.tensor([s])).logits[0, :-1]
            out.append(logits.float().log_softmax(-1))
        return out


def _report(
    mode: str, engine: list[torch.Tensor], trainer: list[torch.Tensor], sequences: list[list[int]]
) -> ParityReport:
    e, t = torch.cat(engine), torch.cat(trainer)
    if e.shape != t.shape:
        raise ValueError(f"the engine scored {list(e.shape)} and the trainer {list(t.shape)}: another vocabulary?")
    targets = torch.cat([torch.tensor(s[1:]) for s in sequences])
    diff = (e.gather(1, targets[:, None]) - t.gather(1, targets[:, None])).abs()
    p, q = e.exp(), t.exp()
    kl = torch.where(p > 0, p * (e - t), torch.zeros_like(p)).sum(-1)
    tv = 0.5 * (p - q).abs().sum(-1)
    return ParityReport(
        mode,
        len(targets),
        float(diff.max()),
        float(kl.mean()),
        float(kl.max()),
        float(tv.mean()),
        float(tv.max()),
        bool(torch.equal(e, t)),
    )


def parity(
    model: str | nn.Module,
    sequences: list[list[int]],
    tokenizer: str | None = None,
    modes: tuple[str, ...] = MODES,
) -> list[ParityReport]:
    """One report per mode (see the module docstring). `model`: a checkpoint folder (the trainer is transformers'
    model of it) or the trainer's transformers model (the engine serves its current weights, saved to a
    temporary folder; `tokenizer` names a folder with its tokenizer). `sequences`: token id lists of at least two
    tokens. Raises ValueError for an unknown mode or a sequence too short."""
    unknown = sorted(set(modes) - set(MODES))
    if unknown:
        raise ValueError(f"unknown parity mode(s) {unknown}; expected some of {list(MODES)}")
    if not sequences or any(len(s) < 2 for s in sequences):
        raise ValueError("parity needs at least one sequence, each of at least 2 token ids")
    with tempfile.TemporaryDirectory() as tmp:
        trainer: Any
        if isinstance(model, (str, Path)):
            from transformers import AutoModelForCausalLM

            folder, trainer = str(model), AutoModelForCausalLM.from_pretrained(str(model), dtype=torch.float32)
        else:
            if tokenizer is None:
                raise ValueError("parity of a trainer model needs `tokenizer`: a folder with its tokenizer files")
            folder, trainer = tmp, model
            trainer.save_pretrained(tmp)
        trainer.eval()
        vocab = int(trainer.config.vocab_size)
        reports = []
        for mode in modes:
            deterministic = mode == "deterministic"
            engine = _engine_rows(folder, tokenizer, sequences, deterministic, vocab)
            reports.append(_report(mode, engine, _trainer_rows(trainer, sequences, deterministic), sequences))
    return reports
