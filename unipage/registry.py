"""`Registry`: policy classes by name, for config files and command lines.  Pure Python."""

from __future__ import annotations


class Registry(dict):
    """``name -> class``; each class has a ``name`` attribute.  ``what`` names the kind in errors."""

    def __init__(self, what: str, classes=()) -> None:
        super().__init__((cls.name, cls) for cls in classes)
        self.what = what

    def make(self, name: str, *args):
        """An instance of the class registered as ``name``."""
        try:
            cls = self[name]
        except KeyError:
            raise ValueError(f"unknown {self.what} {name!r}; choose one of {sorted(self)}") from None
        return cls(*args)

    def register(self, cls):
        """Add ``cls`` under ``cls.name`` (usable as a decorator)."""
        if cls.name in self:
            raise ValueError(f"{self.what} {cls.name!r} is already registered")
        self[cls.name] = cls
        return cls
