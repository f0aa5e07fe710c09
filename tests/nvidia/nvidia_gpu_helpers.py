"""Shared pieces of the NVIDIA adapters' GPU tests: the conformance parameters of one kernel
(default cases in the GPU dtypes, plus GPT-OSS-120B's real shapes) and the guard that makes a
GPU run fail, instead of skipping every case, when the library it is meant to test is absent.

Set TOKENSPEED_NVIDIA_EXPECT="fa3,flashinfer" (the GPU commands in the package README do) to
require those libraries; unset, a missing library skips its tests.
"""

from __future__ import annotations

import os

import pytest
import torch

from tokenspeed_kernel.testing import conformance_params

GPU_DTYPES = (torch.bfloat16, torch.float16)
PRESET = "gpt-oss-120b"


def require(library) -> None:
    """Skip (or fail, if TOKENSPEED_NVIDIA_EXPECT names it) unless `library` is usable."""
    verdict = library.verdict()
    if verdict.ok:
        return
    expected = {n.strip() for n in os.environ.get("TOKENSPEED_NVIDIA_EXPECT", "").split(",")}
    if library.extra in expected:
        pytest.fail(f"{library.extra} expected on this machine: {verdict.reason}", pytrace=False)
    pytest.skip(verdict.reason)


def kernel_params(op: str, kernel: str, *, dtypes=GPU_DTYPES, preset: bool = True):
    """(spec, case) params of one kernel: the default cases in `dtypes`, then the preset's."""
    params = conformance_params(op=op, kernel=kernel, dtypes=dtypes)
    if preset:
        params += [
            p
            for p in conformance_params(
                op=op, kernel=kernel, preset=PRESET, dtypes=(torch.bfloat16,)
            )
            if p.values[1].preset == PRESET
        ]
    return params
