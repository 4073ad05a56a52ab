"""Delta updates (docs/weight-sync.md): xor, sparse and overwrite deltas over every transport and through
reload_weights, each bitwise equal to the full update it encodes; a delta on the wrong base version refused before
anything moves; the trainer's checksums verified (a mismatch rolls back); fp8 layers re-quantized only where a
delta wrote; the trainer's encoder skipping what did not change."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from hotswap import LLM, SamplingParams
from hotswap.transfer.delta import DeltaEncoder, sparse_delta, xor_delta
from hotswap.weights.checksum import tensor_sha256
from hotswap.weights.delta import INDICES, VALUES
from transfer_helpers import BACKENDS, Pusher

KV = 1 << 22
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


def tensors_of(path: Path) -> dict[str, torch.Tensor]:
    return dict(load_file(str(path / "model.safetensors")))


def perturbed(
    base: dict[str, torch.Tensor], fraction: float, seed: int, skip_every: int = 3
) -> dict[str, torch.Tensor]:
    """`base` with `fraction` of the elements of two in three tensors changed (the others identical)."""
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for i, (name, t) in enumerate(sorted(base.items())):
        new = t.clone()
        if i % skip_every:
            mask = torch.rand(t.shape, generator=gen) < fraction
            new[mask] += 0.01 * torch.randn(int(mask.sum()), generator=gen)
        out[name] = new
    return out


def delta_of(
    encoding: str, old: dict[str, torch.Tensor], new: dict[str, torch.Tensor]
) -> list[tuple[str, torch.Tensor]]:
    """The tensors a sender sends for `encoding` (unchanged tensors left out)."""
    out: list[tuple[str, torch.Tensor]] = []
    for name in sorted(new):
        if torch.equal(old[name], new[name]):
            continue
        if encoding == "xor":
            out.append((name, xor_delta(old[name], new[name])))
        elif encoding == "sparse":
            indices, values = sparse_delta(old[name], new[name])
            out += [(name + INDICES, indices), (name + VALUES, values)]
        else:
            out.append((name, new[name]))
    return out


def sums(llm: LLM) -> dict[str, str]:
    return llm.collective_rpc("weight_checksums")[0]


def expected_sums(tensors: dict[str, torch.Tensor], llm: LLM) -> dict[str, str]:
    return {name: tensor_sha256(tensors[name]) for name in sums(llm)}


@pytest.fixture(scope="module")
def states(ckpts):
    a = tensors_of(ckpts["A"])
    return {"A": a, "B": perturbed(a, 0.02, seed=0)}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("encoding", ["xor", "sparse", "overwrite"])
def test_a_delta_over_each_transport_equals_the_full_update(ckpts, states, backend, encoding):
    llm = LLM(str(ckpts["A"]), kv_cache_memory_bytes=KV)
    pusher = Pusher(llm, backend)
    try:
        named = delta_of(encoding, states["A"], states["B"])
        pusher.push(named, extra={"encoding": encoding, "base_version": 0})
    finally:
        pusher.close()
    assert sums(llm) == expected_sums(states["B"], llm)
    assert llm.get_weight_version() == 1


@pytest.mark.parametrize("encoding", ["xor", "sparse"])
def test_reload_weights_takes_a_delta_and_generates_as_a_fresh_engine(ckpts, states, tmp_path, encoding):
    llm = LLM(str(ckpts["A"]), kv_cache_memory_bytes=KV)
    llm.reload_weights(
        weights_iterator=delta_of(encoding, states["A"], states["B"]),
        encoding=encoding,
        base_version=0,
        checksums={n: tensor_sha256(t) for n, t in states["B"].items() if not torch.equal(t, states["A"][n])},
    )
    assert sums(llm) == expected_sums(states["B"], llm)
    folder = tmp_path / "B"
    folder.mkdir()
    for f in ckpts["A"].iterdir():
        if f.suffix != ".safetensors":
            (folder / f.name).write_bytes(f.read_bytes())
    save_file({n: t.contiguous() for n, t in states["B"].items()}, str(folder / "model.safetensors"))
    fresh = LLM(str(folder), kv_cache_memory_bytes=KV)
    prompts = ["the quick brown fox", "hello world"]
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)] == [
        o.outputs[0].token_ids for o in fresh.generate(prompts, GREEDY, use_tqdm=False)
    ]


def test_a_folder_of_deltas_reloads_by_path(ckpts, states, tmp_path):
    llm = LLM(str(ckpts["A"]), kv_cache_memory_bytes=KV)
    folder = tmp_path / "delta"
    folder.mkdir()
    save_file(
        {n: t.contiguous() for n, t in delta_of("xor", states["A"], states["B"])}, str(folder / "model.safetensors")
    )
    llm.reload_weights(weights_path=str(folder), encoding="xor", base_version="0")
    assert sums(llm) == expected_sums(states["B"], llm)


def test_a_delta_on_another_base_version_is_refused_before_anything_moves(ckpts, states):
    llm = LLM(str(ckpts["A"]), kv_cache_memory_bytes=KV)
    before = sums(llm)
    named = delta_of("xor", states["A"], states["B"])
    with pytest.raises(ValueError, match=r"applies on top of version '7'.*serves version '0'"):
        llm.reload_weights(weights_iterator=named, encoding="xor", base_version=7)
    pusher = Pusher(llm, "shm")
    try:
        with pytest.raises(ValueError, match=r"applies on top of version 'step-3'.*serves version '0'"):
            pusher.push(named, extra={"encoding": "xor", "base_version": "step-3"})
        assert sums(llm) == before and llm.get_weight_version() == 0
        pusher.push(named, weight_version="step-1", extra={"encoding": "xor", "base_version": 0})
        second = perturbed(states["B"], 0.01, seed=5)
        pusher.push(delta_of("sparse", states["B"], second), extra={"encoding": "sparse", "base_version": "step-1"})
    finally:
        pusher.close()
    assert sums(llm) == expected_sums(second, llm)
    assert llm.generate(["hello"], GREEDY, use_tqdm=False)[0].outputs[0].token_ids  # still serving


@pytest.mark.parametrize("encoding", ["xor", "sparse"])
@pytest.mark.parametrize("backend", ["tensors", "shm"])
def test_a_checksum_mismatch_rolls_back(ckpts, states, backend, encoding):
    """The trainer's digest of a result differs: everything the update wrote (sparse: the elements patched in
    place) is restored bit for bit."""
    llm = LLM(str(ckpts["A"]), kv_cache_memory_bytes=KV)
    before = sums(llm)
    named = delta_of(encoding, states["A"], states["B"])
    changed = sorted({n.removesuffix(INDICES).removesuffix(VALUES) for n, _ in named})
    checksums = {n: tensor_sha256(states["B"][n]) for n in changed}
    checksums[changed[-1]] = tensor_sha256(states["A"][changed[-1]])  # the trainer meant another result
    pusher = Pusher(llm, backend)
    try:
        with pytest.raises(ValueError, match=f"checksum mismatch.*{changed[-1]}.*restored"):
            pusher.push(named, extra={"encoding": encoding, "checksums": checksums})
    finally:
        pusher.close()
    assert sums(llm) == before and llm.get_weight_version() == 0


def test_a_streamed_sparse_delta_failing_midway_restores_the_patched_elements(ckpts, states):
    """Over torch_dist (a stream) the patches are written as they arrive; a NaN in a later tensor undoes the earlier
    patches."""
    llm = LLM(str(ckpts["A"]), kv_cache_memory_bytes=KV)
    before = sums(llm)
    named = delta_of("sparse", states["A"], states["B"])
    last_values = len(named) - 1
    bad = named[last_values][1].clone()
    bad[0] = float("nan")
    named[last_values] = (named[last_values][0], bad)
    pusher = Pusher(llm, "torch_dist")
    try:
        with pytest.raises(ValueError, match="NaN"):
            pusher.push(named, extra={"encoding": "sparse"})
    finally:
        pusher.close()
    assert sums(llm) == before


@pytest.mark.parametrize(
    "bad, message",
    [
        ("dtype", "an xor delta of torch.float32 weights is torch.int32"),
        ("shape", "wrong shape"),
        ("twice", "sent twice in one delta update"),
        ("values_alone", "partner never arrived"),
        ("index_range", "sparse indices outside"),
        ("encoding", "unknown encoding 'zstd'"),
    ],
)
def test_malformed_deltas_are_refused_and_change_nothing(ckpts, states, bad, message):
    llm = LLM(str(ckpts["A"]), kv_cache_memory_bytes=KV)
    before = sums(llm)
    name = next(n for n, t in sorted(states["B"].items()) if not torch.equal(t, states["A"][n]))
    xor = xor_delta(states["A"][name], states["B"][name])
    indices, values = sparse_delta(states["A"][name], states["B"][name])
    encoding, named = "xor", [(name, xor)]
    if bad == "dtype":
        named = [(name, xor.view(torch.float32))]
    elif bad == "shape":
        named = [(name, xor.reshape(-1))]
    elif bad == "values_alone":
        encoding, named = "sparse", [(name + VALUES, values)]
    elif bad == "index_range":
        encoding, named = "sparse", [(name + INDICES, indices + 10**9), (name + VALUES, values)]
    elif bad == "encoding":
        encoding = "zstd"
    pusher = Pusher(llm, "tensors")
    try:
        llm.start_weight_update()
        if bad == "twice":
            pusher.update(named, {"encoding": encoding})
            named = [(name, xor)]
        with pytest.raises(ValueError, match=message):
            pusher.update(named, {"encoding": encoding})
            llm.finish_weight_update()
    finally:
        pusher.close()
    assert sums(llm) == before


def test_fp8_layers_take_whole_tensors_and_requantize_only_what_was_written(ckpts, states):
    llm = LLM(str(ckpts["A"]), kv_cache_memory_bytes=KV, quantization="fp8")
    before = sums(llm)
    name = "model.layers.0.mlp.down_proj.weight"
    with pytest.raises(ValueError, match=r"fp8.*encoding .overwrite."):
        llm.reload_weights(weights_iterator=[(name, xor_delta(states["A"][name], states["B"][name]))], encoding="xor")
    assert sums(llm) == before
    new = tensors_of(ckpts["B"])[name]  # other weights altogether: every fp8 value of it changes
    llm.reload_weights(weights_iterator=[(name, new)], encoding="overwrite", base_version=0)
    after = sums(llm)
    changed = {n for n in after if after[n] != before[n]}
    assert changed == {name}  # only the written projection was re-quantized (its scale lives with it)
    reference = LLM(str(ckpts["A"]), kv_cache_memory_bytes=KV, quantization="fp8")
    reference.reload_weights(weights_iterator=[(name, new)])
    assert sums(reference)[name] == after[name]


def test_the_trainer_encoder_sends_only_what_changed(ckpts, states):
    llm = LLM(str(ckpts["A"]), kv_cache_memory_bytes=KV)
    pusher = Pusher(llm, "shm")
    encoder = DeltaEncoder("sparse", dtype=torch.float32, checksums=True)
    try:
        state = states["A"]
        for step in range(3):
            named, extra = encoder.encode(state.items())
            if step == 0:
                assert "encoding" not in extra and encoder.last_bytes == encoder.last_full_bytes
            else:
                assert extra["encoding"] == "sparse" and extra["base_version"] == step
                assert encoder.last_bytes < 0.2 * encoder.last_full_bytes
            pusher.push(named, extra=extra)
            encoder.committed(llm.get_weight_version())
            assert sums(llm) == expected_sums(state, llm)
            state = perturbed(state, 0.02, seed=10 + step)
    finally:
        pusher.close()
    xor = DeltaEncoder("xor")
    xor.encode(states["A"].items())
    xor.committed(0)
    named, extra = xor.encode(states["B"].items())
    unchanged = [n for n in states["B"] if torch.equal(states["A"][n], states["B"][n])]
    assert unchanged and not {n for n, _ in named} & set(unchanged)
    assert all(t.dtype == torch.int32 for _, t in named)


@pytest.mark.cpu_only
def test_deltas_over_the_http_routes(ckpts, states, tmp_path):
    """hotswap's session routes (AdminClient with a DeltaEncoder over shm), SGLang's /update_weights_from_disk
    and vLLM's /reload_weights with a folder of deltas; a wrong base version is a 400 naming both versions."""
    import httpx

    from hotswap.entrypoints.client import AdminClient
    from hotswap.testing import running_server

    def folder(name: str, named: list[tuple[str, torch.Tensor]]) -> str:
        where = tmp_path / name
        where.mkdir()
        save_file({n: t.contiguous() for n, t in named}, str(where / "model.safetensors"))
        return str(where)

    c = perturbed(states["B"], 0.02, seed=7)
    d = perturbed(c, 0.02, seed=8)
    with running_server(str(ckpts["A"]), "--admin-key", "k", "--kv-cache-memory-bytes", str(KV)) as (base, _):
        client = AdminClient(base, admin_key="k")
        headers = {"Authorization": "Bearer k"}
        try:
            encoder = DeltaEncoder("sparse", dtype=torch.float32, checksums=True)
            for target in (states["B"], c):
                named, extra = encoder.encode(target.items())
                version = client.push_weights(named, delta=extra or None)
                encoder.committed(version)
            assert client.verify(list(c.items())) == []
            assert encoder.last_bytes < 0.2 * encoder.last_full_bytes
            # SGLang: a folder of xor deltas on top of the served version
            served = client.get_weight_version()
            body = {"model_path": folder("cd", delta_of("xor", c, d)), "encoding": "xor", "base_version": "nope"}
            refused = httpx.post(f"{base}/update_weights_from_disk", json=body, headers=headers, timeout=60)
            assert refused.status_code == 400 and "'nope'" in refused.text and f"'{served}'" in refused.text
            assert client.verify(list(c.items())) == []
            ok = httpx.post(
                f"{base}/update_weights_from_disk", json={**body, "base_version": served}, headers=headers, timeout=60
            )
            assert ok.status_code == 200 and ok.json()["success"], ok.text
            assert client.verify(list(d.items())) == []
            # vLLM-style /reload_weights with a sparse folder back to B
            body = {
                "weights_path": folder("db", delta_of("sparse", d, states["B"])),
                "encoding": "sparse",
                "base_version": client.get_weight_version(),
            }
            assert httpx.post(f"{base}/reload_weights", json=body, headers=headers, timeout=60).status_code == 200
            assert client.verify(list(states["B"].items())) == []
        finally:
            client.close()


def test_a_sparse_pair_may_span_two_update_calls_but_must_complete(ckpts, states):
    """A sender that batches by size may put a pair's indices and values in different update_weights calls of
    one session: they meet; a half whose partner never comes fails the finish, rolled back."""
    llm = LLM(str(ckpts["A"]), kv_cache_memory_bytes=KV)
    before = sums(llm)
    named = delta_of("sparse", states["A"], states["B"])
    pusher = Pusher(llm, "shm")
    try:
        llm.start_weight_update()
        pusher.update(named[:3], {"encoding": "sparse"})  # the second pair's values come in the next call
        pusher.update(named[3:], {"encoding": "sparse"})
        llm.finish_weight_update()
        assert sums(llm) == expected_sums(states["B"], llm)
        back = delta_of("sparse", states["B"], states["A"])
        llm.start_weight_update()
        pusher.update(back[:-1], {"encoding": "sparse"})
        with pytest.raises(ValueError, match=r"partner never arrived.*restored"):
            llm.finish_weight_update()
    finally:
        pusher.close()
    assert sums(llm) == expected_sums(states["B"], llm) != before
