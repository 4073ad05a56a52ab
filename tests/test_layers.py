"""The package imports only downward (docs/design/architecture.md, "Layers"): every import of a hotswap module, at
module level, deferred inside a function, or under TYPE_CHECKING, goes to a layer at or below its own, and no modules
import each other in a circle. Both rules are also run on a planted violation, to show that they fail where they
should."""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[1]

# Lowest first. A module belongs to the layer of its top-level package (hotswap/<name>/ or hotswap/<name>.py).
LAYERS: list[tuple[str, ...]] = [
    ("errors", "device", "architectures", "wire", "sampling_params", "structured_outputs", "outputs", "testing"),
    ("config",),  # settings, validated
    ("distributed",),  # the tensor-parallel context
    ("kernels",),  # native CPU and Triton kernels behind one facade
    ("weights",),  # indexes, checks, writes and rollback of parameters; the safetensors reader; checksums
    ("model",),  # layers and architectures, with the forward-time LoRA batch
    ("transfer",),  # transports that turn a trainer's tensors into weight sources
    ("lora",),  # adapters: PEFT format, packing, the worker's manager, requests
    ("worker",),  # the model's owner: runner, sessions, cache, graphs
    ("executor",),  # reaches workers in this process or others
    ("inputs",),  # prompts as users give them
    ("engine",),  # scheduler, step loop, weight lifecycle, engine-side LoRA registry
    ("fleet",),  # replicas on Ray behind one router
    ("entrypoints",),  # LLM, the server, clients
    ("train",),  # the trainer's side: exact logprobs, routing replay, parity
    ("demo",),  # the live-RL demo
    ("cli", "__main__", "__init__"),  # the command line and the package's front door
]


def layer_of(module: str) -> int:
    """The layer index of a module name `hotswap.<top>...` (the root package `hotswap` is the front door)."""
    parts = module.split(".")
    top = parts[1] if len(parts) > 1 else "__init__"
    for index, names in enumerate(LAYERS):
        if top in names:
            return index
    raise AssertionError(f"{module}: its package {top!r} has no layer in LAYERS (add it where it belongs)")


def module_name(root: Path, file: Path) -> str:
    parts = list(file.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def imports(root: Path) -> dict[str, list[tuple[str, int]]]:
    """module -> [(imported hotswap module, line)] for every import anywhere in its file (module level, inside
    functions, under TYPE_CHECKING); `from a import b` counts as a.b where a.b is a module, else as a."""
    package = root / "hotswap"
    modules = {module_name(root, f) for f in package.rglob("*.py")}
    found: dict[str, list[tuple[str, int]]] = {}
    for file in sorted(package.rglob("*.py")):
        name = module_name(root, file)
        is_package = file.name == "__init__.py"
        out = []
        for node in ast.walk(ast.parse(file.read_text(), filename=str(file))):
            if isinstance(node, ast.Import):
                out += [(a.name, node.lineno) for a in node.names if a.name.split(".")[0] == "hotswap"]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # relative: resolve against this module's package
                    anchor = name.split(".") if is_package else name.split(".")[:-1]
                    anchor = anchor[: len(anchor) - node.level + 1]
                    base = ".".join([*anchor, *([base] if base else [])])
                if base.split(".")[0] != "hotswap":
                    continue
                for alias in node.names:
                    full = f"{base}.{alias.name}"
                    out.append((full if full in modules else base, node.lineno))
        found[name] = out
    return found


def upward_imports(root: Path) -> list[str]:
    """Every import that goes to a higher layer, as 'file:line: a -> b'."""
    bad = []
    for module, targets in imports(root).items():
        for target, line in targets:
            if layer_of(target) > layer_of(module):
                bad.append(f"{module.replace('.', '/')}.py:{line}: {module} -> {target}")
    return sorted(bad)


def module_cycles(root: Path) -> list[list[str]]:
    """The import circles among modules (each strongly connected component of more than one module, or a module
    importing itself), over every import counted by `imports`."""
    graph: dict[str, set[str]] = defaultdict(set)
    known = imports(root)
    for module, targets in known.items():
        graph[module] |= {t for t, _ in targets if t in known and t != module}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []
    counter = 0

    def visit(node: str) -> None:  # Tarjan's algorithm
        nonlocal counter
        index[node] = low[node] = counter
        counter += 1
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph[node]):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for node in sorted(known):
        if node not in index:
            visit(node)
    return sorted(cycles)


def test_every_import_goes_down_the_layers():
    bad = upward_imports(ROOT)
    assert bad == [], "imports that go up the layers (docs/design/architecture.md, Layers):\n" + "\n".join(bad)


def test_no_modules_import_each_other_in_a_circle():
    assert module_cycles(ROOT) == []


def test_the_layer_rules_fail_on_planted_violations(tmp_path):
    package = tmp_path / "hotswap"
    for folder in ("model", "engine", "kernels"):
        (package / folder).mkdir(parents=True)
        (package / folder / "__init__.py").write_text("")
    (package / "__init__.py").write_text("")
    (package / "model" / "layer.py").write_text(
        "from __future__ import annotations\nfrom typing import TYPE_CHECKING\n\nif TYPE_CHECKING:\n"
        "    from hotswap.engine.loop import Loop\n"
    )
    (package / "engine" / "loop.py").write_text("from hotswap.model import layer\n")
    (package / "kernels" / "a.py").write_text("def f():\n    from hotswap.kernels import b\n")
    (package / "kernels" / "b.py").write_text("from . import a\n")
    assert upward_imports(tmp_path) == ["hotswap/model/layer.py:5: hotswap.model.layer -> hotswap.engine.loop"]
    assert module_cycles(tmp_path) == [
        ["hotswap.engine.loop", "hotswap.model.layer"],
        ["hotswap.kernels.a", "hotswap.kernels.b"],
    ]
