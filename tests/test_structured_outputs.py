"""Grammar-constrained decoding (hotswap/engine/grammar.py): outputs match their JSON schema, regex, choice or
grammar on a random-weight model; greedy under a grammar is transformers' argmax over the allowed tokens;
unconstrained rows batched with constrained ones are untouched; speculative decoding and n>1 stay exact; invalid
constraints are refused by name."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
import torch

from conftest import hf_model
from hotswap import LLM, SamplingParams
from hotswap.structured_outputs import StructuredOutputsParams

KV = 1 << 23
SCHEMA = {
    "type": "object",
    "properties": {
        "ok": {"type": "boolean"},
        "count": {"type": "integer", "minimum": 0, "maximum": 99},
        "color": {"enum": ["red", "green", "blue"]},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3},
    },
    "required": ["ok", "count", "color"],
    "additionalProperties": False,
}
GBNF = 'root ::= "move " dir " " num\ndir ::= "left" | "right"\nnum ::= [1-9] [0-9]?'
LARK = 'start: "(" item ("," item)* ")"\nitem: /[a-c]{1,3}/'


@pytest.fixture(scope="module")
def llm(llama_dir):
    return LLM(str(llama_dir), kv_cache_memory_bytes=KV)


def outputs(llm, constraint, n=3, seed=7, max_tokens=200, prompts=("Hello there", "The weather is")):
    params = SamplingParams(temperature=1.0, n=n, seed=seed, max_tokens=max_tokens, structured_outputs=constraint)
    return [c for out in llm.generate(list(prompts), params, use_tqdm=False) for c in out.outputs]


@pytest.mark.parametrize(
    "constraint, valid",
    [
        ({"json": SCHEMA}, lambda text: jsonschema.validate(json.loads(text), SCHEMA) is None),
        (
            {"json": json.dumps(SCHEMA), "disable_any_whitespace": True},
            lambda text: jsonschema.validate(json.loads(text), SCHEMA) is None and not re.search(r"\s", text),
        ),
        ({"regex": r"[a-z]{2,5}-[0-9]{2}"}, lambda text: re.fullmatch(r"[a-z]{2,5}-[0-9]{2}", text) is not None),
        ({"choice": ["yes", "no", "maybe so"]}, lambda text: text in ("yes", "no", "maybe so")),
        ({"grammar": GBNF}, lambda text: re.fullmatch(r"move (left|right) [1-9][0-9]?", text) is not None),
        ({"grammar": LARK}, lambda text: re.fullmatch(r"\([a-c]{1,3}(,[a-c]{1,3})*\)", text) is not None),
    ],
    ids=["json", "json-compact", "regex", "choice", "gbnf", "lark"],
)
def test_sampled_outputs_match_their_constraint_and_end_with_eos(llm, constraint, valid):
    eos = llm.llm_engine.eos_token_ids
    for c in outputs(llm, constraint):
        assert c.finish_reason == "stop" and c.token_ids[-1] in eos, (c.text, c.finish_reason)
        assert valid(c.text), c.text


def test_greedy_under_a_grammar_is_transformers_argmax_over_the_allowed_tokens(llm, llama_dir):
    """Each token is transformers' argmax after the grammar's mask (computed here by a fresh llguidance matcher
    stepping along), so the mask is applied to the right row and token, and nothing else changes the choice."""
    import llguidance

    constraint = StructuredOutputsParams(json=SCHEMA)
    ids = llm.get_tokenizer().encode("Hello there")
    out = llm.generate(
        {"prompt_token_ids": ids},
        SamplingParams(temperature=0, max_tokens=80, structured_outputs=constraint),
        use_tqdm=False,
    )[0]
    grammars = llm.llm_engine.grammars
    matcher = llguidance.LLMatcher(grammars.tokenizer, grammars.compile(constraint))
    model, expected, seq = hf_model(str(llama_dir)), [], list(ids)
    with torch.no_grad():
        while len(expected) < len(out.outputs[0].token_ids):
            logits = model(torch.tensor([seq])).logits[0, -1].float()
            words = grammars.mask(matcher)
            allowed = ((words.to(torch.int64)[:, None] >> torch.arange(32)) & 1).flatten()[: logits.shape[0]].bool()
            token = int(logits.masked_fill(~allowed, float("-inf")).argmax())
            expected.append(token)
            seq.append(token)
            matcher.consume_token(token)
    assert out.outputs[0].token_ids == expected
    assert matcher.is_stopped() and expected[-1] in llm.llm_engine.eos_token_ids  # complete, then only EOS
    json.loads(out.outputs[0].text)


def test_unconstrained_rows_in_the_batch_are_untouched_and_the_sampling_mask_is_the_grammars(llm):
    plain = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=2)
    alone = llm.generate(["numbers 1 2 3 4"], plain, use_tqdm=False)[0].outputs[0]
    constrained = SamplingParams(
        temperature=1.0, seed=3, max_tokens=40, return_sampling_mask=True, structured_outputs={"choice": ["yes", "no"]}
    )
    mixed = llm.generate(["numbers 1 2 3 4", "Hello there"], [plain, constrained], use_tqdm=False)
    assert mixed[0].outputs[0].token_ids == alone.token_ids
    for got, want in zip(mixed[0].outputs[0].logprobs, alone.logprobs, strict=True):
        assert got.keys() == want.keys()
        # 1e-4, as between batch compositions elsewhere: which product routine a 1- or 2-row step takes depends
        # on the CPU (measured 9.5e-6 at worst); a mask on the wrong row moves a logprob by order 1
        assert all(abs(got[t].logprob - want[t].logprob) < 1e-4 for t in got)
    out = mixed[1].outputs[0]
    tok = llm.get_tokenizer()
    first = set(out.sampling_mask.token_ids[out.sampling_mask.offsets[0] : out.sampling_mask.offsets[1]])
    # every token the grammar allows first spells a prefix of "yes" or "no" (and at least their first letters)
    assert first and all("yes".startswith(tok.decode([t])) or "no".startswith(tok.decode([t])) for t in first)
    assert {tok.encode("y")[0], tok.encode("n")[0]} <= first


def test_speculative_decoding_and_n_samples_stay_exact_under_a_grammar(llama_dir):
    """Constrained sequences do not speculate (a proposal's mask would depend on the proposals before it), so
    seeded outputs are the same with prompt-lookup speculation on; each of n samples equals the same sample asked
    alone... through its seed, index and position."""
    params = SamplingParams(temperature=1.0, n=3, seed=11, max_tokens=120, structured_outputs={"json": SCHEMA})
    plain = LLM(str(llama_dir), kv_cache_memory_bytes=KV)
    spec = LLM(
        str(llama_dir),
        kv_cache_memory_bytes=KV,
        speculative_config={"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3},
    )
    unconstrained = SamplingParams(temperature=1.0, seed=5, max_tokens=30, ignore_eos=True)
    want = plain.generate(["Hello there", "numbers 1 2 3 1 2 3 1 2"], [params, unconstrained], use_tqdm=False)
    got = spec.generate(["Hello there", "numbers 1 2 3 1 2 3 1 2"], [params, unconstrained], use_tqdm=False)
    assert [c.token_ids for c in got[0].outputs] == [c.token_ids for c in want[0].outputs]
    assert got[1].outputs[0].token_ids == want[1].outputs[0].token_ids
    assert got[1].outputs[0].spec_stats.num_draft_tokens > 0  # the unconstrained row did speculate
    assert got[0].outputs[0].spec_stats.num_draft_tokens == 0
    assert len({tuple(c.token_ids) for c in want[0].outputs}) > 1  # the samples differ from one another
    for c in want[0].outputs:
        jsonschema.validate(json.loads(c.text), SCHEMA)


@pytest.mark.parametrize(
    "constraint, message",
    [
        ({"json": {"type": "frobnicate"}}, "invalid structured output (json_schema)"),
        ({"regex": "(ab"}, "invalid structured output (regex)"),
        ({"grammar": "root ::= missing_rule"}, "invalid structured output (grammar)"),
        ({"json": "{not json"}, "not valid JSON"),
        ({"regex": "a", "choice": ["b"]}, "exactly one of"),
        ({"choice": []}, "choice must be a non-empty list"),
        ({"jsonn": {}}, "unknown field"),
    ],
)
def test_invalid_constraints_are_refused_naming_the_problem(llm, constraint, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        llm.generate("hi", SamplingParams(max_tokens=4, structured_outputs=constraint), use_tqdm=False)
    assert llm.llm_engine.requests == {}
