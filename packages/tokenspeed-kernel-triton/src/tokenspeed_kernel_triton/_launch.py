"""Launching a compiled Triton kernel without re-binding its arguments on every call.

`JITFunction.run` binds and specializes every argument, hashes the specialization and the
options, builds launch metadata for (usually absent) launch hooks and only then reaches the
kernel's C launcher. On the GPU machine's host that is ~45 us per launch on top of ~20 us in
the C launcher, and an op makes up to four launches. `bind_launches` keeps, per argument
signature, the compiled kernel Triton chose the first time and sends later launches straight to
its C launcher.

The signature of a call is at least as fine as Triton's specialization, so a cached kernel is
only reused where Triton would have picked the same one: tensors by dtype and 16-byte alignment,
ints by the classes Triton specializes on (== 1, divisible by 16, 32- or 64-bit range), floats
by type, constexprs (positional or by keyword), launch options, None and bools by type and
value. The first call of each signature, a grid given as a callable, an active launch hook (a
profiler), an argument of another type (a tuple, a tensor descriptor, a numpy scalar), a
runtime parameter passed by keyword, a tensor off the current device and anything that is not
a compiled CUDA/HIP JIT kernel (the interpreter, the AOT tool's interception, a process that
has not initialized CUDA) take Triton's own path.

Two levels keep the per-call key cheap. A call is first looked up by its exact key: the
device, the argument types, each tensor's dtype, device and address modulo 16, every other
argument and keyword by type and value, gathered by C-level `map`s and getters without a Python
call per argument. That key is finer than the signature, so a miss there (a new stride, say)
computes the signature (a Python call per argument) and finds the kernel it chose; Triton's
path runs once per signature. Triton's CUDA launcher gets each tensor as its address, which
the key has read already: given a tensor, the launcher would call `data_ptr()` again and ask
the driver whether that is device memory, which the device check of the key answers.
"""

from __future__ import annotations

import functools
from operator import attrgetter, itemgetter, or_
from typing import Any

import torch
from triton import knobs
from triton.compiler.compiler import CompiledKernel
from triton.runtime.jit import JITFunction

_I32 = (-(1 << 31), (1 << 31) - 1)
_U64_FROM = 1 << 63
_cuda_ready = torch.cuda.is_initialized
# What torch.cuda.current_device() and Triton's get_current_stream call, without the lazy-init
# checks `_cuda_ready` stands for. Absent from a CPU-only torch, where it is always False.
_current_device = getattr(torch._C, "_cuda_getDevice", None)
_current_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)
_dtype_of = attrgetter("dtype")
_data_ptr = torch.Tensor.data_ptr  # raises TypeError on anything but a tensor
_device_of = torch.Tensor.get_device  # -1 on the CPU
_low_bits = (15).__and__
_or = functools.partial(functools.reduce, or_)
_partial = functools.partial
# Argument types keyed by value in the exact key: immutable, hashed and compared by value.
_VALUE_TYPES = frozenset({int, float, bool, type(None), str, torch.dtype})
# Exact keys kept per kernel; past this the table starts over (signatures are kept).
MAX_CALLS = 1024


def _signature_of(arg: Any) -> Any:
    """The specialization class of a non-constexpr argument (at least as fine as Triton's)."""
    if isinstance(arg, torch.Tensor):
        return (arg.dtype, arg.data_ptr() % 16 == 0)
    kind = type(arg)
    if kind is int:
        return (arg == 1, arg % 16 == 0, _I32[0] <= arg <= _I32[1], arg >= _U64_FROM)
    if kind is float:
        return float
    return (kind, arg)


def _getter(positions: list[int]):
    """A C-level function of `args` giving a tuple of the args at `positions` (twice the only
    one, where there is one: itemgetter of one position returns the item itself)."""
    if not positions:
        return lambda args: ()
    return itemgetter(*positions) if len(positions) > 1 else itemgetter(positions[0], positions[0])


def _hooks_set() -> bool:
    """Whether a launch hook is set: Triton's chains hold one, or a hook was assigned as a
    plain function or None (which Triton's own path also handles)."""
    hooks = knobs.runtime
    try:
        return bool(hooks.launch_enter_hook.calls or hooks.launch_exit_hook.calls)
    except AttributeError:
        return True


def _direct_launcher(run) -> bool:
    """Whether Triton's CUDA launcher object would only forward to its C function: no global or
    profile scratch to allocate per launch."""
    return (
        type(run).__name__ == "CudaLauncher"
        and callable(getattr(run, "launch", None))
        and not getattr(run, "global_scratch_size", 1)
        and not getattr(run, "profile_scratch_size", 1)
    )


class _Layout:
    """Where the tensors and the values are among positional arguments of `types`, as C-level
    getters (None: a type that has no exact key, Triton's path), and `merge`, which puts
    `tensors(args) + values(args)` (or their stand-ins) back in argument order. Hashed by
    identity: one per `types` per kernel, kept for the kernel's life."""

    __slots__ = ("types", "tensors", "values", "merge")

    def __init__(self, types, tensor_positions: list[int] | None, value_positions: list[int]):
        self.types = types
        if tensor_positions is None:
            self.tensors = self.values = self.merge = None
            return
        self.tensors, self.values = _getter(tensor_positions), _getter(value_positions)
        # Index of each argument in tensors(args) + values(args); a getter of one position
        # yields it twice.
        order = [0] * (len(tensor_positions) + len(value_positions))
        for index, position in enumerate(tensor_positions):
            order[position] = index
        first_value = len(tensor_positions) if len(tensor_positions) != 1 else 2
        for index, position in enumerate(value_positions):
            order[position] = first_value + index
        if len(order) > 1:
            self.merge = itemgetter(*order)
        else:  # the only argument comes first (if any): a slice keeps it a tuple
            self.merge = itemgetter(slice(0, len(order)))


class _Entry:
    """A compiled kernel and how to launch it: `launch(gx, gy, gz, stream, *head, *args,
    *tail)`, tensors given by address where `direct` (the C launcher: it would otherwise ask
    each tensor for its address and the driver whether that is device memory)."""

    __slots__ = ("kernel", "launch", "head", "tail", "direct")

    def __init__(self, kernel: CompiledKernel, tail: tuple):
        self.kernel = kernel
        self.tail = tail  # the parameters after the positional ones, fixed by the signature
        run = kernel.run
        # No launch metadata and no hooks: only launch hooks read them, and none is set.
        meta = (kernel.packed_metadata, None, None, None)
        self.direct = _direct_launcher(run)
        if self.direct:
            self.launch = run.launch
            cooperative, pdl = run.launch_cooperative_grid, run.launch_pdl
            self.head = (kernel.function, cooperative, pdl, None, None, *meta)
        else:
            self.launch = run
            self.head = (kernel.function, *meta)

    def fire(self, grid, stream: int, args: tuple, by_address: tuple) -> CompiledKernel:
        """`by_address`: `args` with each tensor replaced by its address."""
        size = len(grid)
        self.launch(
            grid[0],
            grid[1] if size > 1 else 1,
            grid[2] if size > 2 else 1,
            stream,
            *self.head,
            *(by_address if self.direct else args),
            *self.tail,
        )
        return self.kernel


class BoundKernel:
    """A JIT kernel whose launches after the first skip Triton's per-call argument binding.
    Launched like the kernel itself: `kernel[grid](*args, **constexprs)`; every other attribute
    is the wrapped JITFunction's."""

    def __init__(self, fn: JITFunction):
        self.fn = fn
        self._params = fn.params
        self._constexpr_at = frozenset(p.num for p in fn.params if p.is_constexpr)
        self._runtime_names = frozenset(p.name for p in fn.params if not p.is_constexpr)
        self._entries: dict[tuple, _Entry] = {}  # signature -> entry
        self._calls: dict[tuple, _Entry] = {}  # exact key -> entry
        self._layouts: dict[tuple, _Layout] = {}  # argument types -> their layout
        self._last = _Layout(None, None, None)  # the layout of the last call (no call yet)
        self._bound_launch = self._launch  # bound once, not on every `kernel[grid]`

    def __getattr__(self, name: str) -> Any:
        return getattr(self.fn, name)

    def __getitem__(self, grid):
        return _partial(self._bound_launch, grid)

    def _launch(self, grid, *args, **kwargs):
        if not _cuda_ready():  # no device (the AOT tool compiles CPU inputs): Triton's path
            return self.fn[grid](*args, **kwargs)
        device = _current_device()
        types = tuple(map(type, args))
        layout = self._last
        if types != layout.types:  # a tuple compare of identical types is cheaper than a hash
            layout = self._layouts.get(types) or self._layout(types)
            if layout.tensors is None:  # an argument type without an exact key
                return self.fn[grid](*args, **kwargs)
            self._last = layout
        tensors = layout.tensors(args)
        pointers = tuple(map(_data_ptr, tensors))
        values = layout.values(args)
        low_bits = _or(pointers) & 15 if pointers else 0
        try:
            key = (
                device,
                layout,
                tuple(map(_dtype_of, tensors)),
                tuple(map(_device_of, tensors)),
                # each address modulo 16 unless all are 16-byte aligned: finer than Triton
                tuple(map(_low_bits, pointers)) if low_bits else None,
                values,
                tuple(kwargs),
                tuple(kwargs.values()),
                tuple(map(type, kwargs.values())),  # True and 1 are equal as values
            )
            entry = self._calls.get(key)
        except TypeError:  # an unhashable keyword argument: nothing to key on
            return self.fn[grid](*args, **kwargs)
        hooks = knobs.runtime
        try:  # `_hooks_set()`, inlined
            hooked = hooks.launch_enter_hook.calls or hooks.launch_exit_hook.calls
        except AttributeError:
            hooked = True
        if entry is None or hooked or callable(grid):
            return self._slow(grid, args, kwargs, key, entry, layout.merge(pointers + values))
        # `entry.fire`, inlined: one Python call fewer per launch.
        size = len(grid)
        entry.launch(
            grid[0],
            grid[1] if size > 1 else 1,
            grid[2] if size > 2 else 1,
            _current_stream(device),
            *entry.head,
            *(layout.merge(pointers + values) if entry.direct else args),
            *entry.tail,
        )
        return entry.kernel

    def _layout(self, types: tuple) -> _Layout:
        tensors, values = [], []
        for position, kind in enumerate(types):
            if issubclass(kind, torch.Tensor):
                tensors.append(position)
            elif kind in _VALUE_TYPES:
                values.append(position)
            else:
                layout = _Layout(types, None, [])
                break
        else:
            layout = _Layout(types, tensors, values)
        self._layouts[types] = layout
        return layout

    def _signature(self, device: int, args: tuple, kwargs: dict) -> tuple:
        """The specialization key of a call: positional constexprs and keyword arguments by
        type and value, the other arguments by `_signature_of`."""
        constexpr = self._constexpr_at
        positional = tuple(
            (type(arg), arg) if i in constexpr else _signature_of(arg) for i, arg in enumerate(args)
        )
        keywords = tuple((name, type(value), value) for name, value in kwargs.items())
        return (device, positional, keywords)

    def _slow(self, grid, args, kwargs, key, entry, by_address):
        """A call whose exact key is new, or that Triton has to see (a callable grid, hooks).
        `by_address`: `args` with each tensor replaced by its address."""
        device = key[0]
        # A tensor off the current device (on the CPU, say) goes Triton's path, which checks
        # every address, and its key is not kept.
        on_device = all(tensor_device == device for tensor_device in key[3])
        if entry is None:
            signature = self._signature(device, args, kwargs)
            entry = self._entries.get(signature)
            if entry is None:
                kernel = self.fn[grid](*args, **kwargs)
                if isinstance(kernel, CompiledKernel) and self._runtime_names.isdisjoint(kwargs):
                    entry = _Entry(kernel, self._tail(len(args), kwargs))
                    self._entries[signature] = entry
                    if on_device:
                        self._remember(key, entry)
                return kernel
            if on_device:
                self._remember(key, entry)
                if not (_hooks_set() or callable(grid)):
                    return entry.fire(grid, _current_stream(device), args, by_address)
        return self.fn[grid](*args, **kwargs)

    def _remember(self, key: tuple, entry: _Entry) -> None:
        if len(self._calls) >= MAX_CALLS:
            self._calls.clear()
        self._calls[key] = entry

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
