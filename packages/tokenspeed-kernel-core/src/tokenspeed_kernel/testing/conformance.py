"""Run a registered kernel on a conformance case and compare it with the core reference.

Two lines test an out-of-tree backend with the shared cases::

    @pytest.mark.parametrize("kernel,case", conformance_params(op="mha_decode_with_kvcache",
                                                                backend="mybackend"))
    def test_conformance(kernel, case): assert_conformance(kernel, case)

The kernel runs on fresh inputs and the reference ("reference.<op>") on clones of them; the
kernel's outputs (out and lse; the caches for kvcache_store) are compared under the dtype's
tolerance, and its inputs must come back untouched. A kernel that declines the case (the
selector's own `spec.supports(request, platform)`) is skipped with its reason. Inside
`fake_platform(...)` a GPU kernel is checked on CPU tensors (the Triton interpreter).
"""

from __future__ import annotations

import dataclasses
import fnmatch
from collections.abc import Iterable
from typing import Any

import torch

from ..formats.fp8 import FP8_DTYPE
from ..ops.moe.types import MoEPlan, PreparedMoEWeights
from ..platform import default_device, platform_of
from ..registry import KernelSpec, Support, kernels, op_names
from .cases import Case, conformance_cases
from .compare import Comparison, compare


def reference_spec(op: str) -> KernelSpec:
    """The registered core reference kernel of `op` (the numerics oracle)."""
    name = f"reference.{op}"
    for spec in kernels(op):
        if spec.name == name:
            return spec
    raise LookupError(f"{op}: the core reference kernel {name!r} is not registered")


def resolve_device(device: torch.device | str | None) -> torch.device:
    device = default_device() if device is None else torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def case_support(spec: KernelSpec, case: Case, device: torch.device | str | None = None) -> Support:
    """The selector's verdict for this kernel on the case's request, on `device`'s platform."""
    if spec.op != case.op:
        return Support.no(f"kernel is for {spec.op}, case is for {case.op}")
    return spec.supports(case.request, platform_of(resolve_device(device)))


def moe_plan_for(spec: KernelSpec, config, max_num_tokens: int, device) -> MoEPlan:
    """The plan `moe_plan` would build if the selector had picked `spec`."""
    padded_h, padded_i = spec.fn.padded_sizes(config)
    return MoEPlan(
        config,
        spec.name,
        "conformance",
        spec.fn.weight_layout,
        padded_h,
        padded_i,
        max_num_tokens,
        resolve_device(device),
        spec.fn,
    )


def _clone(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.clone()
    if isinstance(value, dict):
        return {k: _clone(v) for k, v in value.items()}
    if isinstance(value, tuple):
        return tuple(_clone(v) for v in value)
    return value


def _bits(x: torch.Tensor) -> torch.Tensor:
    # torch.equal is not defined for every dtype on every device (fp8); compare raw bytes.
    return x.detach().contiguous().view(torch.uint8) if x.dtype.itemsize == 1 else x.detach()


def _outputs(case: Case, args, kwargs) -> list[tuple[str, torch.Tensor, torch.dtype]]:
    if case.op == "kvcache_store":
        # A bf16/fp16 store is a copy: compare under the strict float32 tolerance.
        dtype = FP8_DTYPE if case.shape.cache_dtype == FP8_DTYPE else torch.float32
        return [("k_cache", args[2], dtype), ("v_cache", args[3], dtype)]
    outputs = [("out", kwargs["out"], case.shape.out_dtype)]
    if kwargs.get("lse") is not None:
        outputs.append(("lse", kwargs["lse"], torch.float32))
    return outputs


def _inputs(case: Case, args, kwargs) -> list[tuple[str, torch.Tensor]]:
    names = {
        "mha_prefill": ("q", "k", "v"),
        "mha_extend_with_kvcache": ("q", "k_cache", "v_cache"),
        "mha_decode_with_kvcache": ("q", "k_cache", "v_cache"),
        "kvcache_store": ("k", "v"),
    }[case.op]
    named = list(zip(names, args, strict=False))
    named += [
        (k, v) for k, v in kwargs.items() if isinstance(v, torch.Tensor) and k not in ("out", "lse")
    ]
    return named


def _merge(results: list[Comparison]) -> Comparison:
    """The first failure, else the primary output's comparison naming everything checked."""
    for result in results:
        if not result.ok:
            return result
    names = ", ".join(r.name for r in results)
    return dataclasses.replace(results[0], name=names)


def run_case(
    spec: KernelSpec, case: Case, device: torch.device | str | None = None, *, seed: int = 0
) -> Comparison:
    """Run `spec` and the reference on the same fresh inputs of `case`; compare the outputs.

    Does not consult `spec.supports` (see `assert_conformance`); exceptions propagate.
    """
    if spec.op != case.op:
        raise ValueError(
            f"run_case: kernel {spec.name} is for {spec.op}, case {case.name} is for {case.op}"
        )
    device = resolve_device(device)
    reference = reference_spec(case.op)
    if case.op == "moe_apply":
        return _run_moe(spec, reference, case, device, seed)
    args, kwargs = case.build(device, seed)
    ref_args, ref_kwargs = _clone(args), _clone(kwargs)
    reference.fn(*ref_args, **ref_kwargs)
    spec.fn(*args, **kwargs)
    results = [
        compare(got, want, dtype=dtype, name=name)
        for (name, got, dtype), (_, want, _) in zip(
            _outputs(case, args, kwargs), _outputs(case, ref_args, ref_kwargs), strict=True
        )
    ]
    for (name, got), (_, want) in zip(
        _inputs(case, args, kwargs), _inputs(case, ref_args, ref_kwargs), strict=True
    ):
        if not torch.equal(_bits(got), _bits(want)):
            results.append(
                Comparison(
                    name, False, 0.0, 0.0, 0.0, None, message="input was modified by the kernel"
                )
            )
    return _merge(results)


def _apply_moe(spec: KernelSpec, case: Case, device, config, weights, x, routing):
    plan = moe_plan_for(spec, config, case.request.max_num_tokens, device)
    prepared = spec.fn.prepare_weights(plan, weights)
    if not isinstance(prepared, PreparedMoEWeights) or prepared.kernel != spec.name:
        raise RuntimeError(
            f"{spec.name}.prepare_weights returned weights for "
            f"{getattr(prepared, 'kernel', type(prepared).__name__)}"
        )
    out = torch.full_like(x, float("nan"))
    spec.fn.apply(plan, x, prepared, out=out, **routing)
    return out


def _run_moe(spec, reference, case, device, seed) -> Comparison:
    (config, weights, x), routing = case.build(device, seed)
    expected = _apply_moe(reference, case, device, config, weights, x.clone(), _clone(routing))
    x_before = x.clone()
    actual = _apply_moe(spec, case, device, config, weights, x, routing)
    dtype = FP8_DTYPE if config.activation_format == "fp8" else torch.bfloat16
    results = [compare(actual, expected, dtype=dtype, name="out")]
    if not torch.equal(x, x_before):
        results.append(
            Comparison("x", False, 0.0, 0.0, 0.0, None, message="input was modified by the kernel")
        )
    return _merge(results)


def assert_conformance(
    spec: KernelSpec, case: Case, device: torch.device | str | None = None, *, seed: int = 0
) -> Comparison:
    """pytest: skip if the kernel declines the case, else fail with a readable message."""
    import pytest  # noqa: PLC0415  (testing helpers must import without pytest installed)

    verdict = case_support(spec, case, device)
    if not verdict.ok:
        pytest.skip(f"{spec.name} declines {case.name}: {verdict.reason}")
    result = run_case(spec, case, device, seed=seed)
    if not result.ok:
        pytest.fail(f"{spec.name} on {case.name}: {result}", pytrace=False)
    return result


def select_kernels(
    op: str | None = None, *, backend: str | None = None, kernel: str | None = None
) -> list[KernelSpec]:
    """Registered kernels of `op` (every op if None), filtered by backend and a name glob."""
    ops = op_names() if op is None else (op,)
    if op is not None and op not in op_names():
        raise ValueError(f"unknown op {op!r}, expected one of {', '.join(op_names())}")
    return [
        spec
        for name in ops
        for spec in kernels(name)
        if (backend is None or spec.backend == backend)
        and (kernel is None or fnmatch.fnmatchcase(spec.name, kernel))
    ]


def conformance_params(
    op: str | None = None,
    *,
    backend: str | None = None,
    kernel: str | None = None,
    preset: str | None = None,
    dtypes: Iterable[torch.dtype] | None = None,
) -> list[Any]:
    """`pytest.param(spec, case, id="kernel::case")` for every matching kernel and case."""
    import pytest  # noqa: PLC0415

    dtypes = None if dtypes is None else tuple(dtypes)
    params = []
    for spec in select_kernels(op, backend=backend, kernel=kernel):
        for case in conformance_cases(spec.op, preset=preset, dtypes=dtypes):
            params.append(pytest.param(spec, case, id=f"{spec.name}::{case.name}"))
    return params
