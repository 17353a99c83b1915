"""Reports over run records: a terminal table, CSV, JSON lines and PNG plots (matplotlib, optional).

Plots, each drawn when the records vary along its x axis:

- ``rate.png``: throughput and p99 TTFT vs arrival rate, a line per
  combination of the other settings that vary;
- ``pool.png``: adapter hit ratio and p99 TTFT vs pool size, a line per
  eviction policy (and other varying settings);
- ``slo.png``: SLO attainment per scheduling policy, bars grouped by the
  other varying settings (e.g. the arrival CV);
- ``occupancy.png``: pool pages by kind over time, one panel per selected run.

Seeds are averaged: a point is the mean over the records that differ only in
their seed.  All outputs are rendered first and moved into place at the end,
so a failure writes nothing.
"""

from __future__ import annotations

import csv
import io
import json
import os
import statistics
from pathlib import Path

from unipage.sim.errors import SimInputError

TABLE = (("label", "run", "{}"), ("throughput_rps", "req/s", "{:.2f}"), ("output_tokens_per_s", "tok/s", "{:.0f}"),
         ("ttft_p50_s", "TTFT p50", "{:.3f}"), ("ttft_p99_s", "TTFT p99", "{:.3f}"),
         ("tpot_p50_s", "TPOT p50", "{:.4f}"), ("tpot_p99_s", "TPOT p99", "{:.4f}"),
         ("latency_p99_s", "lat p99", "{:.2f}"), ("slo_attainment", "SLO", "{:.3f}"),
         ("goodput_rps", "goodput", "{:.2f}"), ("adapter_hit_ratio", "hit", "{:.3f}"),
         ("adapter_loads", "loads", "{}"), ("bytes_h2d", "GB h2d", "{}"), ("preemptions", "preempt", "{}"))
SERIES_KEYS = ("occupancy",)  # list-valued fields left out of the CSV


def read_records(paths) -> list[dict]:
    """The ``row == "run"`` records of ``bench == "sim"`` in JSON-lines files (errors name file and line)."""
    records = []
    for path in paths:
        try:
            text = Path(path).read_text()
        except OSError as err:
            raise SimInputError(f"{path}: cannot read it: {err.strerror}") from None
        for number, line in enumerate(text.splitlines(), start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as err:
                raise SimInputError(f"{path} line {number}: not JSON: {err.msg}") from None
            if not isinstance(record, dict):
                raise SimInputError(f"{path} line {number}: expected a JSON object")
            if record.get("bench") == "sim" and record.get("row") == "run":
                if not isinstance(record.get("config"), dict) or "label" not in record:
                    raise SimInputError(f"{path} line {number}: a sim record without config or label")
                records.append(record)
    if not records:
        raise SimInputError(f"no simulator records in {', '.join(map(str, paths))}")
    return records


def flatten(record: dict) -> dict:
    """Scalar fields of a record; the config's as ``config.section.field`` (lists as JSON text)."""
    out = {}
    for key, value in record.items():
        if key == "config":
            for dotted, v in _flat(value, "config"):
                out[dotted] = v
        elif key not in SERIES_KEYS:
            out[key] = value
    return out


def _flat(value, prefix):
    if isinstance(value, dict):
        for k, v in value.items():
            yield from _flat(v, f"{prefix}.{k}")
    else:
        yield prefix, json.dumps(value) if isinstance(value, list) else value


def varying(records: list[dict]) -> list[str]:
    """Config keys (dotted) whose values differ between records, seed excluded."""
    flats = [dict(_flat(r["config"], "config")) for r in records]
    keys = list(dict.fromkeys(k for f in flats for k in f))
    return [k for k in keys if k != "config.seed" and len({json.dumps(f.get(k)) for f in flats}) > 1]


# -- text outputs ----------------------------------------------------------------
def _cell(record: dict, key: str, fmt: str) -> str:
    value = record.get(key)
    if value is None:
        return "-"
    if key == "bytes_h2d":
        return f"{value / 1e9:.1f}"
    return fmt.format(value)


def table(records: list[dict]) -> str:
    """A fixed-width table, one row per record."""
    rows = [[title for _, title, _ in TABLE]] + [[_cell(r, k, f) for k, _, f in TABLE] for r in records]
    widths = [max(len(row[i]) for row in rows) for i in range(len(TABLE))]
    lines = ["  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths)))
             for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines) + "\n"


def summary(record: dict) -> str:
    """One run, as a two-column table."""
    keys = [k for k, v in record.items() if k not in ("config", "occupancy") and not isinstance(v, (dict, list))]
    width = max(map(len, keys))
    return "".join(f"{k.ljust(width)}  {record[k]}\n" for k in keys)


def to_csv(records: list[dict]) -> str:
    flats = [flatten(r) for r in records]
    columns = list(dict.fromkeys(k for f in flats for k in f))
    buf = io.StringIO()
    writer = csv.DictWriter(buf, columns, lineterminator="\n")
    writer.writeheader()
    writer.writerows(flats)
    return buf.getvalue()


def to_jsonl(records: list[dict]) -> str:
    return "".join(json.dumps(r, allow_nan=False) + "\n" for r in records)


# -- plots -------------------------------------------------------------------------
def _short(key: str) -> str:
    return key.split(".")[-1]


def _series(records: list[dict], x_key: str, y_key: str, by: list[str]) -> dict[str, list[tuple]]:
    """Label -> sorted [(x, mean y over seeds)] for records grouped by the ``by`` config keys."""
    groups: dict[str, dict] = {}
    for r in records:
        flat = dict(_flat(r["config"], "config"))
        name = ", ".join(f"{_short(k)}={flat.get(k)}" for k in by) or "all"
        y = r.get(y_key)
        if y is not None:
            groups.setdefault(name, {}).setdefault(flat[x_key], []).append(y)
    return {name: sorted((x, statistics.fmean(ys)) for x, ys in points.items()) for name, points in groups.items()}


def _line_plot(plt, records, x_key, x_label, panels, by, title):
    fig, axes = plt.subplots(1, len(panels), figsize=(5.5 * len(panels), 4), squeeze=False)
    for ax, (y_key, y_label, log) in zip(axes[0], panels):
        for name, points in _series(records, x_key, y_key, by).items():
            ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=name)
        ax.set_xlabel(x_label)
        ax.set_ylabel(y_label)
        if log:
            ax.set_yscale("log")
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=7)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    return fig


def _slo_plot(plt, records, by):
    policies = sorted({r["config"]["scheduler"]["policy"] for r in records})
    groups = _series(records, "config.scheduler.policy", "slo_attainment", by)
    fig, ax = plt.subplots(figsize=(6, 4))
    width = 0.8 / max(len(groups), 1)
    for g, (name, points) in enumerate(groups.items()):
        values = dict(points)
        ax.bar([i + g * width for i in range(len(policies))], [values.get(p, 0.0) for p in policies], width,
               label=name)
    ax.set_xticks([i + width * (len(groups) - 1) / 2 for i in range(len(policies))], policies)
    ax.set_ylabel("SLO attainment")
    ax.set_ylim(0, 1.05)
    ax.legend(fontsize=7)
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    return fig


def _occupancy_plot(plt, records):
    fig, axes = plt.subplots(len(records), 1, figsize=(8, 2.6 * len(records)), squeeze=False, sharex=False)
    kinds = ("kv", "cached_kv", "adapter", "free")
    for ax, r in zip(axes[:, 0], records):
        occ = r["occupancy"]
        ax.stackplot(occ["t"], *[occ[k] for k in kinds], labels=kinds, alpha=0.85)
        ax.set_title(r["label"], fontsize=8)
        ax.set_ylabel("pages")
        ax.set_xlim(occ["t"][0], occ["t"][-1])
    axes[0, 0].legend(loc="upper right", fontsize=7, ncol=4)
    axes[-1, 0].set_xlabel("simulated time (s)")
    fig.tight_layout()
    return fig


def plots(records: list[dict], occupancy: list[str] | None = None) -> dict[str, object]:
    """File name -> matplotlib figure, for the plots these records support."""
    try:
        import matplotlib
    except ImportError:
        raise SimInputError("plots need matplotlib: pip install 'unipage[sim]'") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    vary = varying(records)
    figures = {}
    if "config.workload.rate" in vary:
        by = [k for k in vary if k != "config.workload.rate"]
        figures["rate.png"] = _line_plot(plt, records, "config.workload.rate", "arrival rate (req/s)",
                                         [("throughput_rps", "throughput (req/s)", False),
                                          ("ttft_p99_s", "p99 TTFT (s)", True)], by, "throughput and p99 TTFT vs rate")
    if "config.pool.num_pages" in vary:
        by = [k for k in vary if k != "config.pool.num_pages"]
        figures["pool.png"] = _line_plot(plt, records, "config.pool.num_pages", "pool size (pages)",
                                         [("adapter_hit_ratio", "adapter hit ratio", False),
                                          ("ttft_p99_s", "p99 TTFT (s)", True)], by,
                                         "adapter hit ratio and p99 TTFT vs pool size")
    if "config.scheduler.policy" in vary:
        figures["slo.png"] = _slo_plot(plt, records, [k for k in vary if k != "config.scheduler.policy"])
    chosen = [r for r in records if any(s in r["label"] for s in occupancy)] if occupancy else records[:4]
    if chosen:
        figures["occupancy.png"] = _occupancy_plot(plt, chosen[:6])
    return figures


# -- writing -------------------------------------------------------------------------
def write_outputs(texts: dict[Path, str], figures: dict[Path, object]) -> list[Path]:
    """Render everything to temporary files, then move each into place (a failure leaves no partial file)."""
    staged: list[tuple[Path, Path]] = []
    try:
        for path, text in texts.items():
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
            tmp.write_text(text)
            staged.append((tmp, path))
        for path, fig in figures.items():
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_name(f".{path.name}.tmp{os.getpid()}.png")
            fig.savefig(tmp, dpi=110)
            staged.append((tmp, path))
    except BaseException:
        for tmp, _ in staged:
            tmp.unlink(missing_ok=True)
        raise
    finally:
        if figures:
            import matplotlib.pyplot as plt

            for fig in figures.values():
                plt.close(fig)
    for tmp, path in staged:
        os.replace(tmp, path)
    return [path for _, path in staged]
