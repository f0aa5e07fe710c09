"""FlashInfer fused MoE adapters on the GPU: the shared MoE conformance cases (mxfp4 weights x
bf16 activations, with and without bias, logits and precomputed routing, ties, clamped SwiGLU,
odd sizes padded to 128) and GPT-OSS-120B's shapes (E 128, top-4, H = I = 2880) against the
core reference. Cases in other formats skip with the kernel's reason; trtllm_fp4 (sm_100)
skips on Hopper.

The CUTLASS module's first-use JIT took over 19 minutes on the H100 machine: run this file on
its own, with the FlashInfer JIT cache (~/.cache/flashinfer) kept between calls on a held
machine, e.g. a first call that only builds (`-x -k one-token`) and a second that tests."""

from __future__ import annotations

import pytest
from nvidia_gpu_helpers import kernel_params, require

from tokenspeed_kernel.testing import assert_conformance
from tokenspeed_kernel_nvidia._library import FLASHINFER

pytestmark = pytest.mark.gpu
KERNELS = ("flashinfer.moe_apply.cutlass", "flashinfer.moe_apply.trtllm_fp4")


@pytest.mark.parametrize(
    "kernel,case", [p for name in KERNELS for p in kernel_params("moe_apply", name)]
)
def test_conformance(kernel, case):
    require(FLASHINFER)
    assert_conformance(kernel, case)
