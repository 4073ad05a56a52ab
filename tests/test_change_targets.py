"""A weight change is one open record with one target: an adapter's change refuses a second change of the same
adapter (two versions computed against one base never both commit), takes no model version at its commit, and
a failed load of an adapter speaks of the adapter, not of a draft model."""

from __future__ import annotations

import pytest

from hotswap import LLM
from hotswap.lora.peft_format import read_folder
from hotswap.testing import make_tiny_lora, make_tiny_model
from hotswap.transfer.tensors import tensors_update_info
from hotswap.weights.update import WeightUpdate

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("change_targets")
    base = make_tiny_model(root / "m", "llama")
    a = make_tiny_lora(base, root / "a", rank=8, seed=1)
    c = make_tiny_lora(base, root / "c", rank=8, seed=3)
    llm = LLM(str(base), enable_lora=True, max_loras=2, max_lora_rank=8, max_cpu_loras=6)
    llm.init_weight_transfer_engine({"backend": "tensors"})
    yield llm, a, c
    llm.shutdown()


def version_of(llm: LLM, name: str) -> int:
    return int(next(d for d in llm.list_loras() if d["lora_name"] == name)["version"])


def test_two_prepared_changes_of_one_adapter_never_both_commit(setup):
    """A session prepared on an adapter, then a load_inplace prepared on it (as a fleet prepares on each
    replica): the second is refused while the first is open, in either order; the first still commits."""
    llm, a, c = setup
    llm.load_lora_adapter("x", str(a))
    _, new = read_folder(str(c))
    llm.start_weight_update(target="lora:x")
    llm.update_weights(tensors_update_info(list(new.items())))
    llm.llm_engine.weights.prepare_weight_update()
    with pytest.raises(RuntimeError, match="another change of LoRA adapter 'x'"):
        llm.prepare_lora_adapter("x", str(c), load_inplace=True)
    llm.llm_engine.weights.commit_weight_update()
    assert version_of(llm, "x") == 2
    llm.prepare_lora_adapter("x", str(a), load_inplace=True)  # held, awaiting its commit
    with pytest.raises(RuntimeError, match="another change of LoRA adapter 'x'"):
        llm.start_weight_update(target="lora:x")
    with pytest.raises(RuntimeError, match="another change of LoRA adapter 'x'"):
        llm.reload_weights(weights_iterator=list(new.items()), target="lora:x")
    assert llm.commit_lora_adapter("x")["version"] == 3
    assert llm.llm_engine.weights.change is None
    llm.unload_lora_adapter("x")


def test_a_prepared_adapter_change_refuses_a_model_version(setup):
    """commit_weight_update(weight_version=) of an adapter's prepared change raises (it numbers its own) and
    leaves the change prepared; committed without one, the adapter advances and the model's version does not."""
    llm, a, c = setup
    llm.load_lora_adapter("y", str(a))
    _, new = read_folder(str(c))
    weights = llm.llm_engine.weights
    llm.start_weight_update(target="lora:y")
    llm.update_weights(tensors_update_info(list(new.items())))
    weights.prepare_weight_update()
    with pytest.raises(ValueError, match="LoRA update takes neither"):
        weights.commit_weight_update(weight_version=5)
    assert weights.change is not None and weights.change.prepared
    assert llm.get_weight_version() == 0 and version_of(llm, "y") == 1
    weights.commit_weight_update()
    assert llm.get_weight_version() == 0 and llm.get_weight_version_label() == "0"
    assert version_of(llm, "y") == 2
    llm.unload_lora_adapter("y")


def test_a_failed_adapter_load_speaks_of_the_adapter(setup, monkeypatch):
    """A reload of an adapter that fails after writing (here: memory runs out at the second tensor) says that
    the adapter's new version was dropped, not that a draft model must be reloaded; the adapter is unchanged."""
    llm, a, c = setup
    llm.load_lora_adapter("z", str(a))
    _, new = read_folder(str(c))
    real, calls = WeightUpdate._loaded, []

    def flaky(self, name, target):
        calls.append(name)
        if len(calls) == 2:
            raise RuntimeError("out of memory")
        return real(self, name, target)

    monkeypatch.setattr(WeightUpdate, "_loaded", flaky)
    with pytest.raises(RuntimeError, match="adapter's new version was dropped") as failure:
        llm.reload_weights(weights_iterator=list(new.items()), target="lora:z")
    assert "draft" not in str(failure.value)
    monkeypatch.undo()
    assert version_of(llm, "z") == 1
    llm.reload_weights(weights_iterator=list(new.items()), target="lora:z")  # nothing was left open
    assert version_of(llm, "z") == 2
    llm.unload_lora_adapter("z")
