# Sourced by scripts/demo and scripts/test: creates .venv on first use and installs the project into it.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="$ROOT/.venv"
PY="${PYTHON:-python3.11}"
command -v "$PY" >/dev/null 2>&1 || PY=python3
STAMP="$VENV/.installed-$(cat "$ROOT/pyproject.toml" | cksum | cut -d' ' -f1)"
if [ ! -f "$STAMP" ]; then
  [ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
  "$VENV/bin/python" -m pip install --quiet --upgrade pip
  # torch is pinned explicitly: this resolves to the CPU build where one is provided locally.
  "$VENV/bin/python" -m pip install --quiet "torch==2.13.0"
  "$VENV/bin/python" -m pip install --quiet -e "$ROOT[test]"
  rm -f "$VENV"/.installed-*
  touch "$STAMP"
fi
# The venv's tools first: the kernels must be built by the same ninja that later checks them, since two ninja
# versions read each other's build log as stale and rebuild everything.
export PATH="$VENV/bin:$PATH"
# Compile the native CPU kernels now rather than at the first engine start (a no-op once cached; without a
# compiler the engine uses its pure-torch path).
"$VENV/bin/python" -m hotswap.kernels
cd "$ROOT"
