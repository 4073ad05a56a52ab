"""`python -m hotswap.kernels [--report] [--model DIR] [--isa native|avx2-kernels|avx2]`: build (or find in the
cache) the native kernels and calibrate them, saying for which vector ISA they were built; `--report` prints the
decision per op with the measured ratio (native time / torch time; below 1 the kernel is faster), for a model's
shapes with `--model`. `--isa avx2` runs as an AVX2-only host would (`hotswap.kernels.emulation`)."""

import argparse
import json
import logging
from pathlib import Path

from hotswap.kernels import emulation, native, policy

parser = argparse.ArgumentParser(prog="python -m hotswap.kernels", description=__doc__)
parser.add_argument("--report", action="store_true", help="print the decision per op")
parser.add_argument("--model", default=None, help="a checkpoint folder whose shapes the calibration times")
parser.add_argument("--isa", choices=emulation.ISAS, default="native", help="emulate a narrower host (see emulation)")
args = parser.parse_args()
emulation.reexec_under(args.isa)
logging.basicConfig(level=logging.WARNING)
if native.ops() is None:
    print("hotswap native kernels: unavailable (pure-torch path)")
else:
    print(
        f"hotswap native kernels: ready ({native.build_name()}, target {native.target_isa()}, "
        f"-march={native.MARCH}, {native.vector_bits()}-bit vectors; torch: {emulation.torch_isa()})"
    )
hf_config = json.loads((Path(args.model) / "config.json").read_text()) if args.model else None
resolved = policy.prepare(hf_config) if hf_config else policy.policy()
if args.report:
    print(f"mode: {resolved.mode} (HOTSWAP_NATIVE_KERNELS); shapes: {resolved.shapes}")
    batches = policy.BATCHES
    print(f"{'op':<22}" + "".join(f"{f'{b} rows':>17}" for b in batches) + "  reason")
    for d in resolved.table():
        cells = []
        for b in batches:
            ratio = f" {d.ratios[b]:.2f}" if b in d.ratios else ""
            cells.append(f"{('native' if d.native[b] else 'torch') + ratio:>17}")
        print(f"{d.op:<22}" + "".join(cells) + f"  {d.reason}")
    print("(a figure is native time / torch time as calibrated; below 1 the native kernel is faster)")
