"""Replaying an MoE forward's launches: a warm `moe_apply` for a shape it has seen launches the
kernels the first call chose, with the arguments it computed, and does nothing else on the host.

On the GPU machine's host every torch op costs ~14 us and a launch through Triton's binder
~45 us; a forward computes the same configs, grids, scratch views, strides and constexprs for
every call of a (weights, M) pair. A `Recording` around one forward captures its launches (each
kernel a forward launches is wrapped in `recordable`); `Recording.recipe` turns them into a
`Recipe` that launches them again with the per-call tensors (x, the routing inputs, out) swapped
in. A compiled CUDA kernel is launched through its C launcher with every pointer as an int (no
`data_ptr` call and no driver pointer query per tensor), everything else (the interpreter, a
launch hook such as a profiler) takes the kernel's own `kernel[grid](...)` path with the same
arguments.

What makes a replay valid, and what the caller (layout.PaddedMoEKernel.apply) keys recipes by:
- a forward's device work is its recordable launches only (no torch op touches the device;
  tensors it allocates are scratch that every call rewrites before reading, so the recipe keeps
  and reuses the first call's);
- every argument a forward computes is a function of the prepared weights, the plan's config,
  the shapes, strides and dtypes of the per-call tensors, the stream and the device, and the
  16-byte alignment of the per-call pointers (what Triton specializes on), all in the key;
- the per-call tensors are passed as they are (a view derived from one of them would be frozen
  into the recipe: `recipe` refuses that);
- a scratch buffer a recipe launches on is still the workspace's (`workspace.generation`).
"""

from __future__ import annotations

import functools
import threading
import weakref
from typing import Any

import torch
from triton import knobs
from triton.runtime.jit import KernelInterface

from . import workspace

_local = threading.local()


def _recording() -> Recording | None:
    return getattr(_local, "recording", None)


class Recordable:
    """A kernel (a JITFunction, its `bind_launches` wrapper or the interpreter's function),
    launched as usual, `kernel[grid](*args, **kwargs)`; inside a `Recording` its launches are
    also captured. Every other attribute is the wrapped kernel's."""

    def __init__(self, kernel):
        self.kernel = kernel
        # The jit function under launch wrappers (a BoundKernel's `fn`): its parameter list.
        fn = kernel
        while not isinstance(fn, KernelInterface) and hasattr(fn, "fn"):
            fn = fn.fn
        self.jit_fn = fn

    def __getattr__(self, name: str) -> Any:
        return getattr(self.kernel, name)

    def __getitem__(self, grid):
        recording = _recording()
        if recording is None:
            return self.kernel[grid]
        return functools.partial(recording.launch, self, grid)


def recordable(kernel) -> Recordable:
    """Decorator, above `@bind_launches` (or the jit decorator)."""
    return Recordable(kernel)


class Recording:
    """Inside `with Recording(inputs):`, the launches of recordable kernels on this thread are
    captured (and run). inputs: the per-call tensors (None entries are absent inputs)."""

    def __init__(self, inputs: tuple):
        self.inputs = inputs
        self.launches: list[tuple] = []
        self._outer = None

    def __enter__(self) -> Recording:
        self._outer = _recording()
        _local.recording = self
        return self

    def __exit__(self, *exc) -> None:
        _local.recording = self._outer

    def launch(self, kernel: Recordable, grid, *args, **kwargs):
        result = kernel.kernel[grid](*args, **kwargs)
        self.launches.append((kernel, grid, args, kwargs, result))
        return result

    def recipe(self) -> Recipe | None:
        """The captured launches as a Recipe, or None where they cannot be replayed: one tensor
        passed in two roles, a grid given as a callable, a per-call tensor's view among the
        arguments, or a launch that neither compiled a kernel nor ran in the interpreter (the
        AOT tool's interception)."""
        from triton.compiler.compiler import CompiledKernel
        from triton.runtime.jit import JITFunction

        # Input index by id(): the inputs are alive, so no other argument shares their ids.
        inputs = {id(t): i for i, t in enumerate(self.inputs) if t is not None}
        present = [t for t in self.inputs if t is not None]
        if len(inputs) < len(present):
            return None  # one tensor in two roles: a replay could not tell them apart
        storages = {t.untyped_storage().data_ptr() for t in present}
        launches = []
        for kernel, grid, args, kwargs, result in self.launches:
            if callable(grid):
                return None
            for value in (*args, *kwargs.values()):
                if (
                    isinstance(value, torch.Tensor)
                    and id(value) not in inputs
                    and value.untyped_storage().data_ptr() in storages
                ):
                    return None
            if isinstance(result, CompiledKernel):
                launches.append(_Compiled(kernel, grid, args, kwargs, result, inputs))
            elif isinstance(kernel.jit_fn, JITFunction):
                return None
            else:
                launches.append(_Generic(kernel, grid, args, kwargs, inputs))
        return Recipe(launches)


def _slots(values, inputs: dict) -> tuple:
    """(position, input index) for each of `values` that is a per-call tensor (inputs: input
    index by id())."""
    return tuple((pos, inputs[id(v)]) for pos, v in enumerate(values) if id(v) in inputs)


class _Generic:
    """A launch through the kernel's own `kernel[grid](...)` path, per-call tensors swapped in."""

    def __init__(self, kernel: Recordable, grid, args, kwargs, inputs):
        self.kernel, self.grid = kernel, grid
        self.arg_slots = _slots(args, inputs)
        names = list(kwargs)
        self.kwarg_slots = tuple((names[p], i) for p, i in _slots(kwargs.values(), inputs))
        # The recorded call's own tensors are not kept (a prefill's x would stay alive).
        self.args, self.kwargs = list(args), dict(kwargs)
        for pos, _ in self.arg_slots:
            self.args[pos] = None
        for name, _ in self.kwarg_slots:
            self.kwargs[name] = None

    def launch(self, tensors: tuple) -> None:
        args, kwargs = self.args.copy(), self.kwargs.copy()
        for pos, index in self.arg_slots:
            args[pos] = tensors[index]
        for name, index in self.kwarg_slots:
            kwargs[name] = tensors[index]
        self.kernel.kernel[self.grid](*args, **kwargs)


class _Compiled(_Generic):
    """A compiled kernel launched straight through its C launcher: the arguments in parameter
    order (the launcher takes constexprs too, and skips them), pointers as ints. Where Triton's
    Python launcher would allocate global or profile scratch, it stays in between."""

    def __init__(self, kernel: Recordable, grid, args, kwargs, compiled, inputs):
        super().__init__(kernel, grid, args, kwargs, inputs)
        full = list(args)
        for param in kernel.jit_fn.params[len(args) :]:
            full.append(kwargs[param.name] if param.name in kwargs else param.default)
        slots = _slots(full, inputs)
        values = [v.data_ptr() if isinstance(v, torch.Tensor) else v for v in full]
        dims = (grid[0], grid[1] if len(grid) > 1 else 1, grid[2] if len(grid) > 2 else 1)
        stream = torch._C._cuda_getCurrentRawStream(torch.cuda.current_device())
        run = compiled.run
        direct = type(run).__name__ == "CudaLauncher" and not (
            run.global_scratch_size or run.profile_scratch_size
        )
        meta = (compiled.packed_metadata, None, None, None)  # no launch metadata, no hooks
        if direct:
            cooperative, pdl = run.launch_cooperative_grid, run.launch_pdl
            prefix = [*dims, stream, compiled.function, cooperative, pdl, None, None, *meta]
            self.call = run.launch
        else:
            prefix = [*dims, stream, compiled.function, *meta]
            self.call = run
        for pos, _ in slots:
            values[pos] = 0  # the recorded call's pointer: every launch writes its own
        self.values = prefix + values
        self.value_slots = tuple((len(prefix) + pos, index) for pos, index in slots)

    def launch_pointers(self, pointers: tuple) -> None:
        values = self.values.copy()
        for pos, index in self.value_slots:
            values[pos] = pointers[index]
        self.call(*values)


class Recipe:
    """A recorded forward's launches, replayed by `launch` with new per-call tensors (the same
    shapes, strides, dtypes and pointer alignment as the recorded ones). Holds every tensor the
    launches read (weights, scratch) through their recorded arguments."""

    def __init__(self, launches: list):
        self.launches = launches
        self.compiled = all(isinstance(launch, _Compiled) for launch in launches)

    def launch(self, tensors: tuple, pointers: tuple) -> None:
        """tensors: the per-call tensors in the recording's input order; pointers: their
        data_ptr()s (0 for an absent input)."""
        if self.compiled and not _launch_hooks():
            for launch in self.launches:
                launch.launch_pointers(pointers)
        else:
            for launch in self.launches:
                launch.launch(tensors)


def _launch_hooks() -> bool:
    """Whether a launch hook is set: Triton's chains hold one, or one was assigned in place of
    a chain (a function, or None), which Triton's own launch path handles."""
    runtime = knobs.runtime
    try:
        return bool(runtime.launch_enter_hook.calls or runtime.launch_exit_hook.calls)
    except AttributeError:
        return True


# Recipes by (id(prepared weights), stream, shapes, strides, dtypes): a forward's worth of small
# lists each. A serving engine sees a few dozen batch sizes per layer; the cap bounds an engine
# that sees thousands (the oldest recipe goes first). 0 turns replays off (A/B timing).
MAX_RECIPES = 4096
_recipes: dict[tuple, Recipe] = {}
_recipes_generation = -1
_watched: set[int] = set()


def key_of(prepared, tensors: tuple, pinned) -> tuple:
    """(key, pointers) of a call of `prepared` weights on tensors = (x, router_logits,
    topk_weights, topk_ids, out), shaped as moe_apply checks them (the routing inputs' shapes
    follow from x's and the config); key None where the call is not to be replayed: a pinned
    config (tuning), x on another device than the current one, or a per-call pointer that is
    not 16-byte aligned (Triton specializes on alignment)."""
    x, logits, weights, ids, out = tensors
    if pinned is not None:
        return None, None
    # Device and stream as ints (x.device.type alone costs ~1 us).
    if x.is_cuda:
        index = x.get_device()
        if index != torch._C._cuda_getDevice():
            return None, None
        stream = torch._C._cuda_getCurrentRawStream(index)
    else:
        index = stream = -1
    xp, op = x.data_ptr(), out.data_ptr()
    if logits is not None:
        lp = logits.data_ptr()
        pointers = (xp, lp, 0, 0, op)
        routing = (logits.dtype, logits.stride())
        aligned = (xp | lp | op) & 15 == 0
    else:
        wp, ip = weights.data_ptr(), ids.data_ptr()
        pointers = (xp, 0, wp, ip, op)
        routing = (weights.dtype, ids.dtype)
        aligned = (xp | wp | ip | op) & 15 == 0
    if not aligned:
        return None, None
    key = (id(prepared), index, stream, x.shape, x.stride(), x.dtype, out.stride(), out.dtype)
    return key + routing, pointers


def lookup(key) -> Recipe | None:
    """The recipe recorded for `key`, if its scratch buffers are still the workspace's (every
    recipe goes when the workspace allocates: they would hold its old buffers)."""
    global _recipes_generation
    if _recipes_generation != workspace.generation:
        _recipes.clear()
        _recipes_generation = workspace.generation
        return None
    return _recipes.get(key)


def store(key, prepared, recording: Recording) -> None:
    """Keep the recording's recipe under `key` (a key_of key) while `prepared` lives."""
    global _recipes_generation
    if MAX_RECIPES <= 0:
        return
    recipe = recording.recipe()
    if recipe is None:
        return
    if _recipes_generation != workspace.generation:
        _recipes.clear()
        _recipes_generation = workspace.generation
    handle = id(prepared)
    if handle not in _watched:
        weakref.finalize(prepared, _forget, handle)
        _watched.add(handle)
    while len(_recipes) >= MAX_RECIPES:
        del _recipes[next(iter(_recipes))]
    _recipes[key] = recipe


def _forget(handle: int) -> None:
    """`prepared` weights were collected: their recipes go (a new object may take the id)."""
    _watched.discard(handle)
    for key in [key for key in _recipes if key[0] == handle]:
        del _recipes[key]
