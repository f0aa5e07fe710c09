"""amd.mha_decode_with_kvcache: the shared Gluon body instantiated for NVIDIA (mma_v2) against
the core reference on the shared conformance cases and GPT-OSS-120B shapes (GPU-marked), forced
split counts pinned through `tuning.pin_config`, and the CPU checks of the split heuristic."""

from __future__ import annotations

import dataclasses

import pytest
from amd_attention_helpers import nvidia_instantiation

from tokenspeed_kernel.platform import KNOWN_PLATFORMS
from tokenspeed_kernel.testing import assert_conformance, conformance_cases
from tokenspeed_kernel.tuning import pin_config
from tokenspeed_kernel_amd.attention._common import ARCH_CODES, CODE_NVIDIA
from tokenspeed_kernel_amd.attention.decode import KERNEL_NAME, decode_config, num_splits

OP = "mha_decode_with_kvcache"
CASES = conformance_cases(OP, preset="gpt-oss-120b")


@pytest.mark.gpu
@pytest.mark.parametrize("case", CASES, ids=str)
def test_nvidia_instantiation_conformance(case):
    with nvidia_instantiation(OP) as spec:
        assert_conformance(spec, case)


SPLIT_CASES = [
    c
    for c in CASES
    if c.name.split("-", 1)[-1]
    in (
        "q1-long-page64-sinks-bf16",
        "q1-sink+30-page128-fp16",
        "q4-fp8-gqa8-window127-bf16",
        "q1-empty-seq-lse-bf16",
    )
    or c.name == "gpt-oss-120b-decode-full-b1"
]


@pytest.mark.gpu
@pytest.mark.parametrize("splits", (1, 3, 8))
@pytest.mark.parametrize("case", SPLIT_CASES, ids=str)
def test_forced_splits_count_the_sink_once(case, splits):
    """Whatever the split count, the reduce adds each sink exactly once (a sink counted per
    split would shrink the output by up to the split count)."""
    forced = dataclasses.replace(decode_config(CODE_NVIDIA, 64), num_splits=splits)
    with pin_config(KERNEL_NAME, forced), nvidia_instantiation(OP) as spec:
        assert_conformance(spec, case)


def test_split_count_follows_work_and_cu_count():
    for platform in (KNOWN_PLATFORMS["mi300x"], KNOWN_PLATFORMS["mi355x"]):
        cus = platform.sm_count
        cfg = decode_config(ARCH_CODES[platform.arch], 64)
        # One sequence x 8 KV-head groups, a long context: split until every CU has work.
        one = num_splits(cfg, 8, 1 << 20, cus)
        assert one == min(-(-cus * cfg.programs_per_cu // 8), cfg.max_splits)
        # Plenty of programs already: no split.
        assert num_splits(cfg, cus * cfg.programs_per_cu, 8192, cus) == 1
        # A short context cannot be split below min_blocks_per_split tiles per split.
        assert num_splits(cfg, 8, cfg.block_n * cfg.min_blocks_per_split, cus) == 1
        # Fewer CUs, fewer splits.
        assert num_splits(cfg, 8, 1 << 20, cus // 4) < num_splits(cfg, 8, 1 << 20, cus)


@pytest.mark.gpu
@pytest.mark.parametrize("case", [c for c in CASES if c.name.endswith("bf16") or c.preset], ids=str)
def test_nvidia_instantiation_register_staging(case):
    """K/V staged through registers into LDS: the gfx942 path (gfx950 and the default NVIDIA
    instantiation copy straight into shared memory)."""
    with nvidia_instantiation(OP, direct_to_lds=False) as spec:
        assert_conformance(spec, case)
