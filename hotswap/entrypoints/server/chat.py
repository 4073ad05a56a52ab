"""`/v1/chat/completions` (with tools, reasoning and structured outputs; whole or streamed) and
`/v1/chat/completions/render`, which returns the prompt token ids a chat request would run, without running it.

The prompt is the chat template's rendering of the messages (and tools: the template's own tool rendering where it
has one, else a system block that describes the tools in the tool-call parser's format). Tool calls are parsed
from the output text with the server's `--tool-call-parser`; `tool_choice` "required" or a named function adds a
grammar that makes the output a valid call in that format. `token_ids` are always the sampled tokens."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

from fastapi import APIRouter, Request

import hotswap.entrypoints.server.generation as generation
from hotswap.entrypoints import openai_protocol as oai
from hotswap.entrypoints.chat_output import ChoiceStream, parse_message
from hotswap.entrypoints.render import render_ids
from hotswap.entrypoints.server.openai import check_unicode, engine_prompt, usage_chunk
from hotswap.entrypoints.server.state import ApiError, ServerState, StateDep
from hotswap.entrypoints.tools import ToolParser, check_tools, tool_parser
from hotswap.outputs import CompletionOutput, RequestOutput

router = APIRouter()


def tools_block(tools: list[dict[str, Any]], parser: ToolParser) -> str:
    """A system-prompt description of `tools` and of how to call them, for templates without tool rendering."""
    lines = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
    example = {
        "hermes": '<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>',
        "llama3_json": '{"name": <function-name>, "parameters": <args-json-object>}',
        "mistral": '[TOOL_CALLS][{"name": <function-name>, "arguments": <args-json-object>}]',
    }[parser.name]
    return (
        f"You may call one or more of these functions:\n<tools>\n{lines}\n</tools>\n"
        f"To call a function, answer with:\n{example}"
    )


class ChatPlan:
    """A chat request made ready to run: its prompt token ids and how to read its output."""

    def __init__(self, body: oai.ChatCompletionRequest, state: ServerState) -> None:
        chat = state.chat
        callable_tools, choice = check_tools(body.tools, body.tool_choice)  # a named choice: that function alone
        self.tools = body.tools or []
        self.parser: ToolParser | None = None
        if choice == "auto":
            if chat.tool_call_parser is None:
                raise ValueError(
                    "tool_choice 'auto' needs the server started with --tool-call-parser "
                    "(hermes, llama3_json or mistral)"
                )
            self.parser = tool_parser(chat.tool_call_parser)
        elif choice is not None:  # required, or a named function: a grammar in the parser's format
            self.parser = tool_parser(chat.tool_call_parser or "hermes")
            if body.structured_outputs is not None:
                raise ValueError(
                    f"tool_choice {body.tool_choice!r} constrains the output already; drop "
                    "response_format / structured_outputs"
                )
            body.structured_outputs = {
                "grammar": self.parser.grammar(callable_tools, body.parallel_tool_calls and choice == "required")
            }
        # a constrained output (a schema, a required call) holds reasoning only where it marks it (<think>)
        self.reasoning = chat.reasoning_parser
        if body.structured_outputs is not None and self.reasoning is not None:
            self.reasoning = "qwen3"
        # tools are rendered whatever the choice (as vLLM does): an agent's turns keep one prompt prefix when its
        # tool_choice changes between them
        self.render_tools = bool(self.tools)
        self.body = body

    def messages(self, template: str) -> list[dict[str, Any]]:
        """The messages as the template takes them, with a system block describing the tools where `template`
        (its source) does not render them itself. Raises ValueError for content that is not valid Unicode."""
        messages = self.body.template_messages()
        for message in messages:
            check_unicode(message["content"], "a message's content")
        if self.render_tools and "tools" not in template:  # the template cannot show them: a system block does
            block = tools_block(self.tools, self.parser or tool_parser("hermes"))
            if messages and messages[0]["role"] == "system":
                messages[0] = {**messages[0], "content": messages[0]["content"] + "\n\n" + block}
            else:
                messages.insert(0, {"role": "system", "content": block})
        return messages

    def render(self, tokenizer: Any, vocab_size: int) -> list[int]:
        """The prompt's token ids, earlier turns' `token_ids` kept exactly (hotswap/entrypoints/render.py).
        Raises ValueError (a 400) for a template that cannot render these messages."""
        body = self.body
        template = str(body.chat_template or getattr(tokenizer, "chat_template", None) or "")
        try:
            return render_ids(
                tokenizer,
                self.messages(template),
                vocab_size,
                tools=self.tools if self.render_tools else None,
                chat_template=body.chat_template,
                add_generation_prompt=body.add_generation_prompt and not body.continue_final_message,
                continue_final_message=body.continue_final_message,
                **(body.chat_template_kwargs or {}),
            )
        except ValueError:
            raise
        except Exception as err:  # jinja errors
            raise ValueError(f"the chat template failed on these messages: {err}") from err

    @property
    def parses(self) -> bool:
        """Whether the output's text is read by a tool-call or reasoning parser."""
        return self.parser is not None or self.reasoning is not None

    def text(self, state: ServerState, c: CompletionOutput, token_ids: list[int]) -> str:
        """The text parsers read: the output decoded as the request asks, with special tokens kept where the
        parser's marker is one (llama3_json, mistral), the EOS or stop token that ended it dropped."""
        ids = list(token_ids)
        if ids and c.finish_reason == "stop" and not isinstance(c.stop_reason, str):  # ended by EOS or a stop token
            ids = ids[:-1]
        keep = self.parser is not None and self.parser.special_marker
        return state.engine.detokenizer.decode(ids, self.body.skip_special_tokens and not keep)


async def plan_of(body: oai.ChatCompletionRequest, state: ServerState) -> tuple[ChatPlan, list[int]]:
    try:
        plan = ChatPlan(body, state)
        ids = await asyncio.to_thread(plan.render, state.engine.tokenizer, state.vocab_size)  # off the event loop
    except ValueError as err:
        raise ApiError(400, str(err)) from err
    return plan, ids


@router.post("/v1/chat/completions/render")
async def render(body: oai.ChatCompletionRequest, state: StateDep) -> dict[str, object]:
    """The prompt token ids (and text) `/v1/chat/completions` would run for this body; nothing is generated."""
    await state.model_lora(body.model)  # the served model or a loaded adapter (the rendering is the same)
    _, ids = await plan_of(body, state)
    return {"prompt_token_ids": ids, "prompt": state.engine.tokenizer.decode(ids), "count": len(ids)}


@router.post("/v1/chat/completions")
async def chat_completions(body: oai.ChatCompletionRequest, http: Request, state: StateDep) -> object:
    lora = await state.model_lora(body.model)
    name, vocab = body.model, state.vocab_size
    top_n = body.top_logprobs or 0
    top_n = vocab if top_n == -1 else top_n
    plan, ids = await plan_of(body, state)
    try:
        params = oai.sampling_params(
            body, top_n if body.logprobs else None, body.max_completion_tokens or body.max_tokens, vocab
        )
        state.check_limits(body.stop, params)
        if body.stream and params.prompt_logprobs is not None:
            raise ValueError("prompt_logprobs are not available with stream=true")
    except ValueError as err:
        raise ApiError(400, str(err)) from err
    shape = oai.Shape.of(body, params=params)
    request_id = oai.new_id("chatcmpl")
    created = int(time.time())
    streams: dict[int, ChoiceStream] = {}
    counts = {"prompt": 0, "completion": 0}

    def chunk(out: RequestOutput) -> dict[str, Any]:
        counts["prompt"], counts["cached"] = len(out.prompt_token_ids), out.num_cached_tokens
        counts["completion"] += sum(len(c.token_ids) for c in out.outputs)
        choices = []
        for c in out.outputs:
            first = c.index not in streams
            stream = streams.setdefault(c.index, ChoiceStream(plan.parser, plan.reasoning))
            delta: dict[str, Any] = {"role": "assistant"} if first else {}
            finish = c.finish_reason
            if plan.parses:
                stream.token_ids += c.token_ids
                text = plan.text(state, c, stream.token_ids)
                if c.finish_reason is None:
                    text = text.rstrip("\ufffd")  # a character still incomplete
                delta.update(stream.delta(text, c.finish_reason is not None))
                if finish == "stop" and stream.sent_calls:
                    finish = "tool_calls"
            else:
                delta["content"] = c.text
            choice = {
                "index": c.index,
                "delta": delta,
                "logprobs": oai.chat_logprobs(c, top_n, shape),
                **oai.compact_logprobs_fields(c, shape),
                "finish_reason": finish,
                "weight_versions": oai.spans(c, shape),
                **oai.lora_fields(out, c, shape),
                **oai.replay_fields(c),
            }
            if shape.token_ids:
                choice["token_ids"] = list(c.token_ids)
            choices.append(choice)
        response = {
            "id": request_id,
            "object": "chat.completion.chunk",
            "created": created,
            "model": name,
            "choices": choices,
        }
        if shape.token_ids and not counts.get("sent_prompt"):  # the first chunk carries the prompt's ids
            response["prompt_token_ids"] = list(out.prompt_token_ids)
            counts["sent_prompt"] = 1
        return response

    def full(out: RequestOutput) -> dict[str, Any]:
        response = oai.chat_response(out, name, request_id, top_n, shape)
        if plan.parses:
            for choice, c in zip(response["choices"], out.outputs, strict=True):
                message = parse_message(plan.text(state, c, list(c.token_ids)), plan.parser, plan.reasoning)
                choice["message"] = message.json()
                if message.calls and c.finish_reason == "stop":
                    choice["finish_reason"] = "tool_calls"
        response.update(oai.prompt_logprobs_fields(out, shape))
        return response

    include_usage = body.stream_options is not None and body.stream_options.include_usage
    running = await generation.start(state, engine_prompt(ids, body.cache_salt), params, request_id, http, lora)
    if not body.stream:
        return full(await running.collect())
    return running.stream(
        chunk,
        (lambda: usage_chunk(name, request_id, created, "chat.completion.chunk", counts)) if include_usage else None,
    )
