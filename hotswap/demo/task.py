"""The demo's task: copy the digits of the prompt; a completion's reward is the fraction of right digits."""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

from hotswap.testing import EOS_TOKEN_ID

NUM_SYMBOLS = 10  # the digits 0-9
CHANCE_REWARD = 1.0 / NUM_SYMBOLS


@dataclass(frozen=True)
class CopyTask:
    """Copy K digits. Works on token ids only: `digit_ids[d]` is the tokenizer's id of the digit d."""

    digit_ids: tuple[int, ...]
    sep_id: int
    bos_id: int
    num_digits: int

    @classmethod
    def from_tokenizer(cls, tokenizer: Any, num_digits: int) -> CopyTask:
        """Looks up single-token ids for "0".."9" and "="; raises ValueError if the tokenizer lacks one."""
        symbols = [str(d) for d in range(NUM_SYMBOLS)] + ["="]
        ids = [tokenizer.convert_tokens_to_ids(s) for s in symbols]
        if any(i is None or i == tokenizer.unk_token_id for i in ids) or len(set(ids)) != len(ids):
            raise ValueError(f"the tokenizer needs distinct single tokens for {symbols}")
        return cls(tuple(ids[:NUM_SYMBOLS]), ids[NUM_SYMBOLS], EOS_TOKEN_ID, num_digits)

    @property
    def prompt_len(self) -> int:
        return self.num_digits + 2

    def sample(self, rng: random.Random) -> list[int]:
        """K random digits (values 0-9)."""
        return [rng.randrange(NUM_SYMBOLS) for _ in range(self.num_digits)]

    def prompt_ids(self, digits: list[int]) -> list[int]:
        return [self.bos_id, *(self.digit_ids[d] for d in digits), self.sep_id]

    def reward(self, digits: list[int], completion_ids: list[int]) -> float:
        """Fraction of the K positions where the completion holds the prompt's digit (extra tokens are ignored,
        missing ones count as wrong)."""
        hits = sum(int(c == self.digit_ids[d]) for d, c in zip(digits, completion_ids, strict=False))
        return hits / self.num_digits

    def render(self, ids: list[int]) -> str:
        """Digits as text, '=' for the separator, '?' for any other token (the bos is left out)."""
        names = {tid: str(d) for d, tid in enumerate(self.digit_ids)} | {self.sep_id: "="}
        return " ".join(names.get(t, "?") for t in ids if t != self.bos_id)
