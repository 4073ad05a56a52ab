"""Tool-call and reasoning parsers on text (hotswap/entrypoints/tools.py, chat_output.py): each format parsed
whole, the same calls and text when streamed a character at a time, invalid blocks kept as text, and the grammar
of each format accepting what its parser reads."""

from __future__ import annotations

import json

import pytest

from hotswap.entrypoints.chat_output import ChoiceStream, parse_message, split_reasoning
from hotswap.entrypoints.tools import check_tools, tool_parser

pytestmark = pytest.mark.unit

CASES = {
    "hermes": (
        'Checking.<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call>\n<tool_call>\n'
        '{"name": "g", "arguments": {}}\n</tool_call>',
        "Checking.\n",
        [("f", {"x": 1}), ("g", {})],
    ),
    "llama3_json": (
        '{"name": "f", "parameters": {"x": 1}}; {"name": "g", "parameters": {"y": "z"}}',
        "",
        [("f", {"x": 1}), ("g", {"y": "z"})],
    ),
    "mistral": (
        'Sure[TOOL_CALLS][{"name": "f", "arguments": {"x": 1}}, {"name": "g", "arguments": {}}]',
        "Sure",
        [("f", {"x": 1}), ("g", {})],
    ),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_each_format_parses_whole_and_streamed_alike(name):
    text, content, calls = CASES[name]
    parser = tool_parser(name)
    message = parse_message(text, parser, None)
    assert (message.content or "") == content
    assert [(c.name, json.loads(c.arguments)) for c in message.calls] == calls
    stream = ChoiceStream(parser, None)
    got_content, got_calls = "", []
    for end in range(1, len(text) + 1):
        delta = stream.delta(text[:end], end == len(text))
        got_content += delta.get("content", "")
        got_calls += delta.get("tool_calls", [])
    assert got_content == content
    assert [(c["index"], c["function"]["name"], json.loads(c["function"]["arguments"])) for c in got_calls] == [
        (i, n, a) for i, (n, a) in enumerate(calls)
    ]


@pytest.mark.parametrize(
    "name, text",
    [
        ("hermes", "a <tool_call>\nnot json\n</tool_call> b <tool_call>open"),
        ("llama3_json", '{"name": "f", "parameters": '),
        ("mistral", "[TOOL_CALLS][{broken"),
    ],
)
def test_what_does_not_parse_stays_text(name, text):
    message = parse_message(text, tool_parser(name), None)
    assert message.content == text and message.calls == []


def test_reasoning_splits_whole_and_streamed():
    assert split_reasoning("<think>hmm</think>\n\nyes", "qwen3") == ("hmm", "yes", False)
    assert split_reasoning("plain answer", "qwen3") == (None, "plain answer", False)
    assert split_reasoning("still thinking", "deepseek_r1") == ("still thinking", "", False)
    assert split_reasoning("thought</think>answer", "deepseek_r1") == ("thought", "answer", False)
    for parser, text in (("deepseek_r1", "a b c</think>\nanswer"), ("qwen3", "<think>a b</think>answer")):
        stream, reasoning, content = ChoiceStream(None, parser), "", ""
        for end in range(1, len(text) + 1):
            delta = stream.delta(text[:end], end == len(text))
            reasoning += delta.get("reasoning_content", "")
            content += delta.get("content", "")
        assert (reasoning, content) == split_reasoning(text, parser)[:2]


def test_tool_choice_checks_and_grammars_accept_what_the_parsers_read(tmp_path):
    import llguidance
    import llguidance.hf
    from transformers import AutoTokenizer

    from hotswap.testing import make_tokenizer

    make_tokenizer(tmp_path)
    hf = AutoTokenizer.from_pretrained(str(tmp_path))
    vocab = llguidance.hf.from_tokenizer(hf)

    tools = [
        {
            "type": "function",
            "function": {
                "name": "f",
                "parameters": {
                    "type": "object",
                    "properties": {"x": {"type": "integer"}},
                    "required": ["x"],
                    "additionalProperties": False,
                },
            },
        }
    ]
    assert check_tools(tools, None) == (tools, "auto")
    assert check_tools(tools, "none") == (tools, None)
    assert check_tools(tools, {"type": "function", "function": {"name": "f"}}) == (tools, "f")
    for bad, message in (
        (("required",), "needs tools"),
        ((tools, {"function": {"name": "g"}}), "not among"),
        (([{"type": "retrieval"}], "auto"), "must be"),
    ):
        with pytest.raises(ValueError, match=message):
            check_tools(*bad) if len(bad) == 2 else check_tools(None, bad[0])
    for name, text in (
        ("hermes", '<tool_call>\n{"name":"f","arguments":{"x":5}}\n</tool_call>'),
        ("llama3_json", '{"name":"f","parameters":{"x":5}}'),
        ("mistral", '[TOOL_CALLS][{"name":"f","arguments":{"x":5}}]'),
    ):
        parser = tool_parser(name)
        matcher = llguidance.LLMatcher(vocab, llguidance.grammar_from("grammar", parser.grammar(tools, False)))
        assert all(matcher.consume_token(t) for t in hf.encode(text)) and matcher.is_accepting(), name
        assert [(c.name, json.loads(c.arguments)) for c in parser.parse(text).calls] == [("f", {"x": 5})]
        wrong = llguidance.LLMatcher(vocab, llguidance.grammar_from("grammar", parser.grammar(tools, False)))
        assert not all(wrong.consume_token(t) for t in hf.encode(text.replace('"f"', '"g"'))), name
