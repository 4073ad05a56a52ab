"""What `./scripts/test --latest` reports: the installed versions beside the lock's, and, after the suite, which upgrade
each failing test's traceback passes through.

    python scripts/compare_lock.py requirements.lock [--write upgrades.json]      the versions, as a table
    python scripts/compare_lock.py requirements.lock --failures junit.xml         failures -> the upgrades they touch

A failure is attributed to every upgraded (or new) distribution whose installed files appear in its traceback; one
whose traceback touches none is listed as such (its cause may still be an upgrade that changed a value, not code).
To confirm a suspect: `pip install name==<locked>` in the throwaway venv and run the failing test again.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import xml.etree.ElementTree as ET
from importlib import metadata
from pathlib import Path


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def read_lock(path: Path) -> dict[str, str]:
    pins = {}
    for line in path.read_text().splitlines():
        m = re.match(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==([^\s;\\]+)", line)
        if m:
            pins[canonical(m.group(1))] = m.group(2)
    return pins


def changes(lock: Path) -> dict[str, dict[str, str | list[str] | None]]:
    """name -> {locked, installed, paths}: the distributions whose installed version is not the locked one."""
    pins = read_lock(lock)
    out: dict[str, dict[str, str | list[str] | None]] = {}
    for dist in metadata.distributions():
        name = canonical(dist.metadata["Name"])
        if name in ("hotswap", "torch", "pip"):
            continue
        if pins.get(name) != dist.version:
            tops = (dist.read_text("top_level.txt") or "").split()
            if not tops:
                tops = sorted(
                    {
                        Path(str(f)).parts[0]
                        for f in dist.files or []
                        if "/" in str(f) and not str(f).startswith(("..", "bin/")) and ".dist-info" not in str(f)
                    }
                )
            out[name] = {"locked": pins.get(name), "installed": dist.version, "paths": tops}
    return out


def attribute(junit: Path, upgrades: dict[str, dict[str, str | list[str] | None]]) -> list[str]:
    """One line per failed or erroring test: the upgrades whose files its traceback names."""
    lines = []
    for case in ET.parse(junit).getroot().iter("testcase"):
        for kind in ("failure", "error"):
            for problem in case.findall(kind):
                text = (problem.get("message") or "") + "\n" + (problem.text or "")
                suspects = [
                    f"{name} {info['locked']} -> {info['installed']}"
                    for name, info in sorted(upgrades.items())
                    if any(re.search(rf"site-packages/{re.escape(p)}[/.]", text) for p in info["paths"] or [])
                ]
                test = f"{case.get('classname')}::{case.get('name')}"
                first = (problem.get("message") or "").splitlines()[:1]
                lines.append(
                    f"{kind.upper()} {test}\n    {first[0] if first else ''}\n    traceback passes through: "
                    f"{', '.join(suspects) or 'no upgraded package'}"
                )
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("lock", type=Path)
    parser.add_argument("--write", type=Path, help="also write the table as JSON")
    parser.add_argument("--failures", type=Path, help="a pytest --junitxml report to attribute")
    args = parser.parse_args()
    upgrades = changes(args.lock)
    if args.failures is not None:
        lines = attribute(args.failures, upgrades)
        print(
            f"\n{len(lines)} failing test(s) with the newest versions:"
            if lines
            else "\nthe suite passes with the newest versions: ./scripts/lock --upgrade can take them"
        )
        print("\n".join(lines))
        return
    print(f"{'distribution':32} {'locked':>14} {'newest allowed':>16}")
    for name, info in sorted(upgrades.items()):
        print(f"{name:32} {info['locked'] or '(not locked)':>14} {info['installed']:>16}")
    if not upgrades:
        print("(none: the lock already holds the newest versions)")
    if args.write:
        args.write.write_text(json.dumps(upgrades, indent=1))
    sys.stdout.flush()


if __name__ == "__main__":
    main()
