"""What every Triton attention kernel shares: the log2-domain constants, the dtypes, head dims
and traits they support, and their registration (platforms, support verdicts).

Scores live in the log2 domain (`qk_scale` = softmax_scale * log2(e)) so the exponentials are
`exp2`, one MUFU instruction each; the lse is converted back to the natural log at the end.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from tokenspeed_kernel.platform import arch_number, interpreting
from tokenspeed_kernel.registry import ANY, Support, register_kernel

# constexprs, so kernels read them too (`.value` on the host).
LOG2E = tl.constexpr(math.log2(math.e))
LN2 = tl.constexpr(math.log(2.0))

FP8 = torch.float8_e4m3fn
HALF = (torch.bfloat16, torch.float16)
HEAD_DIMS = (64, 128)
# What the prefill, extend and decode kernels all support.
ATTENTION_TRAITS = dict(
    dtype=HALF, head_dim=HEAD_DIMS, gqa_ratio=ANY, window=True, sinks=True, lse=True
)
# What the GPT-OSS calls the AOT cases model carry: head dim 64, a sink per head, the lse.
GPT_OSS_AOT_CASE = dict(head_dim=64, sinks=0.0, lse=True)


@triton.jit
def merge_sink(m, denom, sink):
    """Add the sink term 2^sink (log2 domain) to a row's running max `m` and denominator `denom`.

    Returns (m_fin, alpha, l_fin): alpha rescales the row's accumulator. The limits are part of
    the contract: sink = +inf takes all the mass (alpha 0, l_fin 1: out 0, lse +inf); sink =
    -inf adds nothing, and a row that also saw no key keeps l_fin = 0 (out 0, lse -inf).
    """
    m_fin = tl.maximum(m, sink)
    # Nothing seen and sink -inf: shift by 0 so the exponentials give 0, not NaN (-inf + inf).
    m_fin = tl.where(m_fin == float("-inf"), 0.0, m_fin)
    alpha = tl.math.exp2(m - m_fin)
    # sink == m_fin: the term is exactly 1, also for sink = +inf where sink - m_fin is NaN.
    l_fin = denom * alpha + tl.math.exp2(tl.where(sink == m_fin, 0.0, sink - m_fin))
    return m_fin, alpha, l_fin


def register_attention_kernel(launcher, name, traits, supports, description, aot_cases):
    """Registers `launcher` as kernel `name` ("triton.<op>") on NVIDIA sm_80+ and CDNA3/4, and
    on the CPU when Triton interprets (tests, debugging)."""
    platforms = ["nvidia:sm_80+", "amd:gfx942,gfx950"]
    if interpreting():
        platforms.append("cpu")
    register_kernel(
        name.split(".")[1],
        name=name,
        backend="triton",
        platforms=platforms,
        traits=traits,
        priority=100,
        supports=supports,
        description=description,
        aot_cases=aot_cases,
    )(launcher)


def interpreter_dot_verdict(request, platform) -> Support:
    if platform.vendor == "cpu" and request.dtype == torch.bfloat16:
        return Support.no("the Triton 3.6 interpreter multiplies raw bits in a bf16 tl.dot")
    return Support.yes()


def fp8_verdict(request, platform) -> Support:
    if request.kv_dtype == FP8 and platform.vendor == "nvidia":
        if (arch_number(platform.arch) or 0) < 89:
            return Support.no(f"FP8 e4m3 conversion needs sm_89+, this is {platform.arch}")
    return Support.yes()


def supports_dot_and_fp8(request, platform) -> Support:
    """The interpreter's bf16 dot and the FP8 conversion are what the dot kernels need."""
    verdict = interpreter_dot_verdict(request, platform)
    return fp8_verdict(request, platform) if verdict else verdict
