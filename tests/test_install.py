"""The install a new user gets: the lock agrees with pyproject.toml and the venv holds exactly the lock; nothing in the
repository edits `sys.path` or is named like a module that an installed distribution provides (a `benchmarks/kernels.py`
on the path once shadowed Hugging Face's `kernels`, which transformers imports). Each guard is also run on a planted
defect, so that it is seen to fail."""

from __future__ import annotations

import ast
import importlib.util
import os
import re
import sys
import tomllib
from importlib import metadata
from pathlib import Path
from types import ModuleType

import pytest
from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[1]
# The environment the lock is made for (scripts/lock: CPython 3.11, x86_64 manylinux).
LOCK_ENV = {
    **default_environment(),
    "python_version": "3.11",
    "python_full_version": "3.11.0",
    "sys_platform": "linux",
    "platform_system": "Linux",
    "platform_machine": "x86_64",
    "implementation_name": "cpython",
    "platform_python_implementation": "CPython",
    "os_name": "posix",
}


def _compare_lock() -> ModuleType:
    """scripts/compare_lock.py, loaded by its path (scripts/ is no package): its lock reader is the one used here."""
    spec = importlib.util.spec_from_file_location("compare_lock", ROOT / "scripts" / "compare_lock.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def read_lock(path: Path) -> dict[str, Version]:
    """name -> exact version of every package pinned in a `uv pip compile` lock (`name==version \\`)."""
    return {name: Version(version) for name, version in _compare_lock().read_lock(path).items()}


def torch_pin(venv_script: Path) -> Version:
    """The exact torch that scripts/_venv.sh installs beside the lock."""
    m = re.search(r'^TORCH="torch==([^"]+)"', venv_script.read_text(), flags=re.M)
    assert m, f"{venv_script} names no TORCH pin"
    return Version(m.group(1))


def lock_disagreements(pyproject: Path, lock: Path, torch: Version) -> list[str]:
    """What pyproject.toml asks for (dependencies, the `test` extra, the build system) that the lock does not hold at
    a version the bound accepts: each as a line a maintainer can act on (run ./scripts/lock). Empty when they agree."""
    project = tomllib.loads(pyproject.read_text())
    wanted = [
        *project["project"]["dependencies"],
        *project["project"]["optional-dependencies"]["test"],
        *project["build-system"]["requires"],
    ]
    pins = read_lock(lock)
    pins.setdefault(canonicalize_name("torch"), torch)
    problems = []
    for text in wanted:
        req = Requirement(text)
        if req.marker is not None and not req.marker.evaluate(LOCK_ENV):
            continue
        have = pins.get(canonicalize_name(req.name))
        if have is None:
            problems.append(f"{req.name}: in pyproject.toml, not in the lock")
        elif not req.specifier.contains(have, prereleases=True):
            problems.append(f"{req.name}: pyproject.toml asks {req.specifier}, the lock has {have}")
    return problems


def python_files(root: Path) -> list[Path]:
    """The repository's own Python files (not its venvs, caches or build folders)."""
    files = []
    for here, dirs, names in os.walk(root):
        dirs[:] = sorted(d for d in dirs if not d.startswith(".") and d not in ("build", "dist", "__pycache__"))
        files += [Path(here) / n for n in sorted(names) if n.endswith(".py")]
    return files


def path_edits(root: Path) -> list[str]:
    """Every place under `root`'s Python files that changes the import path: `sys.path` assigned or mutated
    (insert, append, extend, slice assignment, +=), `site.addsitedir`, or PYTHONPATH set in os.environ."""
    found = []
    for file in python_files(root):
        tree = ast.parse(file.read_text(), filename=str(file))
        for node in ast.walk(tree):
            hit = False
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
                owner = ast.unparse(node.func.value)
                hit = (
                    owner == "sys.path" and node.func.attr in ("insert", "append", "extend", "remove", "pop", "clear")
                ) or (owner == "site" and node.func.attr == "addsitedir")
            elif isinstance(node, (ast.Assign, ast.AugAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                for t in targets:
                    text = ast.unparse(t)
                    hit = (
                        hit
                        or text == "sys.path"
                        or text.startswith("sys.path[")
                        or re.fullmatch(r"os\.environ\[['\"]PYTHONPATH['\"]\]", text) is not None
                    )
            if hit:
                found.append(f"{file.relative_to(root)}:{node.lineno}: {ast.unparse(node)[:80]}")
    return found


def repo_module_names(root: Path) -> dict[str, str]:
    """name -> where, for every name the repository could put at the top of the import path: its packages and folders
    (hotswap, benchmarks, tests, scripts) and each module file in benchmarks/, tests/ and scripts/ (run as scripts,
    their folder is the first entry of the path)."""
    names = {}
    for folder in ("hotswap", "benchmarks", "tests", "scripts"):
        if (root / folder).is_dir():
            names[folder] = folder + "/"
    for folder in ("benchmarks", "tests", "scripts"):
        for file in sorted((root / folder).glob("*.py")) if (root / folder).is_dir() else []:
            if file.stem != "__init__":
                names[file.stem] = f"{folder}/{file.name}"
    return names


def shadowing(root: Path, taken: dict[str, list[str]]) -> list[str]:
    """The repository's module names (repo_module_names) that are also an installed distribution's import name or a
    standard-library module: importing that name would find the repository's file first."""
    clashes = []
    for name, where in repo_module_names(root).items():
        if name == "hotswap":
            continue
        if name in taken:
            clashes.append(f"{where} is named like {name!r} of the distribution(s) {', '.join(sorted(taken[name]))}")
        elif name in sys.stdlib_module_names:
            clashes.append(f"{where} is named like the standard library's {name!r}")
    return clashes


def installed_import_names() -> dict[str, list[str]]:
    """Top-level import name -> the installed distributions that provide it."""
    return {name: dists for name, dists in metadata.packages_distributions().items() if not name.startswith("_")}


def test_the_lock_holds_what_pyproject_asks_for():
    problems = lock_disagreements(
        ROOT / "pyproject.toml", ROOT / "requirements.lock", torch_pin(ROOT / "scripts" / "_venv.sh")
    )
    assert problems == [], "pyproject.toml and requirements.lock disagree (run ./scripts/lock):\n" + "\n".join(problems)


def test_the_lock_check_fails_on_a_bound_the_lock_breaks(tmp_path):
    text = (ROOT / "pyproject.toml").read_text()
    locked = read_lock(ROOT / "requirements.lock")[canonicalize_name("transformers")]
    beyond = tmp_path / "pyproject.toml"
    beyond.write_text(re.sub(r'"transformers[^"]*"', f'"transformers>{locked}"', text))
    added = tmp_path / "added.toml"
    added.write_text(text.replace('"tqdm', '"left-pad-nowhere>=1", "tqdm'))
    torch = torch_pin(ROOT / "scripts" / "_venv.sh")
    assert lock_disagreements(beyond, ROOT / "requirements.lock", torch) == [
        f"transformers: pyproject.toml asks >{locked}, the lock has {locked}"
    ]
    assert lock_disagreements(added, ROOT / "requirements.lock", torch) == [
        "left-pad-nowhere: in pyproject.toml, not in the lock"
    ]


def test_the_torch_pin_is_pyprojects():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    [torch] = [Requirement(r) for r in project["project"]["dependencies"] if Requirement(r).name == "torch"]
    assert torch.specifier.contains(torch_pin(ROOT / "scripts" / "_venv.sh"))


@pytest.mark.skipif(os.environ.get("HOTSWAP_UNLOCKED") == "1", reason="--latest: the newest, not the lock")
def test_the_venv_holds_exactly_the_lock():
    """What runs the tests is what the lock says (scripts/_venv.sh builds it from the lock, nothing resolved)."""
    pins = read_lock(ROOT / "requirements.lock")
    pins[canonicalize_name("torch")] = torch_pin(ROOT / "scripts" / "_venv.sh")
    wrong = {}
    for name, version in pins.items():
        try:
            have = Version(metadata.version(name))
        except metadata.PackageNotFoundError:
            have = None
        if have != version:
            wrong[name] = f"locked {version}, installed {have}"
    assert wrong == {}, wrong


def test_nothing_in_the_repository_edits_the_import_path():
    assert path_edits(ROOT) == []


def test_no_module_of_the_repository_shadows_an_installed_one():
    taken = installed_import_names()
    assert "transformers" in taken and "torch" in taken  # the scan sees the installed distributions
    assert shadowing(ROOT, taken) == []


def test_the_guards_find_a_planted_shadow_and_a_path_edit(tmp_path):
    """The two guards above, on a copy of the layout with the defects this issue started from."""
    (tmp_path / "benchmarks").mkdir()
    (tmp_path / "tests").mkdir()
    (tmp_path / "benchmarks" / "kernels.py").write_text("x = 1\n")
    (tmp_path / "benchmarks" / "json.py").write_text("x = 1\n")
    (tmp_path / "tests" / "test_soak.py").write_text(
        "import sys\nfrom pathlib import Path\nsys.path.insert(0, str(Path(__file__).parent))\n"
    )
    (tmp_path / "tests" / "helper.py").write_text(
        "import os, sys\nsys.path[:] = []\nsys.path += ['x']\nos.environ['PYTHONPATH'] = 'x'\n"
    )
    taken = {**installed_import_names(), "kernels": ["kernels"]}  # Hugging Face's, whether installed here or not
    clashes = shadowing(tmp_path, taken)
    assert any(c.startswith("benchmarks/kernels.py is named like 'kernels'") for c in clashes), clashes
    assert any(c.startswith("benchmarks/json.py is named like the standard library's") for c in clashes), clashes
    edits = path_edits(tmp_path)
    assert [e.split(":")[0:2] for e in edits] == [
        ["tests/helper.py", "2"],
        ["tests/helper.py", "3"],
        ["tests/helper.py", "4"],
        ["tests/test_soak.py", "3"],
    ], edits
