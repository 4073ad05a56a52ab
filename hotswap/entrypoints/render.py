"""Chat prompts as token ids, with earlier turns' exact tokens.

Re-tokenizing an earlier assistant turn's text can give other ids than the model sampled (a byte-level BPE has
many spellings of one text), and a trainer that sees other tokens than the rollout made is off-policy. So an
assistant message may carry `token_ids`, the ids its turn returned (`return_token_ids`); the prompt then holds
exactly those ids where the template puts that message's content:

    render(messages + [assistant(token_ids=C), user(...)])[: len(P) + len(C)] == P + C

where P is the turn's own prompt. The template renders the message with a placeholder for its content (and
without its `tool_calls` or reasoning: the sampled ids already hold them); the text around each placeholder is
tokenized as the template's text is, and the ids go in between. Where the ids end with the token that the
template writes next (an end-of-turn such as `<|im_end|>` or EOS), it is not written twice. Without `token_ids`
a message is rendered as the template renders it, and the whole prompt is the template's tokenization.
"""

from __future__ import annotations

import secrets
from typing import Any


def render_ids(tokenizer: Any, messages: list[dict[str, Any]], vocab_size: int, **template_kwargs: Any) -> list[int]:
    """The prompt ids for `messages` (see the module docstring); `template_kwargs` go to `apply_chat_template`
    (tools, chat_template, add_generation_prompt, continue_final_message, ...). Raises ValueError for ids out of
    range or a template that does not render a message's content verbatim."""
    exact: dict[int, list[int]] = {}
    rendered = []
    nonce = secrets.token_hex(8)
    for i, message in enumerate(messages):
        ids = message.get("token_ids")
        message = {k: v for k, v in message.items() if k != "token_ids"}
        if ids is not None:
            if message.get("role") != "assistant":
                raise ValueError(f"messages[{i}]: token_ids are taken on assistant messages only")
            if not isinstance(ids, list) or not all(isinstance(t, int) and 0 <= t < vocab_size for t in ids):
                raise ValueError(f"messages[{i}].token_ids must be token ids in [0, {vocab_size})")
            exact[i] = ids
            message = {k: v for k, v in message.items() if k not in ("tool_calls", "reasoning_content")}
            message["content"] = _placeholder(nonce, i)
        rendered.append(message)
    if not exact:
        return list(tokenizer.apply_chat_template(messages, tokenize=True, return_dict=False, **template_kwargs))
    text = tokenizer.apply_chat_template(rendered, tokenize=False, **template_kwargs)
    out: list[int] = []
    specials = set(getattr(tokenizer, "all_special_ids", []))
    for i, ids in exact.items():
        mark = _placeholder(nonce, i)
        if text.count(mark) != 1:
            raise ValueError(
                f"the chat template does not render messages[{i}]'s content verbatim, so its "
                "token_ids cannot be placed; send that message without token_ids"
            )
        before, text = text.split(mark)
        _extend(out, tokenizer.encode(before, add_special_tokens=False), specials)
        out.extend(ids)
    _extend(out, tokenizer.encode(text, add_special_tokens=False), specials)
    return out


def _placeholder(nonce: str, index: int) -> str:
    return f"HOTSWAPIDS{nonce}X{index}X"


def _extend(out: list[int], piece: list[int], specials: set[int]) -> None:
    """Appends `piece`, less its first token where `out` already ends with that special token."""
    if out and piece and piece[0] == out[-1] and piece[0] in specials:
        piece = piece[1:]
    out.extend(piece)
