"""Bound launches (`_launch.py`): a cached kernel is reused only where Triton would pick the
same one, everything Triton has to see (hooks, callable grids, odd argument types, tensors off
the device) goes its path, and on a GPU a reused kernel gives the same results as Triton's own
path for every specialization class.

The CPU tests run the launch logic with Triton's path and the C launcher replaced by
recorders: the module believes CUDA is up with device index -1, which is what `get_device()`
gives for the CPU tensors used here."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import triton
import triton.language as tl
from triton import knobs
from triton.backends.nvidia.driver import CudaLauncher
from triton.compiler.compiler import CompiledKernel
from triton.runtime.jit import JITFunction

from tokenspeed_kernel_triton import _launch
from tokenspeed_kernel_triton._launch import BoundKernel, _Layout, _signature_of, bind_launches


def _add(x_ptr, y_ptr, n, scale, BLOCK: tl.constexpr = 64):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    tl.store(y_ptr + offs, tl.load(x_ptr + offs, mask=mask) * scale + n, mask=mask)


def test_signature_separates_what_triton_specializes_on():
    base = torch.zeros(64)
    assert _signature_of(base) != _signature_of(base[1:])  # 16-byte aligned or not
    assert _signature_of(base) != _signature_of(base.to(torch.float16))
    ints = [_signature_of(v) for v in (1, 2, 16, 1 << 31, 1 << 63)]
    assert len(set(ints)) == len(ints)
    assert _signature_of(3) == _signature_of(5)  # one class: neither 1 nor a multiple of 16
    assert _signature_of(0.5) == _signature_of(2.0)
    assert _signature_of(None) != _signature_of(True)
    assert _signature_of(True) != _signature_of(1)


def test_interpreted_functions_are_left_alone():
    interpreted = triton.jit(_add)  # TRITON_INTERPRET=1 in this directory's tests
    assert bind_launches(interpreted) is interpreted


def test_bound_kernel_forwards_the_jit_function_attributes():
    bound = bind_launches(JITFunction(_add))
    assert isinstance(bound, BoundKernel)
    assert bound.arg_names == ["x_ptr", "y_ptr", "n", "scale", "BLOCK"]
    # Defaults of trailing parameters fill the tail of a cached launch.
    assert bound._tail(4, {}) == (64,)
    assert bound._tail(3, {"scale": 2.0, "BLOCK": 32}) == (2.0, 32)


@pytest.mark.parametrize("tensors", [0, 1, 2, 3])
@pytest.mark.parametrize("values", [0, 1, 2])
def test_layout_merge_puts_addresses_back_in_argument_order(tensors, values):
    kinds = ["t"] * tensors + ["v"] * values
    rng = np.random.default_rng(tensors * 10 + values)
    kinds = [kinds[i] for i in rng.permutation(len(kinds))]
    args = tuple(torch.zeros(2) if kind == "t" else 100 + i for i, kind in enumerate(kinds))
    t_at = [i for i, kind in enumerate(kinds) if kind == "t"]
    v_at = [i for i, kind in enumerate(kinds) if kind == "v"]
    layout = _Layout(tuple(map(type, args)), t_at, v_at)
    addresses = tuple(f"ptr{i}" for i in t_at)  # stand-ins, one per tensor getter item
    if len(t_at) == 1:
        addresses *= 2  # the getter of one position yields it twice
    merged = layout.merge(addresses + layout.values(args))
    assert merged == tuple(f"ptr{i}" if kind == "t" else args[i] for i, kind in enumerate(kinds))


# ----------------------------------------------------------------- launch logic, on the CPU


class _Recorder:
    """Triton's path and the C launcher of one compiled kernel, recorded."""

    def __init__(self, jit: JITFunction):
        self.params = jit.params
        self.__name__ = jit.__name__
        self.triton_calls: list[tuple] = []
        self.launches: list[tuple] = []
        run = object.__new__(CudaLauncher)  # its attributes only: no CUDA here
        run.launch = lambda *args: self.launches.append(args)
        run.global_scratch_size = run.profile_scratch_size = 0
        run.launch_cooperative_grid, run.launch_pdl = False, True
        self.kernel = object.__new__(CompiledKernel)
        self.kernel._run = run
        self.kernel.function, self.kernel.packed_metadata = 7, "packed"

    def __getitem__(self, grid):
        def run(*args, **kwargs):
            self.triton_calls.append((grid, args, kwargs))
            return self.kernel

        return run


class _OtherLauncher:
    """A launcher that is not Triton's CUDA one (HIP, a newer Triton): called as it is."""

    def __init__(self):
        self.calls: list[tuple] = []

    def __call__(self, *args):
        self.calls.append(args)


@pytest.fixture
def cuda_faked(monkeypatch):
    monkeypatch.setattr(_launch, "_cuda_ready", lambda: True)
    monkeypatch.setattr(_launch, "_current_device", lambda: -1)  # CPU tensors' get_device()
    monkeypatch.setattr(_launch, "_current_stream", lambda device: 1000 + device)


def _bound():
    recorder = _Recorder(JITFunction(_add))
    bound = BoundKernel(JITFunction(_add))
    bound.fn = recorder
    return bound, recorder


def test_a_repeated_call_skips_triton_and_passes_addresses(cuda_faked):
    bound, rec = _bound()
    x, y = torch.zeros(64), torch.zeros(64)
    bound[(4,)](x, y, 37, 0.5)
    assert len(rec.triton_calls) == 1 and rec.launches == []
    bound[(4, 2)](x, y, 37, 0.5)
    assert len(rec.triton_calls) == 1
    head = (4, 2, 1, 999, 7, False, True, None, None, "packed", None, None, None)
    assert rec.launches == [(*head, x.data_ptr(), y.data_ptr(), 37, 0.5, 64)]


def test_a_new_value_of_the_same_class_reuses_the_kernel(cuda_faked):
    bound, rec = _bound()
    buf, y = torch.zeros(64), torch.zeros(64)
    bound[(1,)](buf, y, 37, 0.5)
    bound[(1,)](buf[4:], y, 53, 2.0)  # 16 bytes further: still aligned; 53 like 37
    assert len(rec.triton_calls) == 1
    assert rec.launches[-1][13:] == (buf[4:].data_ptr(), y.data_ptr(), 53, 2.0, 64)
    bound[(1,)](buf[4:], y, 53, 2.0)  # now an exact hit
    assert len(rec.triton_calls) == 1 and len(rec.launches) == 2


_BASE = dict(x=torch.zeros(64), n=37, scale=0.5, kwargs={})
_VARIANTS = {
    "n == 1": dict(n=1),
    "n multiple of 16": dict(n=32),
    "n past int32": dict(n=1 << 31),
    "n past int32, negative": dict(n=-(1 << 31) - 3),
    "n past int64": dict(n=1 << 63),
    "n a bool": dict(n=True),
    "scale an int": dict(scale=2),
    "x unaligned": dict(x=torch.zeros(64)[1:]),
    "x another dtype": dict(x=torch.zeros(64, dtype=torch.float16)),
    "another constexpr": dict(kwargs={"BLOCK": 32}),
    "a constexpr as a bool": dict(kwargs={"BLOCK": True}),
    "a launch option": dict(kwargs={"num_warps": 8}),
}


@pytest.mark.parametrize("variant", list(_VARIANTS))
def test_each_specialization_class_reaches_triton(cuda_faked, variant):
    """Finer than Triton: a call in another class than the cached ones goes Triton's path."""
    bound, rec = _bound()
    y = torch.zeros(64)

    def call(x, n, scale, kwargs):
        bound[(1,)](x, y, n, scale, **kwargs)

    call(**_BASE)
    call(**_BASE)
    assert len(rec.triton_calls) == 1
    changed = dict(_BASE, **_VARIANTS[variant])
    call(**changed)
    assert len(rec.triton_calls) == 2
    call(**changed)  # cached in turn
    call(**_BASE)
    assert len(rec.triton_calls) == 2


def test_constexprs_equal_as_values_but_of_other_types_are_other_kernels(cuda_faked):
    bound, rec = _bound()
    x, y = torch.zeros(64), torch.zeros(64)
    for block in (1, True, 1.0, 1, True, 1.0):  # 1 == True == 1.0 in a dict
        bound[(1,)](x, y, 37, 0.5, BLOCK=block)
        bound[(1,)](x, y, 37, 0.5, block)
    assert len(rec.triton_calls) == 6
    assert len(bound._entries) == 6


def test_a_positional_constexpr_is_keyed_by_value(cuda_faked):
    bound, rec = _bound()
    x, y = torch.zeros(64), torch.zeros(64)
    bound[(1,)](x, y, 37, 0.5, 64)
    bound[(1,)](x, y, 37, 0.5, 32)  # same int class as 64, another kernel
    assert len(rec.triton_calls) == 2
    bound[(1,)](x, y, 37, 0.5, 32)
    assert len(rec.triton_calls) == 2
    assert rec.launches[-1][-1] == 32


def test_a_launch_hook_takes_triton_path(cuda_faked):
    bound, rec = _bound()
    x, y = torch.zeros(64), torch.zeros(64)
    bound[(1,)](x, y, 37, 0.5)

    def hook(metadata):
        pass

    for chain in (knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook):
        chain.add(hook)
        try:
            bound[(1,)](x, y, 37, 0.5)  # cached
            bound[(1,)](x, y, 38, 0.5)  # its signature is cached
        finally:
            chain.remove(hook)
    assert len(rec.triton_calls) == 5 and rec.launches == []
    bound[(1,)](x, y, 37, 0.5)
    assert len(rec.triton_calls) == 5 and len(rec.launches) == 1


@pytest.mark.parametrize("hook", [None, print], ids=["None", "a function"])
def test_a_hook_assigned_in_place_of_the_chain_takes_triton_path(cuda_faked, hook):
    bound, rec = _bound()
    x, y = torch.zeros(64), torch.zeros(64)
    bound[(1,)](x, y, 37, 0.5)
    with knobs.runtime.scope():
        knobs.runtime.launch_exit_hook = hook
        bound[(1,)](x, y, 37, 0.5)
        bound[(1,)](x, y, 38, 0.5)
    assert len(rec.triton_calls) == 3 and rec.launches == []


def test_a_callable_grid_takes_triton_path(cuda_faked):
    bound, rec = _bound()
    x, y = torch.zeros(64), torch.zeros(64)
    for _ in range(3):
        bound[lambda meta: (1,)](x, y, 37, 0.5)
    assert len(rec.triton_calls) == 3 and rec.launches == []


@pytest.mark.parametrize(
    "args, kwargs",
    [
        ((37, np.float32(0.5)), {}),  # a type without an exact key
        ((37, (0.5,)), {}),
        ((37,), {"scale": 0.5}),  # a runtime parameter by keyword
        ((37, 0.5), {"BLOCK": [64]}),  # unhashable
    ],
)
def test_calls_without_an_exact_key_take_triton_path(cuda_faked, args, kwargs):
    bound, rec = _bound()
    x, y = torch.zeros(64), torch.zeros(64)
    for _ in range(3):
        bound[(1,)](x, y, *args, **kwargs)
    assert len(rec.triton_calls) == 3 and rec.launches == []


def test_a_tensor_off_the_current_device_takes_triton_path(cuda_faked, monkeypatch):
    bound, rec = _bound()
    x, y = torch.zeros(64), torch.zeros(64)
    bound[(1,)](x, y, 37, 0.5)
    bound[(1,)](x, y, 37, 0.5)
    assert len(rec.triton_calls) == 1 and len(rec.launches) == 1
    monkeypatch.setattr(_launch, "_current_device", lambda: 0)  # x and y are "on the CPU"
    for _ in range(2):
        bound[(1,)](x, y, 37, 0.5)
    assert len(rec.triton_calls) == 3 and len(rec.launches) == 1
    assert all(key[0] == -1 for key in bound._calls)


def test_another_launcher_gets_the_tensors(cuda_faked):
    recorder = _Recorder(JITFunction(_add))
    run = _OtherLauncher()
    recorder.kernel._run = run
    bound = BoundKernel(JITFunction(_add))
    bound.fn = recorder
    x, y = torch.zeros(64), torch.zeros(64)
    bound[(1,)](x, y, 37, 0.5)
    bound[(1,)](x, y, 37, 0.5)
    assert len(recorder.triton_calls) == 1
    ((*head, a, b, n, scale, block),) = run.calls
    assert head == [1, 1, 1, 999, 7, "packed", None, None, None]
    assert a is x and b is y and (n, scale, block) == (37, 0.5, 64)


def test_exact_keys_are_bounded(cuda_faked, monkeypatch):
    monkeypatch.setattr(_launch, "MAX_CALLS", 4)
    bound, rec = _bound()
    x, y = torch.zeros(64), torch.zeros(64)
    for n in range(3, 300, 16):  # one class, many values
        bound[(1,)](x, y, n, 0.5)
        assert len(bound._calls) <= 4
    assert len(rec.triton_calls) == 1 and len(bound._entries) == 1


def test_without_cuda_everything_takes_triton_path(monkeypatch):
    monkeypatch.setattr(_launch, "_cuda_ready", lambda: False)
    bound, rec = _bound()
    x, y = torch.zeros(64), torch.zeros(64)
    for _ in range(2):
        bound[(1,)](x, y, 37, 0.5)
    assert len(rec.triton_calls) == 2 and not bound._calls


# ----------------------------------------------------------------------------------- GPU


def _gpu_kernels():
    return bind_launches(JITFunction(_add)), JITFunction(_add)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_reused_kernels_match_triton_for_every_specialization():
    bound, plain = _gpu_kernels()
    buf = torch.arange(300, dtype=torch.float32, device="cuda")
    for offset in (0, 1, 4):  # aligned and misaligned pointers
        for n in (1, 16, 37, 256):  # == 1, multiple of 16, neither
            x = buf[offset : offset + n]
            want = torch.empty(n, device="cuda")
            plain[(triton.cdiv(n, 64),)](x, want, n, 0.5)
            for _ in range(2):  # the second launch reuses the bound kernel
                got = torch.full((n,), float("nan"), device="cuda")
                bound[(triton.cdiv(n, 64),)](x, got, n, 0.5)
                torch.testing.assert_close(got, want, rtol=0, atol=0)
    # Offsets 0 and 4 floats are both 16-byte aligned: 2 alignments x 3 int classes.
    assert len(bound._entries) == 2 * 3


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cached_launches_go_to_the_c_launcher_with_addresses():
    bound, _ = _gpu_kernels()
    x = torch.arange(100, dtype=torch.float32, device="cuda")
    y = torch.empty(100, device="cuda")
    bound[(2,)](x, y, 100, 2.0)
    (entry,) = bound._entries.values()
    assert entry.direct, "Triton's CUDA launcher changed: launches go through its Python call"
    for n in (100, 37):  # an exact hit, then a new value of the same class
        y.fill_(float("nan"))
        bound[(2,)](x, y, n, 2.0)
        torch.testing.assert_close(y[:n], x[:n] * 2 + n, rtol=0, atol=0)
    assert len(bound._entries) == 1 and len(bound._calls) == 2


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_positional_constexprs_and_launch_hooks_on_the_gpu():
    bound, _ = _gpu_kernels()
    x = torch.arange(100, dtype=torch.float32, device="cuda")
    y = torch.empty(100, device="cuda")
    for block in (64, 32, 64, 32):  # BLOCK positionally: each value its own kernel
        y.fill_(float("nan"))
        bound[(triton.cdiv(100, block),)](x, y, 100, 1.0, block)
        torch.testing.assert_close(y, x + 100, rtol=0, atol=0)
    assert len(bound._entries) == 2
    seen = []

    def hook(metadata):
        seen.append(metadata.get()["name"])

    knobs.runtime.launch_enter_hook.add(hook)
    try:
        bound[(2,)](x, y, 100, 1.0, 64)
    finally:
        knobs.runtime.launch_enter_hook.remove(hook)
    assert seen == ["_add"]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_cpu_tensor_gets_tritons_error_after_caching():
    bound, _ = _gpu_kernels()
    x = torch.arange(100, dtype=torch.float32, device="cuda")
    y = torch.empty(100, device="cuda")
    bound[(2,)](x, y, 100, 1.0)
    bound[(2,)](x, y, 100, 1.0)
    with pytest.raises(ValueError, match="cpu tensor"):
        bound[(2,)](x.cpu(), y, 100, 1.0)
