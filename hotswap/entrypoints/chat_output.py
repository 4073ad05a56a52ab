"""A chat choice's message from its tokens: reasoning split off (`--reasoning-parser`), tool calls parsed
(`--tool-call-parser`), whole or as streaming deltas. The token ids are never changed: this only reads them.

Reasoning parsers (`<think>` ... `</think>`, an optional leading `<think>` dropped): `deepseek_r1` treats an
output without `</think>` as all reasoning (its template opens the block in the prompt), `qwen3` as all content
unless the output opened the block itself.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from hotswap.entrypoints.tools import ToolCall, ToolParser, _partial_marker

REASONING_PARSERS = ("deepseek_r1", "qwen3")
THINK, END_THINK = "<think>", "</think>"


def check_reasoning_parser(name: str | None) -> None:
    if name is not None and name not in REASONING_PARSERS:
        raise ValueError(f"unknown reasoning parser {name!r}; choose one of {', '.join(REASONING_PARSERS)}")


def split_reasoning(text: str, parser: str, final: bool = True) -> tuple[str | None, str, bool]:
    """(reasoning, content, pending) of `text`. While streaming, a possible `</think>` at the end is pending."""
    opened = text.lstrip().startswith(THINK)
    body = text.lstrip()[len(THINK) :] if opened else text
    end = body.find(END_THINK)
    if end >= 0:
        return body[:end], body[end + len(END_THINK) :].lstrip("\n"), False
    if parser == "qwen3" and not opened:
        if not final and THINK.startswith(text.lstrip()) and text.strip():
            return None, "", True
        return None, text, False
    hold = 0 if final else _partial_marker(body, END_THINK)
    if not final and not opened and THINK.startswith(text.lstrip()):
        hold = len(body)
    return body[: len(body) - hold], "", hold > 0


@dataclass
class Message:
    content: str | None
    reasoning: str | None
    calls: list[ToolCall]

    def json(self) -> dict[str, Any]:
        message: dict[str, Any] = {"role": "assistant", "content": self.content}
        if self.reasoning is not None:
            message["reasoning_content"] = self.reasoning
        if self.calls:
            message["tool_calls"] = [c.json() for c in self.calls]
        return message


def parse_message(text: str, tools: ToolParser | None, reasoning: str | None) -> Message:
    """The message of a finished choice whose output decodes to `text`."""
    thought, content = None, text
    if reasoning is not None:
        thought, content, _ = split_reasoning(text, reasoning)
    calls: list[ToolCall] = []
    if tools is not None:
        parsed = tools.parse(content)
        content, calls = parsed.content, parsed.calls
    return Message(None if calls and not content.strip() else content, thought, calls)


@dataclass
class ChoiceStream:
    """Streaming state of one choice: what was sent of reasoning, content and calls."""

    tools: ToolParser | None
    reasoning: str | None
    token_ids: list[int] = field(default_factory=list)
    sent_reasoning: int = 0
    sent_content: int = 0
    sent_calls: int = 0

    def delta(self, text: str, final: bool) -> dict[str, Any]:
        """The delta for the output decoded so far (`text`, with `final` once finished): only what is new."""
        thought, content, pending = None, text, False
        if self.reasoning is not None:
            thought, content, pending = split_reasoning(text, self.reasoning, final)
        calls: list[ToolCall] = []
        if self.tools is not None and not pending:
            parsed = self.tools.parse(content, final)
            content, calls = parsed.content, parsed.calls
        delta: dict[str, Any] = {}
        if thought is not None and len(thought) > self.sent_reasoning:
            delta["reasoning_content"] = thought[self.sent_reasoning :]
            self.sent_reasoning = len(thought)
        if len(content) > self.sent_content:
            delta["content"] = content[self.sent_content :]
            self.sent_content = len(content)
        if len(calls) > self.sent_calls:
            delta["tool_calls"] = [{"index": i, **c.json()} for i, c in enumerate(calls) if i >= self.sent_calls]
            self.sent_calls = len(calls)
        return delta
