"""Triton launches with less host work: ``launch(kernel, grid, *args, **kwargs)`` is ``kernel[grid](*args,
**kwargs)``.

Triton's own launch path binds the arguments, asks the compiler for each one's
specialisation, builds a cache key string and checks the kernel's globals on
every call: about 40-50 us of host time per launch on the H100 machine's CPU,
several times a torch op's.  An eager prefill step launches a couple of hundred
Triton kernels, so that alone was the larger part of the host time of a
4096-token step.

Here the first launch of a kernel with given argument *traits* goes through
Triton (which compiles or finds the kernel, and launches it) and the compiled
kernel is kept under those traits; later launches with the same traits call
its launcher directly.  The traits are finer than Triton's specialisation, so
one entry never stands for two different compiled kernels:

- a tensor: its dtype and ``data_ptr() % 16`` (Triton keys on the dtype and
  16-byte alignment);
- an int: its value (Triton keys on ``== 1`` and ``% 16 == 0``), or for a
  ``do_not_specialize`` parameter, whether it fits in int32 or int64 (its type);
- a float: the type alone (Triton never specialises on a float's value), or
  its value for a ``tl.constexpr`` parameter;
- a bool: ``(bool, value)`` (so that ``True`` and ``1`` differ, as in Triton);
- anything else (None, a constexpr value): the value itself;
- keyword launch options (``num_warps``, ``num_stages``, ``maxnreg``, ``launch_pdl``) and
  the current device.

The traits and the bound arguments of a call come from a *binder* generated
for its call shape (positional count and keyword names) at the shape's first
call: one expression per parameter instead of a loop over them, guarded by
the kinds of that first call's arguments (a call with other kinds takes the
general `bind` and `traits`); half the host time of keying a launch.

Triton's path is kept where this one cannot stand in for it: under the
interpreter (``TRITON_INTERPRET=1``, no compiled kernels), when a launch hook
or a kernel's pre-run hook is set (a profiler), for a callable grid, when
``UNIPAGE_FAST_LAUNCH=0``, for a kernel whose compiled object lacks the
launcher it calls, and for a launch with an argument that does not hash (a TMA
tensor descriptor).  An entry is made with the Triton settings of its first
launch (``knobs.runtime.debug``, instrumentation): changing those later, or a
kernel's globals, needs ``UNIPAGE_FAST_LAUNCH=0``.  A kernel keeps at
most `MAX_ENTRIES` entries (ints that change every call and are not marked
``do_not_specialize`` would otherwise grow it); past that it starts over.
"""

from __future__ import annotations

import os

import torch
from triton.runtime.jit import JITFunction

try:
    from triton import knobs
except ImportError:  # pragma: no cover - Triton before 3.4 has no knobs: no fast path
    knobs = None

MAX_ENTRIES = 256
_ENABLED = os.environ.get("UNIPAGE_FAST_LAUNCH", "1") != "0" and knobs is not None
_INT32, _INT64 = (-(1 << 31), (1 << 31) - 1), (-(1 << 63), (1 << 63) - 1)


class _Kernel:
    """What a fast launch needs to know of one ``@triton.jit`` kernel, and its compiled entries."""

    __slots__ = ("binders", "const", "defaults", "entries", "loose", "name_set", "names", "usable")

    def __init__(self, kernel: JITFunction) -> None:
        self.names = [p.name for p in kernel.params]  # every parameter, in order (constexprs too)
        self.name_set = frozenset(self.names)
        self.defaults = {p.name: p.default for p in kernel.params if p.has_default}
        self.loose = frozenset(p.num for p in kernel.params if p.do_not_specialize)
        self.const = frozenset(p.num for p in kernel.params if p.is_constexpr)
        self.entries: dict[tuple, object] = {}  # traits -> compiled kernel
        self.binders: dict[tuple, object] = {}  # call shape -> `_binder` made for it (False: none could be)
        self.usable = True  # False: a compiled kernel lacked the launcher; always Triton's path


_kernels: dict[JITFunction, _Kernel] = {}
# The current device and its current raw stream, as Triton's own launch path asks torch for them.
_current_device = getattr(torch._C, "_cuda_getDevice", None) or torch.cuda.current_device
_current_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None) or (
    lambda device: torch.cuda.current_stream(device).cuda_stream)
launches = {"fast": 0, "triton": 0}  # counters, for tests and benchmarks


def _hooked() -> bool:
    """Whether a launch hook is set (a profiler's): Triton's launch path calls them, this one does not.
    Triton keeps its hooks in chains (`knobs.HookChain`), empty when none is set."""
    runtime = knobs.runtime
    for hook in (runtime.launch_enter_hook, runtime.launch_exit_hook):
        if hook is not None and getattr(hook, "calls", True):
            return True
    return False


def int_trait(value: int, loose: bool):
    """An int argument's part of the key: its value, or its type for a ``do_not_specialize`` one."""
    if not loose:
        return value
    if _INT32[0] <= value <= _INT32[1]:
        return "i32"
    return "i64" if _INT64[0] <= value <= _INT64[1] else "u64"


def traits(bound: list, loose: frozenset, const: frozenset = frozenset()) -> tuple:
    """The key of one launch's arguments (``bound``: every parameter's value, in order; ``loose``: the
    positions of ``do_not_specialize`` parameters, ``const`` those of ``tl.constexpr`` ones); see the module
    docstring."""
    key = []
    for i, value in enumerate(bound):
        cls = value.__class__
        if cls is int:
            key.append(int_trait(value, i in loose))
        elif cls is float:
            key.append(value if i in const else float)
        elif cls is bool:
            key.append((bool, value))
        elif isinstance(value, torch.Tensor):
            key.append((value.dtype, value.data_ptr() & 15))
        else:
            key.append(value)
    return tuple(key)


def bind(info: _Kernel, args: tuple, kwargs: dict) -> tuple[list, dict]:
    """``(every parameter's value in order, the launch options)`` of a call; TypeError if one is missing."""
    defaults, bound, taken = info.defaults, list(args), 0
    for name in info.names[len(args):]:
        if name in kwargs:
            bound.append(kwargs[name])
            taken += 1
        elif name in defaults:
            bound.append(defaults[name])
        else:
            raise TypeError(f"missing argument {name!r}")
    if taken == len(kwargs):
        return bound, {}
    return bound, {k: v for k, v in kwargs.items() if k not in info.name_set}


def _binder(info: _Kernel, args: tuple, kwargs: dict, bound: list):
    """A function ``(args, kwargs) -> (traits, bound, options items)`` equal to `bind` and `traits` for calls
    of this one's shape (positional count and keyword names) whose arguments have this call's kinds, and None
    (the caller's cue for the general path) for one that does not: generated code, one expression per
    parameter, without their loop.  False where a parameter's kind has no expression here."""
    names, ns = info.names, {"Tensor": torch.Tensor, "int_trait": int_trait}
    body = [f"    v{i} = args[{i}]" for i in range(len(args))]
    guards, parts = [], []
    for i, (name, value) in enumerate(zip(names, bound)):
        if i >= len(args) and name in kwargs:
            body.append(f"    v{i} = kwargs[{name!r}]")
        elif i >= len(args):  # a default: bound into the function
            body.append(f"    v{i} = D{i}")
            ns[f"D{i}"] = info.defaults[name]
        cls = value.__class__
        if isinstance(value, torch.Tensor):
            guards.append(f"isinstance(v{i}, Tensor)")
            parts.append(f"(v{i}.dtype, v{i}.data_ptr() & 15)")
        elif cls in (int, float, bool):
            guards.append(f"v{i}.__class__ is {cls.__name__}")
            parts.append({int: f"int_trait(v{i}, True)" if i in info.loose else f"v{i}",
                          float: f"v{i}" if i in info.const else "float", bool: f"(bool, v{i})"}[cls])
        elif value is None or cls is str:
            guards.append(f"v{i} is None" if value is None else f"v{i}.__class__ is str")
            parts.append(f"v{i}")
        else:  # a constexpr object, a dtype...: keyed by value by the general path
            return False
    items = "".join(f"({k!r}, kwargs[{k!r}]), " for k in kwargs if k not in info.name_set)
    values = ", ".join(f"v{i}" for i in range(len(names)))
    body += [f"    if not ({' and '.join(guards) or 'True'}):", "        return None",
             f"    return ({''.join(p + ', ' for p in parts)}), [{values}], ({items})"]
    exec("def binder(args, kwargs):\n" + "\n".join(body), ns)  # noqa: S102 - source built from names above
    return ns["binder"]


def _key(info: _Kernel, args: tuple, kwargs: dict) -> tuple[tuple, list, tuple]:
    """``(traits, every parameter's value, launch options' items)`` of a call: by the binder made for its
    shape at its first call, else `bind` and `traits` (TypeError if an argument is missing)."""
    shape = (len(args), *kwargs)
    binder = info.binders.get(shape)
    if binder:
        got = binder(args, kwargs)
        if got is not None:
            return got
    bound, options = bind(info, args, kwargs)
    if binder is None:
        info.binders[shape] = _binder(info, args, kwargs, bound)
    return traits(bound, info.loose, info.const), bound, tuple(options.items())


def launch(kernel, grid: tuple, *args, **kwargs) -> None:
    """``kernel[grid](*args, **kwargs)`` (``grid``: a tuple of one to three ints), with less host work."""
    if not (_ENABLED and kernel.__class__ is JITFunction and grid.__class__ is tuple and not _hooked()
            and not getattr(kernel, "pre_run_hooks", None)):
        if kernel.__class__ is not JITFunction and hasattr(kernel, "fn"):  # the interpreter's (CPU tests)
            check_binding(kernel, args, kwargs)
        kernel[grid](*args, **kwargs)
        return
    info = _kernels.get(kernel)
    if info is None:
        info = _kernels[kernel] = _Kernel(kernel)
    if not info.usable:
        _triton(kernel, grid, args, kwargs)
        return
    key_traits, bound, items = _key(info, args, kwargs)
    device = _current_device()
    key = (device, key_traits, *items)
    try:
        compiled = info.entries.get(key)
    except TypeError:  # an argument that does not hash (a TMA descriptor): this launch takes Triton's path
        _triton(kernel, grid, args, kwargs)
        return
    if compiled is None:
        _first(kernel, info, key, grid, args, kwargs)
        return
    stream = _current_stream(device)
    compiled.run(grid[0], grid[1] if len(grid) > 1 else 1, grid[2] if len(grid) > 2 else 1, stream,
                 compiled.function, compiled.packed_metadata, None, None, None, *bound)
    launches["fast"] += 1


LAUNCH_OPTIONS = frozenset({"num_warps", "num_stages", "num_ctas", "maxnreg", "launch_pdl"})
_interpreted: dict[object, _Kernel] = {}


def check_binding(kernel, args: tuple, kwargs: dict) -> None:
    """Under the interpreter (which launches every kernel through Triton), check that the fast path would
    bind this launch: every parameter given, nothing but `LAUNCH_OPTIONS` besides.  So the CPU tests of
    each launcher cover its call's binding; TypeError if it would not bind."""
    info = _interpreted.get(kernel)
    if info is None:
        info = _interpreted[kernel] = _Kernel(JITFunction(kernel.fn))
    bound, options = bind(info, args, kwargs)
    unknown = set(options) - LAUNCH_OPTIONS
    if unknown:
        raise TypeError(f"{kernel.fn.__name__}: keyword arguments that are neither parameters nor launch "
                        f"options: {sorted(unknown)}")
    traits(bound, info.loose, info.const)


def _triton(kernel: JITFunction, grid: tuple, args: tuple, kwargs: dict):
    """Triton's own launch; returns its compiled kernel."""
    launches["triton"] += 1
    return kernel[grid](*args, **kwargs)


def _first(kernel: JITFunction, info: _Kernel, key: tuple, grid: tuple, args: tuple, kwargs: dict) -> None:
    """Triton's own launch; its compiled kernel is kept under ``key``."""
    compiled = _triton(kernel, grid, args, kwargs)
    if not all(hasattr(compiled, name) for name in ("run", "function", "packed_metadata")):
        info.usable = False
        return
    if len(info.entries) >= MAX_ENTRIES:
        info.entries.clear()
    info.entries[key] = compiled
