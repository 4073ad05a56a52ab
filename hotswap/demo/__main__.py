"""`python -m hotswap.demo`: the live RL demo (the same as `hotswap demo`)."""

import argparse
import sys

from hotswap.demo import __doc__ as _doc
from hotswap.demo.run import add_demo_arguments, run_demo_from_args

_parser = argparse.ArgumentParser(prog="python -m hotswap.demo", description=(_doc or "").splitlines()[0])
add_demo_arguments(_parser)
try:
    sys.exit(run_demo_from_args(_parser.parse_args()))
except ValueError as err:  # invalid settings (e.g. --device cuda without a GPU): said, not a traceback
    print(f"error: {err}", file=sys.stderr)
    sys.exit(2)
