"""The executor door (collective_rpc, apply_model) and the scoped config context around worker entry points."""

from __future__ import annotations

import inspect

import pytest
import torch

from hotswap import LLM, EngineConfig, current_config, use_config
from hotswap.worker.worker import Worker


@pytest.fixture(scope="module")
def llm(llama_dir):
    return LLM(str(llama_dir), kv_cache_memory_bytes=1 << 22)


def test_current_config_outside_scope_raises():
    with pytest.raises(RuntimeError, match="outside a config scope"):
        current_config()


def test_use_config_nests_and_restores_on_error(llama_dir):
    a = EngineConfig.from_kwargs(str(llama_dir))
    b = EngineConfig.from_kwargs(str(llama_dir), block_size=8)
    with use_config(a):
        assert current_config() is a
        with pytest.raises(KeyError), use_config(b):
            assert current_config() is b
            raise KeyError("boom")
        assert current_config() is a
    with pytest.raises(RuntimeError):
        current_config()


def test_collective_rpc_by_name_and_callable(llm):
    assert llm.collective_rpc("determine_num_kv_blocks") == [llm.config.cache_config.num_kv_blocks]
    assert llm.collective_rpc(lambda worker, x, y=0: (worker.rank, x + y), args=(2,), kwargs={"y": 3}) == [(0, 5)]
    with pytest.raises(ValueError, match="no public method"):
        llm.collective_rpc("_runner")


def test_apply_model_gets_the_module(llm):
    (n_params,) = llm.apply_model(lambda model: sum(p.numel() for p in model.parameters()))
    assert n_params > 0
    (is_module,) = llm.apply_model(lambda model: isinstance(model, torch.nn.Module))
    assert is_module


def public_worker_methods() -> list[str]:
    return [name for name, fn in inspect.getmembers(Worker, inspect.isfunction) if not name.startswith("_")]


def test_every_public_worker_method_runs_in_the_config_scope(llm, monkeypatch):
    """Each public Worker method sees the worker's config through current_config(), on success and on error,
    and leaves no config active afterwards. The probe replaces what the method calls first."""
    worker: Worker = llm.llm_engine.executor.worker
    seen: list[tuple[str, EngineConfig]] = []

    def probe(label: str, fail: bool, result: object = 1):
        def fn(*args, **kwargs):
            seen.append((label, current_config()))
            if fail:
                raise RuntimeError("probe failure")
            return result

        return fn

    calls = {
        "load_model": lambda: worker.load_model(),
        "determine_num_kv_blocks": lambda: worker.determine_num_kv_blocks(),
        "initialize_cache": lambda: worker.initialize_cache(4),
        "execute_model": lambda: worker.execute_model(None),
        "execute_method": lambda: worker.execute_method(lambda w: probe("execute_method", FAIL[0])()),
    }
    assert sorted(calls) == sorted(public_worker_methods()), "a public Worker method has no scope check here"
    runner = worker.runner
    FAIL = [False]
    for fail in (False, True):
        FAIL[0] = fail
        seen.clear()
        with monkeypatch.context() as m:
            m.setattr("hotswap.worker.worker.build_model", probe("load_model", fail, runner.model))
            m.setattr(runner, "bytes_per_block", probe("determine_num_kv_blocks", fail))
            m.setattr(runner, "allocate_kv_cache", probe("initialize_cache", fail))
            m.setattr(runner, "execute", probe("execute_model", fail))
            for _name, call in calls.items():
                worker.runner = runner
                if fail:
                    with pytest.raises(RuntimeError, match="probe failure"):
                        call()
                else:
                    call()
                with pytest.raises(RuntimeError, match="outside a config scope"):
                    current_config()
        assert [label for label, _ in seen] == list(calls)
        assert all(cfg is worker.config for _, cfg in seen)
    worker.runner = runner
