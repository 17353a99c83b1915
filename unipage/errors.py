"""Exceptions for bad input.

Every error a caller can cause is a subclass of ``ValueError`` with a message
that names the cause.  Raising one never leaves partial state behind: the
managers validate first and mutate after.  Running out of pages is *not* an
error: allocation returns ``None`` and the caller decides what to do.
"""

from __future__ import annotations


class AdapterError(ValueError):
    """Base class for every problem with an adapter or its files."""


class UnknownAdapterError(AdapterError):
    """An adapter name that is not registered."""


class AdapterExistsError(AdapterError):
    """Registering a name that is already taken."""


class AdapterPathError(AdapterError):
    """A path outside the allowed adapter roots (traversal, symlink escape)."""


class AdapterFormatError(AdapterError):
    """Missing or corrupt files, a pickle weight file, unreadable config."""


class AdapterRankError(AdapterError):
    """A rank above the configured maximum, or inconsistent ranks."""


class AdapterShapeError(AdapterError):
    """A target module or tensor shape that does not match the base model."""


class AdapterBusyError(AdapterError):
    """An operation that needs an idle adapter found it pinned by requests."""


class PageError(ValueError):
    """A page id that is out of range, double-freed or in the wrong state."""


class CheckpointError(ValueError):
    """A model directory that cannot be served: missing files, unknown architecture, wrong shapes."""


class ClosedError(ValueError):
    """An engine or pool storage used after its ``close()`` (a ``ValueError``, as for a closed file)."""
