# Sourced by scripts/demo and scripts/test: builds .venv from requirements.lock on first use, and again from scratch
# whenever the lock, pyproject.toml or this file changes. Nothing is resolved here: every package is installed at the
# version the lock names and checked against its hashes (pip's --require-hashes), each without its dependencies
# (the lock already lists them all); `pip check` then proves the set consistent. ./scripts/lock refreshes the lock.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${HOTSWAP_VENV:-$ROOT/.venv}"
LOCK="${HOTSWAP_LOCK:-$ROOT/requirements.lock}"
PY="${PYTHON:-python3.11}"
command -v "$PY" >/dev/null 2>&1 || PY=python3
# torch's CPU build is the one exact version not in the lock's hashed list (PyTorch publishes it on its own index;
# a local folder of wheels that pip is configured with may hold it too). Keep it equal to pyproject.toml's pin.
TORCH="torch==2.13.0+cpu"
STAMP="$VENV/.installed-$(cat "$LOCK" "$ROOT/pyproject.toml" "${BASH_SOURCE[0]}" | cksum | cut -d' ' -f1)"
if [ "${HOTSWAP_LATEST:-0}" = 1 ]; then
  # ./scripts/test --latest: a throwaway venv with the newest releases pyproject.toml's bounds allow (resolved now,
  # on purpose), to find the next breaking upgrade before a user does; torch stays at its pin.
  echo "building $VENV with the newest versions pyproject.toml allows (not the lock)" >&2
  rm -rf "$VENV"
  "$PY" -m venv "$VENV"
  "$VENV/bin/python" -m pip install --quiet --retries 1 --extra-index-url https://download.pytorch.org/whl/cpu "$TORCH"
  "$VENV/bin/python" -m pip install --quiet --upgrade --upgrade-strategy eager "setuptools>=68"
  "$VENV/bin/python" -m pip install --quiet --upgrade --upgrade-strategy eager --no-build-isolation -e "$ROOT[test]"
  "$VENV/bin/python" -m pip check
  "$VENV/bin/python" "$ROOT/scripts/compare_lock.py" "$LOCK" --write "$VENV/.upgrades.json"
elif [ ! -f "$STAMP" ]; then
  echo "building $VENV from $(basename "$LOCK") (once; again only when the lock changes)" >&2
  rm -rf "$VENV"
  "$PY" -m venv "$VENV"
  pip=("$VENV/bin/python" -m pip install --quiet --no-deps)
  "${pip[@]}" --require-hashes -r "$LOCK"
  "${pip[@]}" --retries 1 --extra-index-url https://download.pytorch.org/whl/cpu "$TORCH"
  "${pip[@]}" --no-build-isolation -e "$ROOT"
  "$VENV/bin/python" -m pip check
  touch "$STAMP"
fi
# The venv's tools first: the kernels must be built by the same ninja that later checks them, since two ninja
# versions read each other's build log as stale and rebuild everything.
export PATH="$VENV/bin:$PATH"
# Compile the native CPU kernels now rather than at the first engine start (a no-op once cached; without a
# compiler the engine uses its pure-torch path).
"$VENV/bin/python" -m hotswap.kernels
cd "$ROOT"
