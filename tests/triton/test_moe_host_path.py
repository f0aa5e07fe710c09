"""The MoE host path (moe/replay.py): a warm moe_apply replays the launches its first call of
the same (weights, shapes, strides, dtypes, stream) recorded, with the new call's tensors, and
gives what the uncached forward gives, bit for bit. CPU through the Triton interpreter (the
replay takes the kernels' own launch path there); the compiled launch path, the side stream
and the zero-allocation warm call on the GPU."""

from __future__ import annotations

import gc
import importlib
import pkgutil

import pytest
import torch
import triton
import triton.language as tl

from tokenspeed_kernel import moe_apply
from tokenspeed_kernel.ops.moe.types import MoEWeights
from tokenspeed_kernel.registry import get_kernel
from tokenspeed_kernel.testing import assert_close, moe_plan_for
from tokenspeed_kernel.testing.inputs import MoEShape, generator, moe_inputs, moe_weights
from tokenspeed_kernel.tuning import pin_config
from tokenspeed_kernel_triton.moe import replay, workspace
from tokenspeed_kernel_triton.moe.moe import MoETileConfig
from tokenspeed_kernel_triton.moe.replay import Recording, recordable

KERNEL = "triton.moe_apply"
HOPPER = "triton.moe_apply.sm90"
CPU = "cpu"


def _layer(shape: MoEShape, kernel: str = KERNEL, device=CPU, max_num_tokens: int = 64):
    weights = moe_weights(shape, generator("moe-host-path", shape))
    weights = MoEWeights(
        **{
            name: value.to(device) if isinstance(value, torch.Tensor) else value
            for name, value in vars(weights).items()
        }
    )
    spec = get_kernel("moe_apply", kernel)
    plan = moe_plan_for(spec, shape.config(), max_num_tokens, device)
    return spec, plan, spec.fn.prepare_weights(plan, weights)


def _inputs(shape: MoEShape, seed, device=CPU) -> tuple[torch.Tensor, dict]:
    x, routing = moe_inputs(shape, generator("moe-host-path-inputs", shape, seed))
    return x.to(device), {k: v.to(device) for k, v in routing.items() if v is not None}


def _uncached(spec, plan, prepared, x, routing) -> torch.Tensor:
    """The forward itself, outside any recording (what every call ran before replays)."""
    config = plan.config
    out = torch.empty_like(x)
    spec.fn.forward(
        x,
        prepared.tensors,
        top_k=config.top_k,
        out=out,
        alpha=config.activation.alpha,
        limit=config.activation.limit,
        expert_offset=config.expert_offset,
        **routing,
        **spec.fn.forward_options(config, prepared.tensors),
    )
    return out


class _Forwards:
    """Counts the kernel's forward calls (each is an uncached call that records)."""

    def __init__(self, monkeypatch, kernel_cls):
        self.calls = 0
        forward = kernel_cls.forward

        def counted(*args, **kwargs):
            self.calls += 1
            return forward(*args, **kwargs)

        monkeypatch.setattr(kernel_cls, "forward", staticmethod(counted))


def _kernel_cls(spec):
    return type(spec.fn)


@pytest.mark.parametrize(
    "shape",
    [
        MoEShape(3, 8, 2, 64, 64),
        MoEShape(3, 8, 2, 64, 64, routing="precomputed"),
        # Expert parallel: the combine gets the ids (the same tensor the router reads).
        MoEShape(3, 16, 2, 64, 64, routing="precomputed", expert_offset=4, num_local_experts=8),
        MoEShape(2, 8, 2, 64, 64, activation_format="fp8"),
        MoEShape(2, 8, 2, 64, 64, weight_format="fp8", logits_dtype=torch.bfloat16),
    ],
)
def test_a_warm_call_replays_with_its_own_tensors(monkeypatch, shape):
    spec, plan, prepared = _layer(shape)
    forwards = _Forwards(monkeypatch, _kernel_cls(spec))
    outs = []
    for seed in range(3):
        x, routing = _inputs(shape, seed)
        out = torch.empty_like(x)
        moe_apply(plan, x, prepared, out=out, **routing)
        outs.append(out)
        assert torch.equal(out, _uncached(spec, plan, prepared, x, routing))
    assert forwards.calls == 3 + 1  # the first apply (recorded), then _uncached's three
    assert not torch.equal(outs[1], outs[2])  # new inputs were read, not the recorded ones


def test_the_replay_matches_the_reference():
    shape = MoEShape(5, 8, 2, 64, 96)
    spec, plan, prepared = _layer(shape)
    reference = get_kernel("moe_apply", "reference.moe_apply")
    ref_plan = moe_plan_for(reference, shape.config(), 64, CPU)
    weights = moe_weights(shape, generator("moe-host-path", shape))
    ref_prepared = reference.fn.prepare_weights(ref_plan, weights)
    for seed in range(2):  # recorded, then replayed
        x, routing = _inputs(shape, seed)
        out = moe_apply(plan, x, prepared, **routing)
        expected = torch.empty_like(x)
        reference.fn.apply(ref_plan, x, ref_prepared, out=expected, **routing)
        assert_close(out, expected, dtype=torch.bfloat16, name=f"out (call {seed})")


def test_each_shape_and_stride_records_its_own_recipe(monkeypatch):
    shape = MoEShape(4, 8, 2, 64, 64)
    spec, plan, prepared = _layer(shape)
    forwards = _Forwards(monkeypatch, _kernel_cls(spec))
    x, routing = _inputs(shape, 0)
    logits = routing["router_logits"]
    wide = torch.zeros(4, 96, dtype=x.dtype)  # x rows 96 apart: another stride
    wide[:, :64] = x
    calls = [
        (x, logits),
        (x[:2], logits[:2]),  # another M
        (wide[:, :64], logits),
        (x, logits.to(torch.bfloat16)),  # another logits dtype
    ]
    for x_in, logits_in in calls:
        out = moe_apply(plan, x_in, prepared, logits_in)
        expected = _uncached(spec, plan, prepared, x_in, dict(router_logits=logits_in))
        assert torch.equal(out, expected)
    assert forwards.calls == 2 * len(calls)
    for x_in, logits_in in calls:  # all warm now
        moe_apply(plan, x_in, prepared, logits_in)
    assert forwards.calls == 2 * len(calls)


def test_a_grown_workspace_drops_every_recipe(monkeypatch):
    shape = MoEShape(2, 8, 2, 64, 64)
    spec, plan, prepared = _layer(shape)
    forwards = _Forwards(monkeypatch, _kernel_cls(spec))
    x, routing = _inputs(shape, 0)
    moe_apply(plan, x, prepared, **routing)
    moe_apply(plan, x, prepared, **routing)
    assert forwards.calls == 1
    held = workspace._buffers[("act", torch.bfloat16, torch.device(CPU), 0)].numel()
    workspace.scratch("act", (held + 1,), torch.bfloat16, CPU)  # a larger call's rows
    # The recipe launched on the buffer the workspace just replaced: recorded again.
    out = moe_apply(plan, x, prepared, **routing)
    assert forwards.calls == 2
    assert torch.equal(out, _uncached(spec, plan, prepared, x, routing))


def test_a_pinned_config_is_never_replayed(monkeypatch):
    shape = MoEShape(3, 8, 2, 64, 64)
    spec, plan, prepared = _layer(shape)
    x, routing = _inputs(shape, 0)
    default = moe_apply(plan, x, prepared, **routing)
    forwards = _Forwards(monkeypatch, _kernel_cls(spec))
    with pin_config(KERNEL, MoETileConfig(32, 64, 32, 64, 4, 1)):
        pinned = moe_apply(plan, x, prepared, **routing)
    assert forwards.calls == 1
    assert torch.equal(default, pinned)


def test_recipes_go_with_their_weights():
    shape = MoEShape(2, 8, 2, 64, 64)
    spec, plan, prepared = _layer(shape)
    x, routing = _inputs(shape, 0)
    moe_apply(plan, x, prepared, **routing)
    handle = id(prepared)
    assert any(key[0] == handle for key in replay._recipes)
    del prepared
    gc.collect()
    assert not any(key[0] == handle for key in replay._recipes)


def test_the_recipe_cache_is_bounded(monkeypatch):
    monkeypatch.setattr(replay, "MAX_RECIPES", 2)
    monkeypatch.setattr(replay, "_recipes", {})
    shape = MoEShape(3, 8, 2, 64, 64)
    spec, plan, prepared = _layer(shape)
    x, routing = _inputs(shape, 0)
    for m in (1, 2, 3):
        moe_apply(plan, x[:m], prepared, routing["router_logits"][:m])
    assert len(replay._recipes) == 2
    assert [key[3][0] for key in replay._recipes] == [2, 3]  # the oldest went


def test_no_recipes_where_the_cap_is_zero(monkeypatch):
    monkeypatch.setattr(replay, "MAX_RECIPES", 0)
    shape = MoEShape(2, 8, 2, 64, 64)
    spec, plan, prepared = _layer(shape)
    forwards = _Forwards(monkeypatch, _kernel_cls(spec))
    x, routing = _inputs(shape, 0)
    for _ in range(2):
        moe_apply(plan, x, prepared, **routing)
    assert forwards.calls == 2


def _bad_tensors(m: int, h: int, e: int):
    """(argument, bad value) pairs, one per check moe_apply makes on x, out and router_logits:
    type, shape, dtype, device, last-dim stride."""
    meta = torch.device("meta")
    return [
        ("x", [[0.0] * h] * m),
        ("x", torch.zeros(m, h + 1, dtype=torch.bfloat16)),
        ("x", torch.zeros(m, h, dtype=torch.float16)),
        ("x", torch.zeros(m, h, dtype=torch.bfloat16, device=meta)),
        ("x", torch.zeros(h, m, dtype=torch.bfloat16).t()),
        ("out", "out"),
        ("out", torch.zeros(m + 1, h, dtype=torch.bfloat16)),
        ("out", torch.zeros(m, h)),
        ("out", torch.zeros(m, h, dtype=torch.bfloat16, device=meta)),
        ("out", torch.zeros(h, m, dtype=torch.bfloat16).t()),
        ("router_logits", 1.0),
        ("router_logits", torch.zeros(m, e + 1)),
        ("router_logits", torch.zeros(m, e, dtype=torch.float16)),
        ("router_logits", torch.zeros(m, e, device=meta)),
        ("router_logits", torch.zeros(e, m).t()),
    ]


def test_the_argument_checks_raise_what_check_tensor_raises():
    """moe_apply checks x, out and router_logits inline: each bad value gets the error
    check_tensor and check_contiguous_last_dim give it, word for word."""
    from tokenspeed_kernel.validation import check_contiguous_last_dim, check_tensor

    shape = MoEShape(3, 8, 2, 64, 64)
    spec, plan, prepared = _layer(shape)
    x, routing = _inputs(shape, 0)
    good = dict(x=x, router_logits=routing["router_logits"], out=torch.empty_like(x))
    rules = dict(
        x=((None, 64), (torch.bfloat16,)),
        out=(x.shape, (torch.bfloat16,)),
        router_logits=((3, 8), (torch.float32, torch.bfloat16)),
    )
    for name, bad in _bad_tensors(3, 64, 8):
        expected_shape, dtypes = rules[name]
        with pytest.raises((TypeError, ValueError)) as expected:
            check_tensor(
                "moe_apply",
                name,
                bad,
                shape=expected_shape,
                dtypes=dtypes,
                device=x.device,
                device_of="the plan's device",
            )
            check_contiguous_last_dim("moe_apply", name, bad)
        args = dict(good, **{name: bad})
        with pytest.raises(expected.type) as raised:
            moe_apply(plan, args["x"], prepared, args["router_logits"], out=args["out"])
        assert str(raised.value) == str(expected.value), name


# ----------------------------------------------------------------------------- the key


class _Fake:
    """What key_of reads of a tensor."""

    def __init__(self, shape, ptr=1 << 20, dtype=torch.bfloat16, stride0=None, device="cuda:0"):
        self.shape, self.dtype, self._ptr = torch.Size(shape), dtype, ptr
        self._strides = (shape[1] if stride0 is None else stride0, 1)
        self._device = torch.device(device)
        self.is_cuda = self._device.type == "cuda"

    def data_ptr(self):
        return self._ptr

    def stride(self):
        return self._strides

    def get_device(self):
        return self._device.index if self.is_cuda else -1


def _call(
    m=1, x_ptr=1 << 20, logits_dtype=torch.float32, x_stride=None, out_stride=None, **options
):
    device = options.get("device", "cuda:0")
    x = _Fake((m, 64), x_ptr, stride0=x_stride, device=device)
    out = _Fake((m, 64), 1 << 28, stride0=out_stride, device=device)
    if options.get("precomputed"):
        weights = _Fake((m, 2), 1 << 24, torch.float32, device=device)
        return (x, None, weights, _Fake((m, 2), 1 << 26, torch.int32, device=device), out)
    return (x, _Fake((m, 8), 1 << 24, logits_dtype, device=device), None, None, out)


def test_the_key_tells_apart_what_the_forward_depends_on(monkeypatch):
    streams = {0: 111}
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda index: streams[index])
    current = [0]
    monkeypatch.setattr(torch._C, "_cuda_getDevice", lambda: current[0])
    weights, other_weights = object(), object()
    base, pointers = replay.key_of(weights, _call(), None)
    assert pointers == (1 << 20, 1 << 24, 0, 0, 1 << 28)
    assert replay.key_of(weights, _call(x_ptr=(1 << 20) + 4096), None)[0] == base
    different = [
        replay.key_of(other_weights, _call(), None)[0],
        replay.key_of(weights, _call(m=2), None)[0],
        replay.key_of(weights, _call(logits_dtype=torch.bfloat16), None)[0],
        replay.key_of(weights, _call(x_stride=128), None)[0],
        replay.key_of(weights, _call(out_stride=128), None)[0],
        replay.key_of(weights, _call(precomputed=True), None)[0],
        replay.key_of(weights, _call(device="cpu"), None)[0],
    ]
    streams[0] = 222  # a side stream, a graph capture's stream
    different.append(replay.key_of(weights, _call(), None)[0])
    streams[1], current[0] = 333, 1
    different.append(replay.key_of(weights, _call(device="cuda:1"), None)[0])
    assert base not in different and len(set(different)) == len(different)
    # Not replayed: x on a device other than the current one, an unaligned pointer, a pin.
    assert replay.key_of(weights, _call(), None) == (None, None)
    current[0] = 0
    streams[0] = 111
    assert replay.key_of(weights, _call(x_ptr=(1 << 20) + 2), None) == (None, None)
    assert replay.key_of(weights, _call(), MoETileConfig(16, 64, 64, 128, 4, 1))[0] is None


# ----------------------------------------------------------------------------- recordings


@recordable
@triton.jit
def _scale_kernel(x_ptr, y_ptr, n, factor, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    tl.store(y_ptr + offs, tl.load(x_ptr + offs, mask=offs < n) * factor, mask=offs < n)


def _scale(x, y, factor=2.0):
    _scale_kernel[(1,)](x, y, x.numel(), factor, BLOCK=16)


def test_a_recipe_swaps_in_the_new_tensors():
    x, y = torch.arange(8.0), torch.empty(8)
    with Recording((x, y)) as recording:
        _scale(x, y)
    recipe = recording.recipe()
    x2, y2 = torch.arange(8.0) + 100, torch.zeros(8)
    recipe.launch((x2, y2), (x2.data_ptr(), y2.data_ptr()))
    assert torch.equal(y2, 2 * x2) and torch.equal(y, 2 * x)


def test_a_recording_refuses_what_it_could_not_replay():
    x, y = torch.arange(16.0), torch.empty(16)
    with Recording((x, y)) as recording:
        _scale(x[8:], y)  # a view of x: a replay would read the recorded x
    assert recording.recipe() is None
    with Recording((x, x)) as recording:  # one tensor in two roles
        _scale(x, x)
    assert recording.recipe() is None
    with Recording((x, y)) as recording:
        _scale_kernel[lambda meta: (1,)](x, y, 8, 2.0, BLOCK=16)
    assert recording.recipe() is None


def _launched_kernel(x_ptr, y_ptr, n, factor, BLOCK: tl.constexpr, EVEN: tl.constexpr = True):
    pass


class CudaLauncher:
    """Stands in for Triton's (replay checks the launcher by its class name)."""

    global_scratch_size = profile_scratch_size = 0
    launch_cooperative_grid, launch_pdl = False, True

    def __init__(self):
        self.calls = []

    def launch(self, *args):
        self.calls.append(args)


class _Compiled:
    function, packed_metadata = 0xF00, (4, 1, 0)

    def __init__(self):
        self.run = CudaLauncher()


def test_a_compiled_launch_passes_every_parameter_in_order(monkeypatch):
    """The C launcher's argument list, as Triton's Python launcher builds it: grid, stream,
    function, cooperative, PDL, no scratch, metadata, no hooks, then every parameter in
    order (keywords and defaults included), tensors as their pointers, the per-call ones
    swapped in."""
    from triton.runtime.jit import JITFunction

    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda index: 0x5EA)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    kernel = replay.Recordable(JITFunction(_launched_kernel))
    x, y, weights = torch.zeros(4), torch.zeros(4), torch.zeros(8)
    compiled = _Compiled()
    inputs = {id(x): 0, id(y): 4}  # input index by id(), as Recording.recipe passes them
    launch = replay._Compiled(
        kernel, (3, 2), (x, weights, 4), dict(factor=0.5, BLOCK=16), compiled, inputs
    )
    x2, y2 = torch.zeros(4), torch.zeros(4)
    launch.launch_pointers((x2.data_ptr(), 0, 0, 0, y2.data_ptr()))
    (args,) = compiled.run.calls
    head = (3, 2, 1, 0x5EA, 0xF00, False, True, None, None, (4, 1, 0), None, None, None)
    assert args[: len(head)] == head
    assert args[len(head) :] == (x2.data_ptr(), weights.data_ptr(), 4, 0.5, 16, True)


def test_a_launch_hook_in_any_form_takes_the_kernels_own_path(monkeypatch):
    from triton import knobs
    from triton.knobs import HookChain

    monkeypatch.setattr(knobs.runtime, "launch_enter_hook", HookChain())
    monkeypatch.setattr(knobs.runtime, "launch_exit_hook", HookChain())
    assert not replay._launch_hooks()
    knobs.runtime.launch_exit_hook.add(print)
    assert replay._launch_hooks()
    for assigned in (print, None):  # in place of the chain
        monkeypatch.setattr(knobs.runtime, "launch_enter_hook", assigned)
        assert replay._launch_hooks()


def test_every_kernel_a_forward_launches_is_recorded(monkeypatch):
    """A launch the recording missed would be skipped by every replay: the interpreter's
    launches against the recorded ones, with the decode router, the multi-kernel router and
    FP8 activations (dynamic scales: a quantization launch per GEMM)."""
    from triton.runtime.interpreter import InterpretedFunction

    launched = []
    run = InterpretedFunction.run

    def counted(self, *args, **kwargs):
        launched.append(self)
        return run(self, *args, **kwargs)

    monkeypatch.setattr(InterpretedFunction, "run", counted)
    for shape in (
        MoEShape(3, 8, 2, 64, 64, activation_format="fp8"),
        MoEShape(140, 8, 2, 64, 64),  # 280 pairs: top-k, align and scatter kernels
    ):
        spec, plan, prepared = _layer(shape, max_num_tokens=256)
        x, routing = _inputs(shape, 0)
        launched.clear()
        with Recording((x, None, None, None, None)) as recording:
            _uncached(spec, plan, prepared, x, routing)
        assert len(launched) >= 4
        assert [launch[0].kernel for launch in recording.launches] == launched


def test_the_moe_modules_launch_recordable_kernels_only():
    """By name: the MoE modules' launched jit functions are `*_kernel`, their jit helpers are
    not (the Hopper GEMM, which the interpreter cannot run, is checked here only)."""
    from triton.runtime.jit import KernelInterface

    import tokenspeed_kernel_triton.moe as package
    from tokenspeed_kernel_triton._launch import BoundKernel

    kernels = {}
    for info in pkgutil.iter_modules(package.__path__):
        name = f"{package.__name__}.{info.name}"
        module = importlib.import_module(name)
        kernels.update(
            (f"{name}.{attr}", value)
            for attr, value in vars(module).items()
            if isinstance(value, (KernelInterface, BoundKernel, replay.Recordable))
            and attr.endswith("_kernel")
        )
    assert "tokenspeed_kernel_triton.moe.wgmma_gemm_sm90._fragment_gemm_kernel" in kernels
    unwrapped = [
        name for name, value in kernels.items() if not isinstance(value, replay.Recordable)
    ]
    assert not unwrapped


# ----------------------------------------------------------------------------- GPU

GPT_OSS_120B = MoEShape(1, 128, 4, 2880, 2880)


def _gpt_oss_layer(kernel: str):
    """GPT-OSS-120B MXFP4 experts from random bytes on the GPU (as test_moe.py's), or a skip
    where this GPU does not run `kernel`."""
    from tokenspeed_kernel.platform import platform_of

    spec = get_kernel("moe_apply", kernel)
    if all(p.mismatch(platform_of(torch.device("cuda"))) for p in spec.platforms):
        pytest.skip(f"{kernel} does not run on this GPU")
    E, H, I = 128, 2880, 2880  # noqa: E741
    g = torch.Generator(device="cuda").manual_seed(0)

    def mx(rows, cols):
        def draw(low, high, last):
            shape = (E, rows, last)
            return torch.randint(low, high, shape, generator=g, device="cuda", dtype=torch.uint8)

        return draw(0, 256, cols // 2), draw(119, 122, cols // 32)

    (w13, s13), (w2, s2) = mx(2 * I, H), mx(H, I)
    weights = MoEWeights(
        w13=w13,
        w2=w2,
        w13_scale=s13,
        w2_scale=s2,
        w13_bias=0.5 * torch.randn(E, 2 * I, generator=g, device="cuda"),
        w2_bias=0.5 * torch.randn(E, H, generator=g, device="cuda"),
    )
    plan = moe_plan_for(spec, GPT_OSS_120B.config(), 4096, "cuda")
    return spec, plan, spec.fn.prepare_weights(plan, weights), g


def _gpu_inputs(m: int, g, precomputed=False):
    x = torch.randn(m, 2880, generator=g, device="cuda").to(torch.bfloat16)
    logits = torch.randn(m, 128, generator=g, device="cuda")
    if not precomputed:
        return x, dict(router_logits=logits)
    weights, ids = torch.topk(torch.softmax(logits, -1), 4)
    return x, dict(topk_weights=weights.contiguous(), topk_ids=ids.to(torch.int32))


@pytest.mark.gpu
@pytest.mark.parametrize("kernel", [HOPPER, KERNEL])
@pytest.mark.parametrize("precomputed", [False, True])
def test_gpu_replays_are_bit_identical(monkeypatch, kernel, precomputed):
    """M = 1, 4, 64 (decode tiles with and without tile counters, the mid tiles): every warm
    call, through the C launchers, equals the uncached forward on the same inputs."""
    spec, plan, prepared, g = _gpt_oss_layer(kernel)
    forwards = _Forwards(monkeypatch, _kernel_cls(spec))
    for m in (1, 4, 64):
        for call in range(3):
            x, routing = _gpu_inputs(m, g, precomputed)
            out = torch.empty_like(x)
            before = forwards.calls
            moe_apply(plan, x, prepared, out=out, **routing)
            assert forwards.calls - before == (call == 0)  # recorded once, then replayed
            expected = _uncached(spec, plan, prepared, x, routing)
            assert torch.equal(out, expected), f"M={m}, call {call}"
        recipes = [r for k, r in replay._recipes.items() if k[0] == id(prepared)]
        assert recipes and all(r.compiled for r in recipes)


@pytest.mark.gpu
@pytest.mark.parametrize("kernel", [HOPPER, KERNEL])
def test_gpu_warm_call_allocates_nothing(kernel):
    spec, plan, prepared, g = _gpt_oss_layer(kernel)
    x, routing = _gpu_inputs(1, g)
    out = torch.empty_like(x)
    for _ in range(2):
        moe_apply(plan, x, prepared, out=out, **routing)
    torch.cuda.synchronize()
    before = torch.cuda.memory_stats()["allocation.all.allocated"]
    moe_apply(plan, x, prepared, out=out, **routing)
    assert torch.cuda.memory_stats()["allocation.all.allocated"] == before


@pytest.mark.gpu
def test_gpu_streams_and_graphs_get_recipes_of_their_own(monkeypatch):
    """A side stream records its own recipe (its own scratch); a CUDA graph captured on one
    replays with new inputs copied in, and the default stream's eager calls stay right."""
    spec, plan, prepared, g = _gpt_oss_layer(HOPPER)
    forwards = _Forwards(monkeypatch, _kernel_cls(spec))
    x, routing = _gpu_inputs(1, g)
    out = torch.empty_like(x)
    moe_apply(plan, x, prepared, out=out, **routing)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        moe_apply(plan, x, prepared, out=out, **routing)
        moe_apply(plan, x, prepared, out=out, **routing)
    torch.cuda.current_stream().wait_stream(side)
    assert forwards.calls == 2
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        moe_apply(plan, x, prepared, out=out, **routing)
    for _ in range(2):
        new_x, new_routing = _gpu_inputs(1, g)
        x.copy_(new_x)
        routing["router_logits"].copy_(new_routing["router_logits"])
        graph.replay()
        eager = moe_apply(plan, new_x, prepared, **new_routing)
        torch.cuda.synchronize()
        expected = _uncached(spec, plan, prepared, new_x, new_routing)
        assert torch.equal(out, expected) and torch.equal(eager, expected)


@pytest.mark.gpu
def test_gpu_a_launch_hook_sees_every_replayed_launch():
    """With a launch hook (a profiler), replays take Triton's launch path, which calls it."""
    from triton import knobs

    spec, plan, prepared, g = _gpt_oss_layer(HOPPER)
    x, routing = _gpu_inputs(1, g)
    moe_apply(plan, x, prepared, **routing)  # recorded
    seen = []
    hook = seen.append
    knobs.runtime.launch_enter_hook.add(hook)
    try:
        out = moe_apply(plan, x, prepared, **routing)
    finally:
        knobs.runtime.launch_enter_hook.remove(hook)
    recipe = next(r for k, r in replay._recipes.items() if k[0] == id(prepared))
    assert len(seen) == len(recipe.launches)
    assert torch.equal(out, _uncached(spec, plan, prepared, x, routing))
