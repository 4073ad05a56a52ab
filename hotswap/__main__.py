import sys

from hotswap.entrypoints.cli import main

sys.exit(main())
