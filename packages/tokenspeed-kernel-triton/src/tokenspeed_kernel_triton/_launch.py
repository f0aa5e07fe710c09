"""Launching a compiled Triton kernel without re-binding its arguments on every call.

`JITFunction.run` binds and specializes every argument, hashes the specialization and the
options, builds launch metadata for (usually absent) launch hooks and only then reaches the
kernel's C launcher. On the GPU machine's host that is ~45 us per launch on top of ~20 us in
the C launcher, and an op makes up to four launches. `bind_launches` keeps, per argument
signature, the compiled kernel Triton chose the first time and sends later launches straight to
its launcher.

The signature of a call is at least as fine as Triton's specialization, so a cached kernel is
only reused where Triton would have picked the same one: tensors by dtype and 16-byte alignment,
ints by the classes Triton specializes on (== 1, divisible by 16, 32- or 64-bit range), floats
by type, everything else (constexprs, launch options, None, bools) by value. The first call of
each signature, a grid given as a callable, an active launch hook (a profiler) and anything that
is not a compiled CUDA/HIP JIT kernel (the interpreter, the AOT tool's interception, a
process that has not initialized CUDA) take Triton's own path.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from triton import knobs
from triton.compiler.compiler import CompiledKernel
from triton.runtime.jit import JITFunction

_I32 = (-(1 << 31), (1 << 31) - 1)
_cuda_ready = torch.cuda.is_initialized
_U64_FROM = 1 << 63


def _signature_of(arg: Any) -> Any:
    if isinstance(arg, torch.Tensor):
        return (arg.dtype, arg.data_ptr() % 16 == 0)
    kind = type(arg)
    if kind is int:
        return (arg == 1, arg % 16 == 0, _I32[0] <= arg <= _I32[1], arg >= _U64_FROM)
    if kind is float:
        return float
    return (kind, arg)


class _Entry:
    __slots__ = ("kernel", "tail")

    def __init__(self, kernel: CompiledKernel, tail: tuple):
        self.kernel = kernel
        self.tail = tail  # the parameters after the positional ones, fixed by the signature


class BoundKernel:
    """A JIT kernel whose launches after the first skip Triton's per-call argument binding.
    Launched like the kernel itself: `kernel[grid](*args, **constexprs)`; every other attribute
    is the wrapped JITFunction's."""

    def __init__(self, fn: JITFunction):
        self.fn = fn
        self._entries: dict[tuple, _Entry] = {}
        self._params = fn.params

    def __getattr__(self, name: str) -> Any:
        return getattr(self.fn, name)

    def __getitem__(self, grid):
        return functools.partial(self._launch, grid)

    def _launch(self, grid, *args, **kwargs):
        if not _cuda_ready():  # no device (the AOT tool compiles CPU inputs): Triton's path
            return self.fn[grid](*args, **kwargs)
        try:
            device = torch.cuda.current_device()
            key = (device, tuple(map(_signature_of, args)), tuple(kwargs.items()))
            entry = self._entries.get(key)
        except TypeError:  # an unhashable argument: nothing to key on
            return self.fn[grid](*args, **kwargs)
        enter, exit_ = knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook
        if entry is None or callable(grid) or enter.calls or exit_.calls:
            kernel = self.fn[grid](*args, **kwargs)
            if entry is None and isinstance(kernel, CompiledKernel):
                self._entries[key] = _Entry(kernel, self._tail(len(args), kwargs))
            return kernel
        kernel = entry.kernel
        stream = torch._C._cuda_getCurrentRawStream(device)
        kernel.run(
            grid[0],
            grid[1] if len(grid) > 1 else 1,
            grid[2] if len(grid) > 2 else 1,
            stream,
            kernel.function,
            kernel.packed_metadata,
            None,  # launch metadata: only launch hooks read it, and none is set
            None,
            None,
            *args,
            *entry.tail,
        )
        return kernel

    def _tail(self, positional: int, kwargs: dict) -> tuple:
        tail = []
        for param in self._params[positional:]:
            if param.name in kwargs:
                tail.append(kwargs[param.name])
            elif param.has_default:
                tail.append(param.default)
            else:  # Triton's binder raised on the first call already
                raise TypeError(f"{self.fn.__name__}: missing argument {param.name!r}")
        return tuple(tail)


def bind_launches(fn):
    """Decorator, above `@triton.jit` / `@gluon.jit`. Leaves anything but a JITFunction (the
    interpreter's functions) as it is."""
    return BoundKernel(fn) if isinstance(fn, JITFunction) else fn
