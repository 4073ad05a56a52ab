"""Token ids -> text, and stop-string detection on the generated text."""

from __future__ import annotations

from typing import Any, cast


class Detokenizer:
    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._token_cache: dict[int, str] = {}

    def decode(self, token_ids: list[int], skip_special_tokens: bool) -> str:
        return cast("str", self.tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens))

    def token_text(self, token_id: int) -> str:
        """The text of one token on its own (for logprob entries)."""
        text = self._token_cache.get(token_id)
        if text is None:
            text = self.tokenizer.decode([token_id], skip_special_tokens=False)
            self._token_cache[token_id] = text
        return text


def find_stop(text: str, stops: list[str], new_chars: int) -> tuple[str, int] | None:
    """The earliest stop string that ends within the last `new_chars` characters of `text`, with its start."""
    best: tuple[str, int] | None = None
    for stop in stops:
        start = text.find(stop, max(0, len(text) - new_chars - len(stop) + 1))
        if start != -1 and (best is None or start < best[1]):
            best = (stop, start)
    return best
