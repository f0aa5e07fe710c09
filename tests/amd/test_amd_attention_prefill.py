"""amd.mha_prefill: the shared Gluon body instantiated for NVIDIA (mma_v2)
against the core
reference on the shared conformance cases and GPT-OSS-120B shapes (GPU-marked), and the CPU
checks of its launcher that need no GPU."""

from __future__ import annotations

import pytest
from amd_attention_helpers import nvidia_instantiation

from tokenspeed_kernel.testing import assert_conformance, conformance_cases

OP = "mha_prefill"
CASES = conformance_cases(OP, preset="gpt-oss-120b")


@pytest.mark.gpu
@pytest.mark.parametrize("case", CASES, ids=str)
def test_nvidia_instantiation_conformance(case):
    with nvidia_instantiation(OP) as spec:
        assert_conformance(spec, case)


@pytest.mark.gpu
@pytest.mark.parametrize("case", [c for c in CASES if c.name.endswith("bf16") or c.preset], ids=str)
def test_nvidia_instantiation_register_staging(case):
    """K/V staged through registers into LDS: the gfx942 path (gfx950 and the default NVIDIA
    instantiation copy straight into shared memory)."""
    with nvidia_instantiation(OP, direct_to_lds=False) as spec:
        assert_conformance(spec, case)
