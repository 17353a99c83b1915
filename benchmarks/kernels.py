"""All kernel benchmarks on one GPU, one JSON line per row.

    python benchmarks/kernels.py [--out FILE] [--only lora,moe,attention]

Each part (benchmarks/kernels_<part>.py) times its kernels by CUDA-graph
replay with the L2 flushed and reports them against the HBM floor at the
copy bandwidth measured in the same run.  A part that fails is reported as an
error row and the others still run.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
import traceback

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from timing import copy_bandwidth, emit  # noqa: E402

PARTS = ("lora", "moe", "attention")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=argparse.FileType("a"), default=sys.stdout)
    parser.add_argument("--only", default=",".join(PARTS), help="comma-separated parts to run")
    args = parser.parse_args(argv)
    emit({"bench": "copy", "copy_bytes_per_s": copy_bandwidth()}, args.out)
    for part in args.only.split(","):
        try:
            importlib.import_module(f"kernels_{part}").run(args.out)
        except Exception as err:  # one broken part must not lose the others' rows
            traceback.print_exc()
            emit({"bench": part, "error": f"{type(err).__name__}: {err}"}, args.out)


if __name__ == "__main__":
    main()
