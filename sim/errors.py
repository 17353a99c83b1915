"""The simulator's exceptions.  Bad input is a `SimInputError` (a `ValueError`) whose message names the
file, the field or the line; the CLI turns it into exit code 2 without writing anything."""

from __future__ import annotations


class SimInputError(ValueError):
    """An invalid config, trace or profile: the message says where and why."""


class SimulationError(RuntimeError):
    """The simulation cannot go on (e.g. the scheduler stopped making progress): a bug, not bad input."""
