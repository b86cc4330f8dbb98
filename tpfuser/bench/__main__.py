"""python3 -m tpfuser.bench: the benchmark (bench/cli.py)."""
import sys

from tpfuser.bench.cli import main

sys.exit(main())
