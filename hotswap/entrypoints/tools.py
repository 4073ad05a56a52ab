"""Tool calls in chat completions: parsing them out of the model's text (`hermes`, `llama3_json`, `mistral`, as
vLLM names them), in one piece or while streaming, and the grammar that makes `tool_choice` "required" or a named
function produce a valid call whatever the model's weights.

Parsers read text and never touch token ids: a response's `token_ids` are the sampled ones, tool-call markers
included. The text they read is the output decoded with special tokens kept (a marker may be one, as Mistral's
`[TOOL_CALLS]` is), EOS and stop tokens dropped.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any


@dataclass
class ToolCall:
    name: str
    arguments: str  # JSON text
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")

    def json(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass
class Parsed:
    """What a parser found: text outside tool calls, and the calls. `pending`: a marker or call that may still
    complete (streaming), held back from both."""

    content: str
    calls: list[ToolCall]
    pending: bool = False


def _call(obj: Any, args_key: str) -> ToolCall | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get(args_key, obj.get("arguments", obj.get("parameters", {})))
    return ToolCall(obj["name"], args if isinstance(args, str) else json.dumps(args, ensure_ascii=False))


def _partial_marker(text: str, marker: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `marker` (0 if none)."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


class ToolParser:
    """Base: calls in blocks between `start` and `end` markers (end None: the rest of the output)."""

    name = ""
    start = ""
    end: str | None = None
    args_key = "arguments"
    special_marker = False  # `start` is a special token in the model's tokenizer (decode keeping them)

    def calls_in(self, block: str) -> list[ToolCall] | None:
        """The calls one block holds, None if it is not valid."""
        try:
            obj = json.loads(block)
        except json.JSONDecodeError:
            return None
        objs = obj if isinstance(obj, list) else [obj]
        calls = [_call(o, self.args_key) for o in objs]
        return None if not calls or any(c is None for c in calls) else calls  # type: ignore[return-value]

    def parse(self, text: str, final: bool = True) -> Parsed:
        """Content and calls of `text`. While streaming (`final` False), a possible marker at the end or an open
        block is pending; once final, a block that does not parse stays content."""
        content: list[str] = []
        calls: list[ToolCall] = []
        pos = 0
        while True:
            at = text.find(self.start, pos)
            if at < 0:
                tail = text[pos:]
                hold = 0 if final else _partial_marker(tail, self.start)
                content.append(tail[: len(tail) - hold])
                return Parsed("".join(content), calls, pending=hold > 0)
            content.append(text[pos:at])
            body = at + len(self.start)
            close = len(text) if self.end is None else text.find(self.end, body)
            if not final and (close < 0 or self.end is None):
                return Parsed("".join(content), calls, pending=True)  # the block may still grow
            after = len(text) if close < 0 else close + len(self.end or "")
            found = None if close < 0 else self.calls_in(text[body:close].strip())
            if found is None:
                content.append(text[at:after])  # not a valid call: it stays text
            else:
                calls += found
            pos = after

    def grammar(self, tools: list[dict[str, Any]], parallel: bool) -> str:
        """A Lark grammar (llguidance's, with `%json` schemas) for one call, or one or more with `parallel`, to
        one of `tools` (OpenAI's [{"type": "function", "function": {name, parameters}}]), in this format."""
        call = "call: %json " + json.dumps(call_schema(tools, self.args_key))
        many = ' ("\\n" tc)*' if parallel else ""
        opening, closing = json.dumps(self.start + "\n"), json.dumps("\n" + (self.end or ""))
        return f"start: tc{many}\ntc: {opening} call {closing}\n{call}\n"


class HermesParser(ToolParser):
    """Hermes / Qwen: `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`, one block per call."""

    name, start, end = "hermes", "<tool_call>", "</tool_call>"


class Llama3JsonParser(ToolParser):
    """Llama 3.x JSON tool calling: the whole output is `{"name": ..., "parameters": {...}}` (optionally after
    `<|python_tag|>`), several separated by `; `."""

    name, start, end, args_key = "llama3_json", "<|python_tag|>", None, "parameters"
    special_marker = True

    def parse(self, text: str, final: bool = True) -> Parsed:
        body = text.strip()
        if body.startswith(self.start):
            body = body[len(self.start) :].strip()
        elif not body.startswith("{"):
            if not final and (not body or self.start.startswith(body)):
                return Parsed("", [], pending=True)
            return Parsed(text, [])
        if not final:
            return Parsed("", [], pending=True)  # a JSON call is whole only at the end
        calls: list[ToolCall] = []
        decoder, pos = json.JSONDecoder(), 0
        while pos < len(body):
            try:
                obj, pos = decoder.raw_decode(body, pos)
            except json.JSONDecodeError:
                return Parsed(text, [])
            call = _call(obj, self.args_key)
            if call is None:
                return Parsed(text, [])
            calls.append(call)
            pos = len(body) - len(body[pos:].lstrip().removeprefix(";").lstrip())
        return Parsed("", calls)

    def grammar(self, tools: list[dict[str, Any]], parallel: bool) -> str:
        call = "call: %json " + json.dumps(call_schema(tools, self.args_key))
        many = ' ("; " call)*' if parallel else ""
        return f"start: call{many}\n{call}\n"


class MistralParser(ToolParser):
    """Mistral: `[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]` to the end of the output."""

    name, start, end = "mistral", "[TOOL_CALLS]", None
    special_marker = True

    def grammar(self, tools: list[dict[str, Any]], parallel: bool) -> str:
        items = call_schema(tools, self.args_key)
        array = {
            "type": "array",
            "items": items,
            "minItems": 1,
            **({} if parallel else {"maxItems": 1}),
            "x-guidance": items.pop("x-guidance"),
        }
        return f'start: "[TOOL_CALLS]" calls\ncalls: %json {json.dumps(array)}\n'


PARSERS: dict[str, type[ToolParser]] = {p.name: p for p in (HermesParser, Llama3JsonParser, MistralParser)}


def tool_parser(name: str) -> ToolParser:
    """The parser named `name`; ValueError listing the known ones otherwise."""
    if name not in PARSERS:
        raise ValueError(f"unknown tool-call parser {name!r}; choose one of {', '.join(sorted(PARSERS))}")
    return PARSERS[name]()


def call_schema(tools: list[dict[str, Any]], args_key: str) -> dict[str, Any]:
    """JSON schema of one call to any of `tools`: {"name": <const>, args_key: <its parameters>}, compact."""
    options = []
    for tool in tools:
        fn = tool["function"]
        params = fn.get("parameters") or {"type": "object"}
        options.append(
            {
                "type": "object",
                "properties": {"name": {"const": fn["name"]}, args_key: params},
                "required": ["name", args_key],
                "additionalProperties": False,
            }
        )
    schema: dict[str, Any] = options[0] if len(options) == 1 else {"anyOf": options}
    return {**schema, "x-guidance": {"whitespace_flexible": False}}


def check_tools(
    tools: list[dict[str, Any]] | None, tool_choice: str | dict[str, Any] | None
) -> tuple[list[dict[str, Any]], str | None]:
    """(the tools a call may use, the choice: None, "auto", "required" or a function's name) after checking
    OpenAI's shapes; ValueError naming what is wrong. No tools means no choice; "none" means none."""
    tools = tools or []
    for i, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if (
            tool.get("type", "function") != "function"
            or not isinstance(fn, dict)
            or not isinstance(fn.get("name"), str)
        ):
            raise ValueError(f"tools[{i}] must be {{'type': 'function', 'function': {{'name': ..., ...}}}}")
        if fn.get("parameters") is not None and not isinstance(fn["parameters"], dict):
            raise ValueError(f"tools[{i}].function.parameters must be a JSON schema object")
    if tool_choice in (None, "none") or not tools:
        if isinstance(tool_choice, dict) or tool_choice in ("required",):
            raise ValueError(f"tool_choice {tool_choice!r} needs tools")
        return tools, None if tool_choice == "none" or not tools else "auto"
    if tool_choice in ("auto", "required"):
        return tools, str(tool_choice)
    if isinstance(tool_choice, dict):
        name = (tool_choice.get("function") or {}).get("name")
        named = [t for t in tools if t["function"]["name"] == name]
        if not named:
            raise ValueError(
                f"tool_choice names function {name!r}, which is not among the tools "
                f"{[t['function']['name'] for t in tools]}"
            )
        return named, str(name)
    raise ValueError(
        f"tool_choice must be 'none', 'auto', 'required' or {{'type': 'function', 'function': "
        f"{{'name': ...}}}}, got {tool_choice!r}"
    )
