"""Shared pieces of the NVIDIA kernels' tests: the conformance parameters of one kernel
(default cases in the GPU dtypes, plus GPT-OSS-120B's real shapes), the guard that makes a
GPU run fail, instead of skipping every case, when the library it is meant to test is absent,
and a kernel module's spec registered from sources alone.

Set TOKENSPEED_NVIDIA_EXPECT="fa3,flashinfer" (the GPU commands in the package README do) to
require those libraries; unset, a missing library skips its tests.
"""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch

from tokenspeed_kernel.registry import get_kernel, kernels
from tokenspeed_kernel.testing import conformance_cases, conformance_params
from tokenspeed_kernel.testing.cases import attention_case

GPU_DTYPES = (torch.bfloat16, torch.float16)
PRESET = "gpt-oss-120b"


def registered_kernel(op: str, module):
    """The spec of `module`'s kernel for `op`. The package's entry point registers it; from
    sources alone (the GPU machine) the module registers it here."""
    if not any(spec.name == module.KERNEL_NAME for spec in kernels(op)):
        module.register()
    return get_kernel(op, module.KERNEL_NAME)


def require(library) -> None:
    """Skip (or fail, if TOKENSPEED_NVIDIA_EXPECT names it) unless `library` is usable."""
    verdict = library.verdict()
    if verdict.ok:
        return
    expected = {n.strip() for n in os.environ.get("TOKENSPEED_NVIDIA_EXPECT", "").split(",")}
    if library.extra in expected:
        pytest.fail(f"{library.extra} expected on this machine: {verdict.reason}", pytrace=False)
    pytest.skip(verdict.reason)


def kernel_params(op: str, kernel: str, *, dtypes=GPU_DTYPES, preset: bool = True, **replace):
    """(spec, case) params of one kernel: the default cases in `dtypes`, then the preset's.
    With `replace` (e.g. lse=False, q_lens=(1,) for a kernel without lse), every attention case
    is rebuilt with those shape fields replaced, so such a kernel still meets every shape."""
    if replace:
        return _replaced_params(op, kernel, dtypes, preset, replace)
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


def _replaced_params(op, kernel, dtypes, preset, replace):
    cases = conformance_cases(op, dtypes=dtypes)
    if preset:
        cases += [c for c in conformance_cases(op, preset=PRESET, dtypes=(torch.bfloat16,))
                  if c.preset == PRESET]  # fmt: skip
    spec = get_kernel(op, kernel)
    suffix = "-".join(f"{k}={v}" for k, v in replace.items())
    params = []
    for case in cases:
        shape = dataclasses.replace(case.shape, **replace)
        new = attention_case(f"{case.name}[{suffix}]", op, shape, case.preset)
        params.append(pytest.param(spec, new, id=f"{kernel}::{new.name}"))
    return params
