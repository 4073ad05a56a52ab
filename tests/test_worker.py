"""The executor door (collective_rpc, apply_model) and the scoped config context around worker entry points."""

from __future__ import annotations

import inspect
from types import SimpleNamespace

import pytest
import torch

from conftest import PROMPTS
from hotswap import LLM, EngineConfig, SamplingParams, current_config, use_config
from hotswap.transfer.tensors import TensorsEngine, tensors_update_info
from hotswap.weights.index import WeightIndex
from hotswap.weights.update import WeightUpdate
from hotswap.wire import ModelInput
from hotswap.worker.commands import AdapterPart, Load, StartUpdate
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


def scope_cases(worker: Worker, probe):
    """method name -> (setup, patch, call). `patch(m)` swaps in `probe(label, result)` at a point the method
    reaches inside its body: a collaborator, or a layer's post-processing hook (which reads current_config())."""
    model, runner = worker.model, worker.runner
    norm_w = model.model.norm.weight.detach().clone()
    q_w = model.model.layers[0].self_attn.qkv_proj.weight.detach()[:64].clone()
    norm_update = tensors_update_info([("model.norm.weight", norm_w)])
    q_update = tensors_update_info([("model.layers.0.self_attn.q_proj.weight", q_w)])

    def session(update=None):
        def setup():
            worker.init_weight_transfer_engine({"backend": "tensors"})
            if update is not None:
                worker.start_weight_update()
                if update:
                    worker.update_weights(update)

        return setup

    def staged(update, advance=False):
        """A staged session whose `update` is opened for slices (and, `advance`, received)."""

        def setup():
            worker.config.weight_transfer_config.update_staging = "shadow"
            try:
                session()()
                worker.start_weight_update()
                worker.update_weights(update, sliced=True)
                if advance:
                    worker.advance_weight_update()
            finally:
                worker.config.weight_transfer_config.update_staging = "in_place"

        return setup

    qkv = model.model.layers[0].self_attn.qkv_proj
    return {
        "advance_weight_update": (
            staged(norm_update),
            lambda m, p: m.setattr(model.model.norm, "process_weights_after_loading", p(), raising=False),
            worker.advance_weight_update,
        ),
        "view_staged": (
            staged(norm_update, advance=True),
            lambda m, p: m.setattr(worker.session.update.shadow, "swap_in", p()),
            lambda: worker.view_staged(True),
        ),
        "load_model": (None, lambda m, p: m.setattr("hotswap.worker.worker.build_model", p(model)), worker.load_model),
        "determine_num_kv_blocks": (
            None,
            lambda m, p: m.setattr(runner, "bytes_per_block", p(1024)),
            worker.determine_num_kv_blocks,
        ),
        "initialize_cache": (
            None,
            lambda m, p: m.setattr(runner, "allocate_kv_cache", p()),
            lambda: worker.initialize_cache(4),
        ),
        "execute_model": (
            None,
            lambda m, p: m.setattr(runner, "execute", p()),
            lambda: worker.execute_model(ModelInput([], [], [], [], [], [], [])),
        ),
        "execute_method": (
            None,
            lambda m, p: m.setattr(worker, "_probe", p(), raising=False),
            lambda: worker.execute_method(lambda w: w._probe()),
        ),
        "reload_weights": (
            None,
            lambda m, p: m.setattr(model.model.norm, "process_weights_after_loading", p(), raising=False),
            lambda: worker.reload_weights(weights_iterator=[("model.norm.weight", norm_w)]),
        ),
        "update_config": (
            None,
            lambda m, p: m.setattr(worker.config, "with_overrides", p({})),
            lambda: worker.update_config({}),
        ),
        "init_weight_transfer_engine": (
            None,
            lambda m, p: m.setattr(
                "hotswap.worker.session.create_engine",
                p(TensorsEngine({}, worker.config.weight_transfer_config)),
            ),
            lambda: worker.init_weight_transfer_engine({"backend": "tensors"}),
        ),
        "weight_transfer_ready": (
            session(),
            lambda m, p: m.setattr(worker.session.engine, "ready", p(True)),
            worker.weight_transfer_ready,
        ),
        "start_weight_update": (
            session(),
            lambda m, p: m.setattr(
                "hotswap.worker.session.WeightUpdate", p(WeightUpdate(WeightIndex.of(model), True, True))
            ),
            worker.start_weight_update,
        ),
        "update_weights": (
            session(update={}),
            lambda m, p: m.setattr(model.model.norm, "process_weights_after_loading", p(), raising=False),
            lambda: worker.update_weights(norm_update),
        ),
        "finish_weight_update": (
            session(update=q_update),  # q alone leaves qkv_proj pending until finish
            lambda m, p: m.setattr(qkv, "process_weights_after_loading", p()),
            worker.finish_weight_update,
        ),
        "abort_weight_update": (
            session(update=q_update),
            lambda m, p: m.setattr(worker.session.update, "rollback", p()),
            worker.abort_weight_update,
        ),
        "shutdown_weight_transfer_engine": (
            session(),
            lambda m, p: m.setattr(worker.session.engine, "shutdown", p()),
            worker.shutdown_weight_transfer_engine,
        ),
        "weight_checksums": (None, lambda m, p: m.setattr(worker, "_model", p(model)), worker.weight_checksums),
        "record_folder": (
            None,
            lambda m, p: m.setattr(worker, "_record_folder", p()),
            lambda: worker.record_folder(worker.config.model_config.model),
        ),
        "weight_state": (None, lambda m, p: m.setattr(worker.session, "is_valid", p(True)), worker.weight_state),
        "export_state": (None, lambda m, p: m.setattr(worker, "_tensors", p({})), worker.export_state),
        "import_state": (None, lambda m, p: m.setattr(worker, "_tensors", p({})), lambda: worker.import_state([{}])),
        "sleep": (None, lambda m, p: m.setattr(runner, "free_kv_cache", p()), lambda: worker.sleep(1)),
        "shard_plan": (None, lambda m, p: m.setattr(worker, "_model", p(model)), worker.shard_plan),
        "wake_up": (
            lambda: worker.sleep(1),
            lambda m, p: m.setattr(runner, "allocate_kv_cache", p()),
            lambda: worker.wake_up(["kv_cache"]),
        ),
        # LoRA adapters: the manager's first call in each body is the probe (the engine here has none enabled)
        "add_lora": (
            None,
            lambda m, p: m.setattr(worker, "_loras", lambda: SimpleNamespace(add=p())),
            lambda: worker.add_lora(1, {}, {}),
        ),
        "remove_lora": (
            None,
            lambda m, p: m.setattr(worker, "_loras", lambda: SimpleNamespace(remove=p(True))),
            lambda: worker.remove_lora(1),
        ),
        # an adapter's next version, through the commands' one door (`apply`): its session, and a reload
        "apply": (
            session(),
            lambda m, p: (
                m.setattr(worker, "_loras", lambda: lora_stub(p)),
                m.setattr(worker.session, "start", lambda *args: None),
            ),
            lambda: worker.apply(StartUpdate(AdapterPart(1, 2))),
        ),
        "apply(Load)": (
            None,
            lambda m, p: (
                m.setattr(worker, "_loras", lambda: lora_stub(p)),
                m.setattr(worker.session, "load", lambda *a, **k: SimpleNamespace(loaded_names=set())),
            ),
            lambda: worker.apply(Load(AdapterPart(1, 2), weights_iterator=[])),
        ),
    }


def lora_stub(probe):
    """A LoRA manager whose `begin` is the probe and returns an adapter stand-in."""
    return SimpleNamespace(
        begin=probe(SimpleNamespace(weight_index=lambda: None)), commit_pending=lambda: 2, drop_pending=lambda: None
    )


@pytest.mark.parametrize("fail", [False, True], ids=["success", "error"])
def test_every_public_worker_method_runs_in_the_config_scope(llama_dir, fail):
    """Each public Worker method sees the worker's config through current_config() inside its body, on success
    and when that body raises, and leaves no config active afterwards."""
    llm = LLM(str(llama_dir), kv_cache_memory_bytes=1 << 22)
    worker: Worker = llm.llm_engine.executor.worker
    model, runner = worker.model, worker.runner
    seen: dict[str, EngineConfig] = {}
    label = [""]

    def probe(result=None):
        def fn(*args, **kwargs):
            seen[label[0]] = current_config()
            if fail:
                raise RuntimeError("probe failure")
            return result

        return fn

    cases = scope_cases(worker, probe)
    covered = {name.split("(")[0] for name in cases}
    assert sorted(covered) == sorted(public_worker_methods()), "a public Worker method has no scope check here"
    for name, (setup, patch, call) in cases.items():
        label[0] = name
        if setup is not None:
            setup()
        with pytest.MonkeyPatch.context() as m:
            patch(m, probe)
            if fail:
                with pytest.raises(RuntimeError, match="probe failure"):
                    call()
            else:
                call()
        with pytest.raises(RuntimeError, match="outside a config scope"):
            current_config()
        if worker.session.state.value == "active":
            worker.abort_weight_update()
        worker.shutdown_weight_transfer_engine()
        worker.model, worker.runner, worker.session.weights_valid = model, runner, True
        if not runner.kv_caches:
            runner.allocate_kv_cache(worker.config.cache_config.num_kv_blocks)
    assert sorted(seen) == sorted(cases)
    assert all(cfg is worker.config for cfg in seen.values())


def test_a_call_through_the_executor_enters_the_config_scope_once(llama_dir, monkeypatch):
    """collective_rpc("execute_model") and the like run the entry point's body inside the one scope that
    execute_method entered (the scope is not entered twice per step)."""
    import hotswap.worker.scope as scope_module

    llm = LLM(str(llama_dir), kv_cache_memory_bytes=1 << 22)
    entered = []
    real = scope_module.use_config

    def counting(config):
        entered.append(config)
        return real(config)

    monkeypatch.setattr(scope_module, "use_config", counting)
    sums = llm.collective_rpc("weight_checksums")[0]
    assert len(entered) == 1 and sums
    entered.clear()
    calls = []
    executor = llm.llm_engine.executor
    rpc = executor.collective_rpc

    def counted(method, *args, **kwargs):
        calls.append(method)
        return rpc(method, *args, **kwargs)

    monkeypatch.setattr(executor, "collective_rpc", counted)
    llm.generate(PROMPTS[:1], SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True), use_tqdm=False)
    assert calls.count("execute_model") == 3 and len(entered) == len(calls)  # one scope per worker call


def test_place_in_huge_pages_rebinds_parameters_into_one_mapping():
    from hotswap.worker.memory import place_in_huge_pages

    module = torch.nn.Module()
    module.a = torch.nn.Parameter(torch.empty(5, 3), requires_grad=False)
    module.b = torch.nn.Parameter(torch.empty(7, dtype=torch.bfloat16), requires_grad=False)
    module.tied = torch.nn.Linear(3, 5, bias=False)
    module.tied.weight = module.a  # shared: placed once
    module.a.hotswap_name = "a"
    placed = place_in_huge_pages(module)
    params = list(module.parameters())
    assert placed == 64 + 64 and len(params) == 2
    assert module.a.shape == (5, 3) and module.a.dtype == torch.float32 and module.a.hotswap_name == "a"
    assert module.b.shape == (7,) and module.b.dtype == torch.bfloat16
    assert module.tied.weight is module.a
    assert module.b.data_ptr() - module.a.data_ptr() == 64 and module.a.data_ptr() % 64 == 0
    assert module.a.abs().sum() == 0  # fresh zero pages, before any weight is loaded
    module.a.data.copy_(torch.arange(15.0).view(5, 3))
    torch.testing.assert_close(module.tied(torch.eye(3)), torch.arange(15.0).view(5, 3).T)


def test_huge_pages_off_loads_the_same_model(llama_dir):
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    outs = []
    for huge_pages in (True, False):
        llm = LLM(str(llama_dir), kv_cache_memory_bytes=1 << 22, huge_pages=huge_pages)
        assert llm.config.load_config.huge_pages is huge_pages
        outs.append([o.outputs[0].token_ids for o in llm.generate(PROMPTS[:3], params, use_tqdm=False)])
        llm.shutdown()
    assert outs[0] == outs[1]
    with pytest.raises(ValueError, match="huge_pages must be True or False"):
        EngineConfig.from_kwargs(str(llama_dir), huge_pages="yes")
