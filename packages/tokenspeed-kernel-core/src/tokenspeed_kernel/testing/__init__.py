"""Conformance testing for kernel packages: the shared per-op case lists, one tolerance table,
and a pytest entry point, so an out-of-tree package tests its kernels in two lines::

    from tokenspeed_kernel.testing import assert_conformance, conformance_params

    @pytest.mark.parametrize("kernel,case", conformance_params(op="mha_prefill", backend="mine"))
    def test_conformance(kernel, case): assert_conformance(kernel, case)
"""

from .cases import Case, conformance_cases, preset_cases
from .compare import TOLERANCES, Comparison, Tolerance, assert_close, compare, tolerance
from .conformance import (
    assert_conformance,
    case_support,
    conformance_params,
    moe_plan_for,
    reference_spec,
    run_case,
    select_kernels,
)
from .inputs import AttentionShape, MoEShape, StoreShape
from .registration import temporary_kernel

__all__ = [
    "TOLERANCES",
    "AttentionShape",
    "Case",
    "Comparison",
    "MoEShape",
    "StoreShape",
    "Tolerance",
    "assert_close",
    "assert_conformance",
    "case_support",
    "compare",
    "conformance_cases",
    "conformance_params",
    "moe_plan_for",
    "preset_cases",
    "reference_spec",
    "run_case",
    "select_kernels",
    "temporary_kernel",
    "tolerance",
]
