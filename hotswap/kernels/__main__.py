"""`python -m hotswap.kernels`: build (or find in the cache) the native kernels and say whether they load."""

import logging

from hotswap.kernels import native

logging.basicConfig(level=logging.INFO)
print(f"hotswap native kernels: {'ready' if native.ops() is not None else 'unavailable (pure-torch fallback)'}")
