"""`unipage.kernels.launch`: the traits that key a compiled kernel, argument binding, and (GPU) that a
fast launch computes what Triton's own launch does."""

import pytest
import torch
from triton.runtime.jit import JITFunction
from unipage.kernels import launch as L


def _body(x_ptr, out_ptr, n, stride, scale, FLAG, BLOCK=64, EPS=1e-6):  # a kernel's signature (never run)
    pass


_body.__annotations__ = {"FLAG": "constexpr", "BLOCK": "constexpr", "EPS": "constexpr"}
KERNEL = JITFunction(_body, do_not_specialize=["n"])
INFO = L._Kernel(KERNEL)


def test_kernel_info_reads_the_signature():
    assert INFO.names == ["x_ptr", "out_ptr", "n", "stride", "scale", "FLAG", "BLOCK", "EPS"]
    assert INFO.loose == frozenset({2}) and INFO.const == frozenset({5, 6, 7})
    assert INFO.defaults == {"BLOCK": 64, "EPS": 1e-6}


def test_bind_orders_every_parameter_and_separates_launch_options():
    x, out = torch.ones(4), torch.zeros(4)
    bound, options = L.bind(INFO, (x, out, 7), {"stride": 4, "scale": 0.5, "FLAG": True, "num_warps": 8})
    assert bound == [x, out, 7, 4, 0.5, True, 64, 1e-6] and options == {"num_warps": 8}
    bound, options = L.bind(INFO, (x,), {"out_ptr": out, "n": 1, "stride": 1, "scale": 1.0, "FLAG": False,
                                         "BLOCK": 32})
    assert bound[1] is out and bound[-2] == 32 and options == {}
    with pytest.raises(TypeError, match="'scale'"):
        L.bind(INFO, (x, out, 7, 4), {"FLAG": True})


def test_traits_are_finer_than_tritons_specialisation():
    buf = torch.zeros(64, dtype=torch.float16)
    def key(*values):
        return L.traits([buf, buf, *values], INFO.loose, INFO.const)

    base = key(5, 16, 0.5, True, 64, 1e-6)
    # the token count (do_not_specialize) only by its width; a float argument by its type
    assert key(99, 16, 2.0, True, 64, 1e-6) == base
    assert key(1 << 40, 16, 0.5, True, 64, 1e-6) != base
    # a specialised int by its value, a constexpr (float, bool or int) by its value, a bool apart from 1
    assert key(5, 17, 0.5, True, 64, 1e-6) != base
    assert key(5, 16, 0.5, True, 64, 1e-5) != base
    assert key(5, 16, 0.5, False, 64, 1e-6) != base
    assert key(5, 16, 0.5, 1, 64, 1e-6) != base
    # a tensor by dtype and alignment
    assert L.traits([buf[1:], buf, 5, 16, 0.5, True, 64, 1e-6], INFO.loose, INFO.const) != base  # 2 bytes off
    assert L.traits([buf.float(), buf, 5, 16, 0.5, True, 64, 1e-6], INFO.loose, INFO.const) != base
    assert L.int_trait(-(1 << 31), True) == "i32" and L.int_trait(1 << 31, True) == "i64"
    assert L.int_trait(1 << 63, True) == "u64" and L.int_trait(1 << 31, False) == 1 << 31


def test_the_binder_made_for_a_call_shape_keys_and_binds_as_bind_and_traits_do():
    """Calls of one shape (positional count, keyword names) through the generated binder: the same traits,
    values and options as the general path, whatever the values; a call whose kinds differ from the first
    one's (a bool for an int, an int for a tensor) is left to the general path (None)."""
    info = L._Kernel(JITFunction(_body, do_not_specialize=["n"]))
    buf = torch.zeros(64, dtype=torch.float16)

    def general(args, kwargs):
        bound, options = L.bind(info, args, kwargs)
        return L.traits(bound, info.loose, info.const), bound, tuple(options.items())

    first = ((buf, buf, 7), {"stride": 4, "scale": 0.5, "FLAG": True, "num_warps": 8})
    binder = L._binder(info, *first, L.bind(info, *first)[0])
    calls = [first, ((buf[1:], buf.float(), 1 << 40), {"stride": 16, "scale": 2.0, "FLAG": False, "num_warps": 4}),
             ((buf, buf, -3), {"stride": 0, "scale": 0.0, "FLAG": True, "num_warps": 8})]
    for args, kwargs in calls:
        assert binder(args, kwargs) == general(args, kwargs)
    assert binder((buf, buf, True), first[1]) is None  # a bool where the first call had an int
    assert binder((buf, 3, 7), first[1]) is None
    with_str = ((buf, buf, 7, 4, 0.5, "tf32"), {"BLOCK": 32})
    assert L._binder(info, *with_str, L.bind(info, *with_str)[0])(*with_str) == general(*with_str)
    odd = ((buf, buf, 7, 4, 0.5, torch.float16), {})  # a kind with no expression: no binder
    assert L._binder(info, *odd, L.bind(info, *odd)[0]) is False
    # through `_key`: made at a shape's first call, then used
    assert L._key(info, *calls[1]) == general(*calls[1]) and (3, "stride", "scale", "FLAG", "num_warps") in info.binders
    assert L._key(info, *calls[2]) == general(*calls[2])


class _Recorder:
    """Anything that is not a `JITFunction` (the interpreter's kernels): launched through ``[grid]``."""

    def __init__(self):
        self.calls = []

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.calls.append((grid, args, kwargs))


def test_an_unhashable_argument_takes_tritons_path(monkeypatch):
    calls = []
    monkeypatch.setattr(L, "_ENABLED", True)
    monkeypatch.setattr(L, "_current_device", lambda: 0)
    monkeypatch.setattr(L, "_triton", lambda kernel, grid, args, kwargs: calls.append((grid, args)))
    kernel = JITFunction(_body, do_not_specialize=["n"])
    x = torch.ones(4)
    for _ in range(2):  # (a TMA descriptor does not hash either)
        L.launch(kernel, (1,), x, x, 7, [4], 0.5, FLAG=True)
    assert len(calls) == 2 and not L._kernels[kernel].entries


class _Interpreted(_Recorder):
    """The interpreter's kind of kernel: launched through ``[grid]``, its binding checked first."""

    fn = staticmethod(_body)


def test_interpreted_launches_are_checked_for_the_fast_paths_binding():
    kernel, x = _Interpreted(), torch.ones(4)
    L.launch(kernel, (2,), x, x, 7, 4, 0.5, FLAG=True, num_warps=4)
    assert len(kernel.calls) == 1
    with pytest.raises(TypeError, match="BLOKC"):  # a misspelt constexpr would be taken for a launch option
        L.launch(kernel, (2,), x, x, 7, 4, 0.5, FLAG=True, BLOKC=32)
    with pytest.raises(TypeError, match="'FLAG'"):
        L.launch(kernel, (2,), x, x, 7, 4, 0.5)
    assert len(kernel.calls) == 1


def test_other_kernels_take_tritons_path():
    kernel = _Recorder()
    L.launch(kernel, (3, 2), 1, 2, FLAG=True)
    assert kernel.calls == [((3, 2), (1, 2), {"FLAG": True})]


def test_a_launch_hook_sends_launches_through_triton():
    chain = L.knobs.runtime.launch_enter_hook
    assert not L._hooked()  # Triton's chains are empty unless a profiler adds a hook

    def hook(metadata):
        pass

    if hasattr(chain, "add"):
        chain.add(hook)
        try:
            assert L._hooked()
        finally:
            chain.remove(hook)
        assert not L._hooked()


@pytest.mark.gpu
def test_gpu_fast_launch_matches_tritons_launch():
    from unipage.kernels.elementwise import rms_norm, rms_norm_ref

    gen = torch.Generator(device="cuda").manual_seed(0)
    w = torch.randn(2048, device="cuda", generator=gen).to(torch.bfloat16)
    outs = []
    for tokens in (37, 37, 64, 1):  # the first launch compiles; later ones take the fast path
        x = torch.randn(tokens, 2048, device="cuda", generator=gen).to(torch.bfloat16)
        before = dict(L.launches)
        outs.append((rms_norm(x, w, 1e-6), rms_norm_ref(x, w, 1e-6)))
        if tokens != 37 or len(outs) > 1:
            assert L.launches["fast"] == before["fast"] + 1, "a launch with known traits took Triton's path"
    for got, ref in outs:
        torch.testing.assert_close(got.float(), ref.float(), rtol=1e-2, atol=1e-2)
    flat = torch.randn(8 * 2048 + 1, device="cuda", generator=gen).to(torch.bfloat16)
    x = flat[1:].view(8, 2048)  # 2 bytes off 16-byte alignment: new traits, Triton's path (its own kernel)
    before = dict(L.launches)
    got = rms_norm(x, w, 1e-6)
    assert L.launches["triton"] == before["triton"] + 1
    torch.testing.assert_close(got.float(), rms_norm_ref(x, w, 1e-6).float(), rtol=1e-2, atol=1e-2)
