"""Grammar-constrained decoding with llguidance: compiled grammars (cached by what they compile from) and, per
sequence, a matcher that gives the tokens allowed next as a packed bitmask and advances on each sampled token.

Why llguidance: a small self-contained wheel (Rust, no dependencies; xgrammar brings triton with it), CPU-native,
tens of microseconds per mask on a 39k vocabulary, JSON schema, regex, choice, Lark and GBNF in one library, and
the backend vLLM and SGLang also ship. The mask is computed in the engine process (the matcher's state follows
the sequence), packed 32 tokens to an int32 word, and applied by the sampler in the worker (see
`hotswap/model/layers/sampler.py`, `banned`): a constrained row's disallowed logits become -inf before
temperature and filters; rows without a grammar are untouched.

Invariant: a sequence's matcher has consumed exactly its output tokens. Preemption keeps the tokens, so the
matcher stays; n>1 siblings fork before their first token, each with a copy of the initial state; constrained
sequences do not speculate (a proposal's mask would depend on the proposals before it), so speculative decoding
leaves their outputs exact.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import TYPE_CHECKING, Any

import torch

from hotswap.structured_outputs import StructuredOutputsParams

if TYPE_CHECKING:
    from llguidance import LLMatcher, LLTokenizer


class Grammars:
    """Compiles `StructuredOutputsParams` for one tokenizer and vocabulary. Not thread-safe (the engine's)."""

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: set[int], cache_size: int = 256) -> None:
        self._hf_tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = sorted(eos_token_ids)
        self._tokenizer: LLTokenizer | None = (
            None  # llguidance's, built on first use (about a second on a large vocabulary)
        )
        self._compiled: OrderedDict[str, str] = OrderedDict()
        self.cache_size = cache_size

    @property
    def tokenizer(self) -> LLTokenizer:
        if self._tokenizer is None:
            import llguidance.hf

            try:
                self._tokenizer = llguidance.hf.from_tokenizer(
                    self._hf_tokenizer, n_vocab=self.vocab_size, eos_token=self.eos_token_ids or None
                )
            except Exception as err:  # a slow (Python) tokenizer, or one llguidance cannot read
                raise ValueError(f"structured outputs need a fast tokenizer llguidance can read: {err}") from None
        return self._tokenizer

    def compile(self, params: StructuredOutputsParams) -> str:
        """The grammar for `params`, checked against the tokenizer. Raises ValueError naming the error (an invalid
        schema, regex or grammar)."""
        key = params.key()
        grammar = self._compiled.get(key)
        if grammar is not None:
            self._compiled.move_to_end(key)
            return grammar
        import llguidance

        kind, text = params.grammar_source()
        try:
            grammar = llguidance.grammar_from(kind, text)  # type: ignore[arg-type]
        except (ValueError, RuntimeError) as err:
            raise ValueError(f"invalid structured output ({kind}): {err}") from None
        error = llguidance.LLMatcher.validate_grammar(grammar, self.tokenizer)
        if error:
            raise ValueError(f"invalid structured output ({kind}): {error.strip()}")
        self._compiled[key] = grammar
        if len(self._compiled) > self.cache_size:
            self._compiled.popitem(last=False)
        return grammar

    def matcher(self, params: StructuredOutputsParams) -> LLMatcher:
        """A new matcher at the start of `params`'s grammar."""
        import llguidance

        return llguidance.LLMatcher(self.tokenizer, self.compile(params), log_level=0)

    def mask(self, matcher: LLMatcher) -> torch.Tensor:
        """The tokens `matcher` allows next: int32 [ceil(vocab / 32)], bit t % 32 of word t // 32 set for an allowed
        token t. A matcher in error (it cannot happen through the sampler) allows only EOS."""
        words = torch.full(((self.vocab_size + 31) // 32,), -1, dtype=torch.int32)
        matcher.unsafe_compute_mask_ptr(words.data_ptr(), words.numel() * 4)
        return words


def advance(matcher: LLMatcher, token: int) -> None:
    """Moves `matcher` past the sampled `token`. The sampler only draws allowed tokens, so a refusal is a broken
    invariant."""
    ok = matcher.consume_token(token)
    assert ok or matcher.is_stopped(), f"token {token} sampled outside its grammar: {matcher.get_error()}"
