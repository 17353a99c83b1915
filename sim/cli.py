"""``unipage-sim``: run, sweep and report simulations of the real scheduler and pool.

    unipage-sim run CONFIG.toml [--rate 8 --eviction belady ...] [--out run.jsonl]
    unipage-sim sweep CONFIG.toml --eviction lru lfu belady --pool-pages 2048 4096 --rate 4 8 --out sweep.jsonl
    unipage-sim report sweep.jsonl [--csv sweep.csv] [--jsonl all.jsonl] [--plots plots/]
    unipage-sim profile [NAME]          print a built-in cost profile as JSON (a template for measured ones)
    unipage-sim study [--out docs/sim_study]   the runs, tables and plots behind docs/sim_study.md

Exit codes: 0 ok; 2 bad input (an invalid config, trace, profile or record
file, or bad flags), with a message and nothing written; 1 a simulation that
could not go on (a bug).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from unipage.sim.errors import SimInputError, SimulationError

_FLAGS = (  # (flag, OVERRIDES key, type, help)
    ("--seed", "seed", int, "workload seed"),
    ("--rate", "rate", float, "mean arrival rate (requests/s)"),
    ("--cv", "cv", float, "coefficient of variation of inter-arrival times (1 = Poisson)"),
    ("--policy", "policy", str, "scheduling policy (fcfs, affinity, vtc, slo)"),
    ("--admission", "admission", str, "admission mode (optimistic, reserve)"),
    ("--eviction", "eviction", str, "pool eviction policy (lru, lfu, fifo, size, cost, idle, belady)"),
    ("--pool-pages", "pool_pages", int, "pages in the unified pool"),
    ("--duration", "duration", float, "seconds of arrivals"),
    ("--requests", "requests", int, "number of requests (instead of --duration)"),
    ("--adapters", "adapters", int, "number of adapters"),
    ("--popularity", "popularity", str, "adapter popularity: uniform, zipf or power"),
    ("--trace", "trace", str, "CSV trace to replay"),
    ("--profile", "profile", str, "cost profile: a built-in name or a JSON file"),
)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="unipage-sim", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="run one simulation")
    run.add_argument("config", type=Path, help="TOML config (see docs/sim.md)")
    for flag, _, kind, text in _FLAGS:
        run.add_argument(flag, type=kind, help=text)
    run.add_argument("--out", type=Path, help="write the record (JSON lines) here")
    run.add_argument("--append", action="store_true", help="append to --out instead of replacing it")
    run.add_argument("--quiet", action="store_true", help="print nothing")
    sw = sub.add_parser("sweep", help="run a grid of settings in parallel")
    sw.add_argument("config", type=Path)
    for flag, _, kind, text in _FLAGS:
        sw.add_argument(flag, type=kind, nargs="+", help=f"{text}; several values sweep over them")
    sw.add_argument("--out", type=Path, required=True, help="write the records (JSON lines) here")
    sw.add_argument("--jobs", type=int, default=0, help="worker processes (default: one per core)")
    sw.add_argument("--quiet", action="store_true", help="no progress bar")
    rep = sub.add_parser("report", help="tables, CSV, JSON lines and plots from records")
    rep.add_argument("records", type=Path, nargs="+", help="JSON-lines files written by run or sweep")
    rep.add_argument("--csv", type=Path, help="write a CSV here")
    rep.add_argument("--jsonl", type=Path, help="write the records, merged, as JSON lines here")
    rep.add_argument("--plots", type=Path, help="write PNG plots into this directory")
    rep.add_argument("--occupancy", nargs="*", help="runs (label substrings) for the occupancy plot")
    prof = sub.add_parser("profile", help="print a built-in cost profile as JSON")
    prof.add_argument("name", nargs="?", help="profile name (default: the default profile)")
    study = sub.add_parser("study", help="run the study of docs/sim_study.md")
    study.add_argument("--out", type=Path, default=Path("docs/sim_study"))
    study.add_argument("--jobs", type=int, default=0)
    study.add_argument("--quick", action="store_true", help="a short version (smoke test)")
    return parser


def _flag_values(args) -> dict:
    """OVERRIDES key -> the flag's value (a list for sweep), for the flags given."""
    values = {key: getattr(args, flag[2:].replace("-", "_")) for flag, key, _, _ in _FLAGS}
    return {key: value for key, value in values.items() if value is not None}


def _cmd_run(args) -> int:
    from unipage.sim.config import load_config
    from unipage.sim.engine import simulate
    from unipage.sim.metrics import dumps, make_record
    from unipage.sim.report import summary, write_outputs

    config = load_config(args.config, _flag_values(args))
    record = make_record(simulate(config))
    if args.out:
        previous = args.out.read_text() if args.append and args.out.exists() else ""
        if previous and not previous.endswith("\n"):
            previous += "\n"
        write_outputs({args.out: previous + dumps(record) + "\n"}, {})
    if not args.quiet:
        sys.stdout.write(summary(record))
    return 0


def _cmd_sweep(args) -> int:
    from unipage.sim.config import read_toml
    from unipage.sim.report import read_records, table, write_outputs
    from unipage.sim.sweep import sweep

    raw = read_toml(args.config)
    lines = sweep(raw, args.config.resolve().parent, _flag_values(args), args.jobs, str(args.config),
                  progress=not args.quiet)
    write_outputs({args.out: "".join(line + "\n" for line in lines)}, {})
    if not args.quiet:
        sys.stdout.write(table(read_records([args.out])))
    return 0


def _cmd_report(args) -> int:
    from unipage.sim.report import (
        plots,
        read_records,
        table,
        to_csv,
        to_jsonl,
        write_outputs,
    )

    records = read_records(args.records)
    texts = {}
    if args.csv:
        texts[args.csv] = to_csv(records)
    if args.jsonl:
        texts[args.jsonl] = to_jsonl(records)
    figures = {args.plots / name: fig for name, fig in plots(records, args.occupancy).items()} if args.plots else {}
    written = write_outputs(texts, figures)
    sys.stdout.write(table(records))
    for path in written:
        sys.stdout.write(f"wrote {path}\n")
    return 0


def _cmd_profile(args) -> int:
    from unipage.sim.profile import BUILTIN_PROFILES, DEFAULT_PROFILE

    name = args.name or DEFAULT_PROFILE
    if name not in BUILTIN_PROFILES:
        raise SimInputError(f"no built-in profile {name!r}; built-in: {sorted(BUILTIN_PROFILES)}")
    sys.stdout.write(json.dumps(BUILTIN_PROFILES[name].to_dict(), indent=2) + "\n")
    return 0


def _cmd_study(args) -> int:
    from unipage.sim.study import run_study

    run_study(args.out, jobs=args.jobs, quick=args.quick)
    return 0


COMMANDS = {"run": _cmd_run, "sweep": _cmd_sweep, "report": _cmd_report, "profile": _cmd_profile,
            "study": _cmd_study}


def main(argv=None) -> int:
    args = _parser().parse_args(argv)
    try:
        return COMMANDS[args.command](args)
    except SimInputError as err:
        print(f"unipage-sim: error: {err}", file=sys.stderr)
        return 2
    except SimulationError as err:
        print(f"unipage-sim: simulation failed: {err}", file=sys.stderr)
        return 1


def entry_point() -> None:
    sys.exit(main())


if __name__ == "__main__":
    entry_point()
