"""Registers the Gluon attention kernels with core (imports core; the kernels do not).

Platforms are gfx942 and gfx950 only: the same sources instantiated for NVIDIA (`arch=
"nvidia"`) exist to test the shared body's numerics, never to serve requests. Priority 200 puts
them above the portable Triton kernels (100) on CDNA, for which they are written.
"""

from __future__ import annotations

from typing import Any

PRIORITY = 200
PLATFORMS = ("amd:gfx942,gfx950",)


def attention_kernels() -> list[dict[str, Any]]:
    """op, name, fn, traits, supports and description of each attention kernel; shared by
    the registration and by tests that register NVIDIA instantiations with the same traits."""

    from tokenspeed_kernel.registry import ANY

    from . import decode, extend, prefill
    from ._common import FP8_DTYPE, HALF_DTYPES, HEAD_DIMS

    common = dict(
        dtype=HALF_DTYPES, head_dim=HEAD_DIMS, gqa_ratio=ANY, window=True, sinks=True, lse=True
    )
    fp8_kv = (*HALF_DTYPES, FP8_DTYPE)
    return [
        dict(op="mha_prefill", name="amd.mha_prefill", fn=prefill.mha_prefill,
             traits=dict(common, kv_dtype=HALF_DTYPES, non_causal=True),
             description="Gluon flash attention, MFMA; GQA rows packed per program; "
                         "window-bounded key loop; gfx950 direct-to-LDS K/V copies"),
        dict(op="mha_extend_with_kvcache", name="amd.mha_extend_with_kvcache",
             fn=extend.mha_extend_with_kvcache,
             traits=dict(common, kv_dtype=fp8_kv, page_size=ANY),
             description="Gluon paged chunked prefill, MFMA; per-key page gather; FP8 KV"),
        dict(op="mha_decode_with_kvcache", name="amd.mha_decode_with_kvcache",
             fn=decode.mha_decode_with_kvcache,
             traits=dict(common, kv_dtype=fp8_kv, page_size=ANY,
                         q_len=range(1, decode.MAX_Q_LEN + 1)),
             description="Gluon split-KV paged decode, MFMA; splits from work and CU count; "
                         "reduce adds the sink once; FP8 KV"),
    ]  # fmt: skip


def register_attention_kernels() -> None:
    from tokenspeed_kernel.registry import register_kernel

    for kernel in attention_kernels():
        register_kernel(
            kernel["op"],
            name=kernel["name"],
            backend="amd",
            platforms=PLATFORMS,
            traits=kernel["traits"],
            priority=PRIORITY,
            description=kernel["description"],
        )(kernel["fn"])
