"""Shared fixtures: tiny random-weight checkpoints (one per architecture) and Hugging Face references."""

from __future__ import annotations

import functools
import weakref
from pathlib import Path

import pytest
import torch

from hotswap.engine.llm_engine import LLMEngine
from hotswap.testing import make_tiny_model

# (fixture id, arch, overrides)
ARCHS = {
    "llama": ("llama", {"tie_word_embeddings": False}),
    "llama_tied": ("llama", {"tie_word_embeddings": True}),
    "qwen2": ("qwen2", {}),
    "qwen3": ("qwen3", {}),
}

PROMPTS = [
    "hello world",
    "the quick brown fox jumps over the lazy dog and then",
    "a",
    "one two three four five six seven eight nine ten eleven twelve thirteen",
    "x y",
    "I like to eat apples and",
    "numbers 1 2 3 4",
    "what is the meaning of this small random model, if any, and why does it talk",
]


# Test files that start a Ray fleet (in-process or in a server they start): under pytest-xdist (scripts/test) they
# run one after another on one worker, as in a serial run, so that one Ray at a time takes the cores and memory.
RAY_FILES = frozenset(
    {"test_fleet.py", "test_fleet_lora.py", "test_fleet_server.py", "test_fleet_tp.py", "test_soak.py"}
)


RAY_UNIT = "ray fleets"


def pytest_xdist_make_scheduler(config, log):
    """Distributes whole files, in order (tests of a file share module fixtures and build on each other's state);
    the Ray files form one unit (RAY_FILES), handed out first: it is the longest, and a long unit started last
    would leave the other worker idle at the end. Called by pytest-xdist only."""
    from xdist.scheduler import LoadScopeScheduling

    class FileScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            path = nodeid.split("::", 1)[0]
            return RAY_UNIT if Path(path).name in RAY_FILES else path

        def _assign_work_unit(self, node) -> None:
            if RAY_UNIT in self.workqueue:
                self.workqueue.move_to_end(RAY_UNIT, last=False)
            super()._assign_work_unit(node)

    return FileScheduling(config, log)


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--device",
        default="cpu",
        help="the device the device-parametrized tests run their engines "
        "and transformers on: cpu (default; CI) or cuda[:N] (a GPU machine)",
    )


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests marked `cuda` need `--device cuda`; those marked `cpu_only` (native kernels, huge pages, deterministic
    mode, Ray, servers) are skipped under it."""
    on_cuda = str(config.getoption("--device")).startswith("cuda")
    for item in items:
        if not on_cuda and item.get_closest_marker("cuda"):
            item.add_marker(pytest.mark.skip(reason="needs --device cuda"))
        if on_cuda and item.get_closest_marker("cpu_only"):
            item.add_marker(pytest.mark.skip(reason="CPU only"))


@pytest.fixture(scope="session", autouse=True)
def _engines_on_the_device(request: pytest.FixtureRequest):
    """With `--device cuda`, every engine a test builds without naming a device runs there: the suite's engine
    tests (those not marked `cpu_only`) run on the GPU as they run on the CPU."""
    device = str(request.config.getoption("--device"))
    if device == "cpu":
        yield
        return
    from hotswap.config import EngineConfig

    original = EngineConfig.from_kwargs.__func__  # type: ignore[attr-defined]

    def from_kwargs(cls, model, **kwargs):
        kwargs.setdefault("device", device)
        return original(cls, model, **kwargs)

    EngineConfig.from_kwargs = classmethod(from_kwargs)
    yield
    EngineConfig.from_kwargs = classmethod(original)


@pytest.fixture(scope="session")
def device(request: pytest.FixtureRequest) -> str:
    """The device of `--device`: device-parametrized tests build their engines and transformers references there."""
    return str(request.config.getoption("--device"))


_ENGINES: weakref.WeakSet[LLMEngine] = weakref.WeakSet()


@pytest.fixture(scope="session", autouse=True)
def _track_engines():
    """Records every engine built in this process, for the integrity check after each test."""
    original = LLMEngine.__init__

    def init(self, *args, **kwargs):
        original(self, *args, **kwargs)
        _ENGINES.add(self)

    LLMEngine.__init__ = init
    yield
    LLMEngine.__init__ = original


@pytest.fixture(autouse=True)
def _check_engine_integrity(_track_engines):
    """After every test: the KV block accounting of every live engine is consistent (reference counts match
    the block tables, free + used = total)."""
    yield
    for engine in list(_ENGINES):
        engine.check_integrity()


@pytest.fixture(scope="session")
def model_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("models")
    return {name: make_tiny_model(root / name, arch=arch, **kw) for name, (arch, kw) in ARCHS.items()}


@pytest.fixture(scope="session")
def ckpts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Two llama checkpoints of the same shape with different weights: A (served first) and B (pushed).
    Modules that need other pairs override this fixture."""
    root = tmp_path_factory.mktemp("ab_models")
    return {"A": make_tiny_model(root / "A", seed=0), "B": make_tiny_model(root / "B", seed=1)}


@pytest.fixture(scope="session")
def tokenizer(ckpts: dict[str, Path]):
    """Checkpoint A's tokenizer (the one the servers in the HTTP tests serve)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(ckpts["A"]))


@pytest.fixture(scope="session")
def llama_dir(model_dirs: dict[str, Path]) -> Path:
    return model_dirs["llama"]


@functools.cache
def hf_model(path: str, dtype: torch.dtype = torch.float32, device: str = "cpu") -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval()


@functools.cache
def hf_greedy(
    path: str, prompt_ids: tuple[int, ...], max_new_tokens: int, dtype: torch.dtype = torch.float32, device: str = "cpu"
) -> tuple[list[int], list[torch.Tensor]]:
    """Transformers' greedy continuation of `prompt_ids` (EOS ignored) on `device`, and its per-step log-softmax
    rows (of its logits in `dtype`, the model's, cast to float32, on the CPU)."""
    model = hf_model(path, dtype, device)
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt_ids], device=device),
            attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long, device=device),
            max_new_tokens=max_new_tokens,
            min_new_tokens=max_new_tokens,
            do_sample=False,
            output_logits=True,
            return_dict_in_generate=True,
            pad_token_id=0,
        )
    tokens = out.sequences[0, len(prompt_ids) :].tolist()
    return tokens, [step[0].float().log_softmax(-1).cpu() for step in out.logits]


@pytest.fixture(scope="module")
def b_tensors(ckpts: dict[str, Path]) -> list[tuple[str, torch.Tensor]]:
    """Checkpoint B's tensors, in file order (what a trainer pushes into an engine serving A)."""
    from safetensors.torch import load_file

    return list(load_file(str(ckpts["B"] / "model.safetensors")).items())


def serves(llm, path, tokens: int = 12) -> bool:
    """Whether `llm` generates transformers' greedy continuation of two prompts for the checkpoint at `path`."""
    from hotswap import SamplingParams

    tok = llm.get_tokenizer()
    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    outs = llm.generate(PROMPTS[:2], params, use_tqdm=False)
    config = getattr(llm, "config", None)  # an LLM's; a fleet's replicas run on the CPU in these tests
    device = config.model_config.device if config is not None else "cpu"  # transformers on the engine's device
    return all(
        o.outputs[0].token_ids == hf_greedy(str(path), tuple(tok.encode(p)), tokens, device=device)[0]
        for p, o in zip(PROMPTS[:2], outs, strict=True)
    )


@pytest.fixture(scope="session")
def native_kernels():
    """`torch.ops.hotswap` with the native kernels; the test is skipped where they are not built."""
    from hotswap.kernels import native

    kernels = native.ops()
    if kernels is None:
        pytest.skip("native kernels unavailable (no C++ compiler, or turned off)")
    return kernels
