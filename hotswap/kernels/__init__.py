"""Native CPU kernels, compiled on first use (see `native.py`); every caller has a pure-torch fallback."""
