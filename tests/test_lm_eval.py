"""lm-eval's own `local-completions` and `local-chat-completions` models against `hotswap serve`, on small local
tasks made here (loglikelihood, multiple choice, generate_until): the loglikelihoods lm-eval computes from the
server's echoed logprobs equal log_softmax of transformers' logits within 1e-4."""

from __future__ import annotations

import json

import pytest
import torch

from conftest import hf_model
from server_helpers import running_server

pytestmark = pytest.mark.slow

DOCS = [
    {"context": "one two three four", "target": "five", "choices": ["five", "cat", "blue"], "answer": 0},
    {"context": "the quick brown fox", "target": "jumps", "choices": ["sleeps", "jumps"], "answer": 1},
    {"context": "hello", "target": "world again", "choices": ["world", "there", "you all"], "answer": 2},
]


def write_tasks(root) -> None:
    data = root / "docs.jsonl"
    data.write_text("".join(json.dumps(d) + "\n" for d in DOCS))
    common = f"dataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {data}\ntest_split: test\n"
    (root / "hs_ll.yaml").write_text(
        "task: hs_ll\n" + common + "output_type: loglikelihood\ndoc_to_text: '{{context}}'\n"
        "doc_to_target: '{{target}}'\nmetric_list:\n  - metric: perplexity\n"
    )
    (root / "hs_mc.yaml").write_text(
        "task: hs_mc\n" + common + "output_type: multiple_choice\ndoc_to_text: '{{context}}'\n"
        "doc_to_choice: '{{choices}}'\ndoc_to_target: '{{answer}}'\nmetric_list:\n  - metric: acc\n"
    )
    (root / "hs_gen.yaml").write_text(
        "task: hs_gen\n" + common + "output_type: generate_until\ndoc_to_text: '{{context}}'\n"
        "doc_to_target: '{{target}}'\ngeneration_kwargs:\n  until: ['\\n']\n  max_gen_toks: 6\n"
        "  do_sample: false\nmetric_list:\n  - metric: exact_match\n"
    )


def loglikelihoods(samples: list[dict]) -> list[float]:
    return [float(resp[0]) for sample in samples for resp in sample["filtered_resps"]]


def test_lm_eval_local_completions_and_chat(ckpts, tmp_path):
    import lm_eval
    from lm_eval.api.registry import get_model
    from lm_eval.tasks import TaskManager

    write_tasks(tmp_path)
    path = str(ckpts["A"])
    with running_server(path, "--served-model-name", "A", "--kv-cache-memory-bytes", str(1 << 23)) as base:
        args = (
            f"model=A,base_url={base}/v1/completions,tokenizer={path},tokenized_requests=True,"
            "max_length=256,num_concurrent=1,max_retries=1,batch_size=2"
        )
        tasks = TaskManager(include_path=str(tmp_path))
        out = lm_eval.simple_evaluate(
            model="local-completions",
            model_args=args,
            tasks=["hs_ll", "hs_mc", "hs_gen"],
            task_manager=tasks,
            log_samples=True,
        )
        lm = get_model("local-completions").create_from_arg_string(args)
        model = hf_model(path)

        def reference(context: str, continuation: str) -> float:
            ctx, cont = lm._encode_pair(context, continuation)
            with torch.no_grad():
                logprobs = model(torch.tensor([ctx + cont])).logits[0].float().log_softmax(-1)
            return sum(logprobs[len(ctx) - 1 + i, t].item() for i, t in enumerate(cont))

        for task in ("hs_ll", "hs_mc"):  # every request lm-eval made: its (context, continuation) strings
            samples = sorted(out["samples"][task], key=lambda s: s["doc_id"])
            expected = [reference(ctx, cont) for sample in samples for ctx, cont in sample["arguments"]]
            assert loglikelihoods(samples) == pytest.approx(expected, abs=1e-4), task
        mc = sorted(out["samples"]["hs_mc"], key=lambda s: s["doc_id"])
        best = [max(range(len(s["arguments"])), key=lambda i, s=s: reference(*s["arguments"][i])) for s in mc]
        accuracy = sum(b == d["answer"] for b, d in zip(best, DOCS, strict=True)) / len(DOCS)
        assert out["results"]["hs_mc"]["acc,none"] == pytest.approx(accuracy)
        generations = [s["filtered_resps"][0] for s in sorted(out["samples"]["hs_gen"], key=lambda s: s["doc_id"])]
        tok = lm.tokenizer
        for doc, text in zip(DOCS, generations, strict=True):
            ids = tok.encode(doc["context"])
            with torch.no_grad():
                greedy = model.generate(torch.tensor([ids]), max_new_tokens=6, do_sample=False, pad_token_id=0)
            expected = tok.decode(greedy[0, len(ids) :].tolist()).split("\n")[0]
            assert text == expected

        chat_args = f"model=A,base_url={base}/v1/chat/completions,tokenizer={path},num_concurrent=1,max_retries=1"
        chat = lm_eval.simple_evaluate(
            model="local-chat-completions",
            model_args=chat_args,
            tasks=["hs_gen"],
            apply_chat_template=True,
            task_manager=tasks,
            log_samples=True,
        )
        replies = [s["filtered_resps"][0] for s in chat["samples"]["hs_gen"]]
        assert len(replies) == len(DOCS) and all(isinstance(r, str) for r in replies)
        assert "exact_match,none" in chat["results"]["hs_gen"]
