"""Bound launches (`_launch.py`): the call signature is at least as fine as Triton's
specialization, the wrapper is transparent, and on a GPU a reused compiled kernel gives the
same results as Triton's own path for every specialization class."""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl
from triton.runtime.jit import JITFunction

from tokenspeed_kernel_triton._launch import BoundKernel, _signature_of, bind_launches


def _add(x_ptr, y_ptr, n, scale, BLOCK: tl.constexpr = 64):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    tl.store(y_ptr + offs, tl.load(x_ptr + offs, mask=mask) * scale + n, mask=mask)


def test_signature_separates_what_triton_specializes_on():
    base = torch.zeros(64)
    assert _signature_of(base) != _signature_of(base[1:])  # 16-byte aligned or not
    assert _signature_of(base) != _signature_of(base.to(torch.float16))
    ints = [_signature_of(v) for v in (1, 2, 16, 1 << 31, 1 << 63)]
    assert len(set(ints)) == len(ints)
    assert _signature_of(3) == _signature_of(5)  # one class: neither 1 nor a multiple of 16
    assert _signature_of(0.5) == _signature_of(2.0)
    assert _signature_of(None) != _signature_of(True)


def test_interpreted_functions_are_left_alone():
    interpreted = triton.jit(_add)  # TRITON_INTERPRET=1 in this directory's tests
    assert bind_launches(interpreted) is interpreted


def test_bound_kernel_forwards_the_jit_function_attributes():
    bound = bind_launches(JITFunction(_add))
    assert isinstance(bound, BoundKernel)
    assert bound.arg_names == ["x_ptr", "y_ptr", "n", "scale", "BLOCK"]
    # Defaults of trailing parameters fill the tail of a cached launch.
    assert bound._tail(4, {}) == (64,)
    assert bound._tail(3, {"scale": 2.0, "BLOCK": 32}) == (2.0, 32)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_reused_kernels_match_triton_for_every_specialization():
    bound = bind_launches(JITFunction(_add))
    plain = JITFunction(_add)
    buf = torch.arange(300, dtype=torch.float32, device="cuda")
    for offset in (0, 1, 4):  # aligned and misaligned pointers
        for n in (1, 16, 37, 256):  # == 1, multiple of 16, neither
            x = buf[offset : offset + n]
            want = torch.empty(n, device="cuda")
            plain[(triton.cdiv(n, 64),)](x, want, n, 0.5)
            for _ in range(2):  # the second launch reuses the bound kernel
                got = torch.full((n,), float("nan"), device="cuda")
                bound[(triton.cdiv(n, 64),)](x, got, n, 0.5)
                torch.testing.assert_close(got, want, rtol=0, atol=0)
    # Offsets 0 and 4 floats are both 16-byte aligned: 2 alignments x 3 int classes.
    assert len(bound._entries) == 2 * 3
