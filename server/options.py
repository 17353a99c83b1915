"""Command-line options made from config dataclasses: one ``--flag`` per field, its comment as the help.

The configs (`PoolConfig`, `LoRAConfig`, `SchedulerConfig`, `ServerConfig`)
document each field in a trailing comment (continued on ``#   `` lines); this
module reads those comments from the source so ``--help`` never drifts from
the code.  Only flags given on the command line reach the config: the
dataclass defaults stay the single source of defaults.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import io
import re
import textwrap
import tokenize

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B?|B)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "b": 1, "k": 1e3, "kb": 1e3, "kib": 1 << 10, "m": 1e6, "mb": 1e6, "mib": 1 << 20,
          "g": 1e9, "gb": 1e9, "gib": 1 << 30, "t": 1e12, "tb": 1e12, "tib": 1 << 40}


def byte_size(text: str) -> int:
    """``"512MiB"``, ``"2GB"``, ``"1048576"`` -> bytes."""
    match = _SIZE.match(text)
    if not match or (match.group(2) or "").lower() not in _UNITS:
        raise argparse.ArgumentTypeError(f"not a byte size: {text!r} (e.g. 1048576, 512MiB, 2GB)")
    return int(float(match.group(1)) * _UNITS[(match.group(2) or "").lower()])


def field_help(cls) -> dict[str, str]:
    """{field name: its trailing comment, continuation lines joined} from the class source."""
    source = textwrap.dedent(inspect.getsource(cls))
    comments: dict[int, str] = {}
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            comments[tok.start[0]] = tok.string.lstrip("#").strip()
    lines = source.splitlines()
    out = {}
    for node in ast.parse(source).body[0].body:
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            row = node.end_lineno
            parts = [comments.get(row, "")]
            while row < len(lines) and lines[row].lstrip().startswith("#   "):
                row += 1
                parts.append(comments.get(row, ""))
            out[node.target.id] = " ".join(p for p in parts if p)
    return out


_TYPES = {"int": int, "int | None": int, "float": float, "str": str}


def add_config_options(parser: argparse.ArgumentParser, cls, title: str, skip: tuple[str, ...] = ()) -> list[str]:
    """Add a group of ``--field-name`` options for ``cls``; returns the field names added."""
    group = parser.add_argument_group(title, (cls.__doc__ or "").strip().splitlines()[0])
    helps = field_help(cls)
    names = []
    for f in dataclasses.fields(cls):
        if f.name in skip:
            continue
        flag = "--" + f.name.replace("_", "-")
        default = f.default if f.default is not dataclasses.MISSING else None
        text = (helps.get(f.name) or f.name).replace("%", "%%")
        if f.type == "bool":
            group.add_argument(flag, dest=f.name, action=argparse.BooleanOptionalAction, default=argparse.SUPPRESS,
                               help=f"{text} (default: {default})")
        elif f.type in _TYPES:
            kind = byte_size if f.name.endswith("_bytes") else _TYPES[f.type]
            group.add_argument(flag, dest=f.name, type=kind, default=argparse.SUPPRESS, metavar=f.name.upper(),
                               help=f"{text} (default: {default})")
        else:
            continue
        names.append(f.name)
    return names


def pick(args: argparse.Namespace, names: list[str]) -> dict:
    """The options among ``names`` that were given on the command line."""
    return {name: getattr(args, name) for name in names if hasattr(args, name)}
