"""Agentic rollouts over HTTP with the official `openai` client (hotswap serve --tool-call-parser hermes
--reasoning-parser qwen3): structured outputs valid against their schema on a random-weight model, tool_choice
required / named returning valid calls, auto with a scripted output parsed (whole and streamed), reasoning split,
token ids untouched by the parsers, the render route, exact tokens across five turns over several chat templates,
sessions (X-Session-ID, SGLang's open/close_session) and SGLang's constraints on /generate."""

from __future__ import annotations

import json
import re

import httpx
import jsonschema
import pytest

from server_helpers import post, running_server

openai = pytest.importorskip("openai")

WEATHER = {
    "type": "object",
    "properties": {
        "city": {"enum": ["Paris", "Rome", "Oslo"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "days"],
    "additionalProperties": False,
}
ADD = {
    "type": "object",
    "properties": {
        "a": {"type": "integer", "minimum": 0, "maximum": 9},
        "b": {"type": "integer", "minimum": 0, "maximum": 9},
    },
    "required": ["a", "b"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Forecast", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "add", "parameters": ADD}},
]
SCHEMAS = {"get_weather": WEATHER, "add": ADD}
ANSWER = {
    "type": "object",
    "properties": {"answer": {"enum": ["yes", "no"]}, "score": {"type": "integer", "minimum": 0, "maximum": 10}},
    "required": ["answer", "score"],
    "additionalProperties": False,
}
SCRIPT = (
    '<think>the user wants a sum</think>\nLet me add.<tool_call>\n{"name": "add", "arguments": {"a": 3, '
    '"b": 4}}\n</tool_call>'
)

# chat templates of other families, for exact-token rendering across turns (the test model's own is ChatML)
LLAMA3 = (
    "{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n"
    "{{ m['content'] }}<|eot_id|>{% endfor %}{% if add_generation_prompt %}<|start_header_id|>assistant"
    "<|end_header_id|>\n\n{% endif %}"
)
MISTRAL = (
    "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'user' %}[INST] {{ m['content'] }} [/INST]"
    "{% elif m['role'] == 'assistant' %}{{ m['content'] }}{{ eos_token }}{% endif %}{% endfor %}"
)
QWEN_TOOLS = (
    "{% if tools %}<|im_start|>system\n# Tools\n<tools>{% for t in tools %}\n{{ t | tojson }}{% endfor %}"
    "\n</tools><|im_end|>\n{% endif %}{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
    '{% for c in m.get(\'tool_calls\', []) %}\n<tool_call>\n{"name": "{{ c.function.name }}", '
    '"arguments": {{ c.function.arguments | tojson }}}\n</tool_call>{% endfor %}<|im_end|>\n{% endfor %}'
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@pytest.fixture(scope="module")
def server(ckpts):
    with running_server(
        str(ckpts["A"]),
        "--admin-auth",
        "none",
        "--kv-cache-memory-bytes",
        str(1 << 23),
        "--tool-call-parser",
        "hermes",
        "--reasoning-parser",
        "qwen3",
    ) as base:
        yield base


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server}/v1", api_key="none", max_retries=0)


USER = [{"role": "user", "content": "What is the weather in Rome for three days?"}]


def test_response_format_json_schema_and_json_object_are_valid(client):
    r = client.chat.completions.create(
        model="A",
        messages=USER,
        n=3,
        temperature=1.0,
        seed=5,
        max_tokens=120,
        response_format={"type": "json_schema", "json_schema": {"name": "answer", "schema": ANSWER, "strict": True}},
    )
    for choice in r.choices:
        assert choice.finish_reason == "stop"
        jsonschema.validate(json.loads(choice.message.content), ANSWER)
    # any object: its strings are free, and after some prompts this random model never closes one; after this
    # one it closes the object at once
    objects = client.completions.create(
        model="A",
        prompt="Hello",
        temperature=1.0,
        seed=1,
        max_tokens=100,
        extra_body={"response_format": {"type": "json_object"}},
    )
    assert objects.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(objects.choices[0].text), dict)
    done = client.completions.create(
        model="A",
        prompt="The answer:",
        max_tokens=120,
        temperature=1.0,
        seed=2,
        extra_body={"structured_outputs": {"json": ANSWER}},
    )
    jsonschema.validate(json.loads(done.choices[0].text), ANSWER)
    with pytest.raises(openai.BadRequestError, match="invalid structured output"):
        client.chat.completions.create(
            model="A",
            messages=USER,
            max_tokens=5,
            response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "frobnicate"}}},
        )


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "add"}}])
def test_required_and_named_tool_choices_return_valid_calls_whose_tokens_are_kept(client, tokenizer, choice):
    r = client.chat.completions.create(
        model="A",
        messages=USER,
        tools=TOOLS,
        tool_choice=choice,
        n=2,
        temperature=1.0,
        seed=9,
        max_tokens=150,
        parallel_tool_calls=False,
        extra_body={"return_token_ids": True},
    )
    for c in r.choices:
        assert c.finish_reason == "tool_calls" and c.message.content is None
        (call,) = c.message.tool_calls
        assert call.type == "function" and call.id.startswith("call_")
        if isinstance(choice, dict):
            assert call.function.name == "add"
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
        text = tokenizer.decode(c.model_extra["token_ids"])  # the markers are in the tokens the model sampled
        assert text.startswith("<tool_call>\n") and f'"name":"{call.function.name}"' in text


def test_auto_parses_a_scripted_output_whole_and_streamed_with_reasoning(client, tokenizer):
    body = dict(
        model="A",
        messages=USER,
        tools=TOOLS,
        tool_choice="auto",
        max_tokens=100,
        temperature=0,
        extra_body={"structured_outputs": {"choice": [SCRIPT]}, "return_token_ids": True},
    )
    whole = client.chat.completions.create(**body).choices[0]
    assert whole.finish_reason == "tool_calls"
    assert whole.message.content == "Let me add."
    assert whole.message.model_extra["reasoning_content"] == "the user wants a sum"
    (call,) = whole.message.tool_calls
    assert call.function.name == "add" and json.loads(call.function.arguments) == {"a": 3, "b": 4}
    assert tokenizer.decode(whole.model_extra["token_ids"][:-1]) == SCRIPT  # every token, EOS last

    content, reasoning, calls, ids, finish = "", "", [], [], None
    for chunk in client.chat.completions.create(**body, stream=True):
        c = chunk.choices[0]
        content += c.delta.content or ""
        reasoning += c.delta.model_extra.get("reasoning_content") or ""
        calls += c.delta.tool_calls or []
        ids += c.model_extra.get("token_ids") or []
        finish = c.finish_reason or finish
    assert (content, reasoning, finish) == ("Let me add.", "the user wants a sum", "tool_calls")
    assert [(t.index, t.function.name, json.loads(t.function.arguments)) for t in calls] == [
        (0, "add", {"a": 3, "b": 4})
    ]
    assert ids == whole.model_extra["token_ids"]
    with pytest.raises(openai.BadRequestError, match="needs tools"):
        client.chat.completions.create(model="A", messages=USER, tool_choice="required", max_tokens=4)
    with pytest.raises(openai.BadRequestError, match="not among the tools"):
        client.chat.completions.create(
            model="A",
            messages=USER,
            tools=TOOLS,
            max_tokens=4,
            tool_choice={"type": "function", "function": {"name": "nope"}},
        )


def test_render_returns_the_prompt_and_uses_the_templates_tool_rendering(server, client):
    r = client.chat.completions.create(
        model="A", messages=USER, max_tokens=3, temperature=0, extra_body={"return_token_ids": True}
    )
    rendered = post(server, "/v1/chat/completions/render", model="A", messages=USER).json()
    assert rendered["prompt_token_ids"] == r.model_extra["prompt_token_ids"]
    own = post(
        server, "/v1/chat/completions/render", model="A", messages=USER, tools=TOOLS, chat_template=QWEN_TOOLS
    ).json()["prompt"]
    assert own.startswith("<|im_start|>system\n# Tools\n<tools>") and '"name": "get_weather"' in own
    fallback = post(server, "/v1/chat/completions/render", model="A", messages=USER, tools=TOOLS).json()["prompt"]
    assert "You may call one or more of these functions" in fallback and "<tool_call>" in fallback
    none = post(
        server, "/v1/chat/completions/render", model="A", messages=USER, tools=TOOLS, tool_choice="none"
    ).json()["prompt"]
    assert none == fallback  # rendered whatever the choice: an agent's prompt prefix survives a change of it


@pytest.mark.parametrize(
    "template", [None, LLAMA3, MISTRAL, QWEN_TOOLS], ids=["chatml", "llama3", "mistral", "qwen-tools"]
)
def test_five_turns_built_from_returned_ids_keep_every_token(server, tokenizer, template):
    """Turn n+1's prompt starts with turn n's prompt and sampled ids, exactly (the assistant messages carry their
    token_ids), whether the output re-tokenizes to the same ids or not, and whether it ended with EOS (a forced
    choice) or at max_tokens; rendering canonical ids gives exactly the template's own tokenization."""
    messages: list[dict] = [{"role": "user", "content": "hello there"}]
    session = f"tito-{template is None}-{len(template or '')}"
    before: list[int] = []
    drifted = 0  # turns whose text re-tokenizes to other ids than were sampled
    for turn in range(5):
        extra = {"structured_outputs": {"choice": [f"answer {turn}"]}} if turn % 2 else {}
        r = httpx.post(
            f"{server}/v1/chat/completions",
            timeout=120,
            headers={"X-Session-ID": session},
            json=dict(
                model="A",
                messages=messages,
                max_tokens=12,
                temperature=1.0,
                seed=turn,
                return_token_ids=True,
                chat_template=template,
                **extra,
            ),
        ).json()
        prompt, sampled = r["prompt_token_ids"], r["choices"][0]["token_ids"]
        assert prompt[: len(before)] == before
        if turn:
            assert r["usage"]["prompt_tokens_details"]["cached_tokens"] >= (len(before) // 16) * 16 - 16
        before = prompt + sampled
        text = r["choices"][0]["message"]["content"]
        drifted += tokenizer.encode(text) != [t for t in sampled if t not in tokenizer.all_special_ids]
        messages += [
            {"role": "assistant", "content": text, "token_ids": sampled},
            {"role": "user", "content": f"tool result {turn}: {turn * 7}"},
        ]
    canonical = [
        {**m, "token_ids": tokenizer.encode(m["content"])} if m["role"] == "assistant" else m for m in messages
    ]
    plain = [{k: v for k, v in m.items() if k != "token_ids"} for m in messages]
    got = post(server, "/v1/chat/completions/render", model="A", messages=canonical, chat_template=template).json()
    want = tokenizer.apply_chat_template(
        plain, chat_template=template, add_generation_prompt=True, tokenize=True, return_dict=False
    )
    assert got["prompt_token_ids"] == list(want)
    assert drifted  # so re-tokenizing the texts would have changed the tokens the model saw
    stats = httpx.get(f"{server}/v1/sessions/{session}").json()
    assert stats["requests"] == 5 and stats["prefix_cache_hit_rate"] > 0.5


def test_sglang_sessions_and_constraints_on_generate(server):
    sid = post(server, "/open_session", capacity_of_str_len=1000).json()
    ids = list(range(3, 40))
    for turn in range(3):
        out = post(
            server,
            "/generate",
            input_ids=ids,
            session_params={"id": sid},
            sampling_params={"max_new_tokens": 6, "temperature": 0},
        ).json()
        if turn:
            assert out["meta_info"]["cached_tokens"] > 0
        ids = ids + out["output_ids"] + [7, 8, 9]
    closed = post(server, "/close_session", session_id=sid).json()
    assert closed["success"] and closed["requests"] == 3 and closed["prefix_cache_hit_rate"] > 0.5
    assert post(server, "/close_session", session_id=sid).status_code == 404
    assert post(server, "/generate", text="hi", session_params={}).status_code == 400

    for key, value, check in [
        ("regex", "[a-c]{4}-[0-9]", lambda t: re.fullmatch("[a-c]{4}-[0-9]", t)),
        ("ebnf", 'root ::= "yes" | "no"', lambda t: t in ("yes", "no")),
        ("json_schema", json.dumps(ANSWER), lambda t: jsonschema.validate(json.loads(t), ANSWER) is None),
    ]:
        out = post(
            server,
            "/generate",
            text="Answer:",
            sampling_params={key: value, "max_new_tokens": 120, "temperature": 1.0, "sampling_seed": 4},
        )
        assert out.status_code == 200 and check(out.json()["text"]), (key, out.text)


@pytest.mark.parametrize(
    "parser, script, content",
    [
        ("llama3_json", '{"name": "add", "parameters": {"a": 1, "b": 2}}', None),
        ("mistral", 'Adding.[TOOL_CALLS][{"name": "add", "arguments": {"a": 1, "b": 2}}]', "Adding."),
    ],
)
def test_the_other_parsers_read_a_scripted_output_through_the_app(ckpts, parser, script, content):
    """llama3_json and mistral, served in process (the app on an AsyncLLMEngine, through httpx's ASGI transport):
    a scripted output is parsed into the call, whole and streamed, and required calls come in that format."""
    import asyncio

    from hotswap.engine.async_llm_engine import AsyncLLMEngine
    from hotswap.entrypoints.server import create_app
    from hotswap.entrypoints.server.state import ChatSettings

    engine = AsyncLLMEngine.from_kwargs(str(ckpts["A"]), kv_cache_memory_bytes=1 << 22)
    app = create_app(engine, "A", admin_auth="none", chat=ChatSettings(tool_call_parser=parser))

    async def run() -> None:
        http = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://localhost")
        client = openai.AsyncOpenAI(base_url="http://localhost/v1", api_key="none", http_client=http)
        body = dict(
            model="A",
            messages=USER,
            tools=TOOLS,
            max_tokens=100,
            temperature=0,
            extra_body={"structured_outputs": {"choice": [script]}},
        )
        whole = (await client.chat.completions.create(**body)).choices[0]
        assert (whole.finish_reason, whole.message.content) == ("tool_calls", content)
        assert [(c.function.name, json.loads(c.function.arguments)) for c in whole.message.tool_calls] == [
            ("add", {"a": 1, "b": 2})
        ]
        text, calls = "", []
        async for chunk in await client.chat.completions.create(**body, stream=True):
            text += chunk.choices[0].delta.content or ""
            calls += chunk.choices[0].delta.tool_calls or []
        assert (text or None, [c.function.name for c in calls]) == (content, ["add"])
        required = (
            await client.chat.completions.create(
                model="A",
                messages=USER,
                tools=TOOLS,
                max_tokens=150,
                tool_choice="required",
                temperature=1.0,
                seed=3,
                parallel_tool_calls=False,
            )
        ).choices[0]
        (call,) = required.message.tool_calls
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
        await http.aclose()

    async def main() -> None:
        try:
            await run()
        finally:
            await engine.shutdown()

    asyncio.run(main())
