"""python3 -m tpfuser.bench: the benchmark (bench/cli.py), as `tpfuser bench`,
its signals handled as the command line's."""
import sys

from tpfuser.bench.cli import add_bench_arguments
from tpfuser.cli import main as cli_main
from tpfuser.outputs import ArgParser
from tpfuser.parallel.schedule_options import schedule_args


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    ap = ArgParser(prog="tpfuser bench")
    add_bench_arguments(ap)
    schedule_args(ap)
    ap.parse_args(argv)   # its refusals named as bench's
    return cli_main(["bench", *argv])


if __name__ == "__main__":
    sys.exit(main())
