"""`python -m hotswap.kernels`: build (or find in the cache) the native kernels and say whether they load, for
which vector ISA, and whether the 16-lane kernels (linear, gated linear, SwiGLU gate, greedy sampling) are
taken."""

import logging

from hotswap.kernels import native

logging.basicConfig(level=logging.INFO)
if native.ops() is None:
    print("hotswap native kernels: unavailable (pure-torch fallback)")
else:
    linear = "taken" if native.wide_vector_kernels_win() else "not taken (torch wins on this ISA)"
    print(
        f"hotswap native kernels: ready ({native.build_name()}, {native.vector_bits()}-bit vectors, "
        f"16-lane kernels {linear})"
    )
