"""Registers the Triton attention kernels with core (imports core; the kernels do not)."""

from __future__ import annotations


def register_attention_kernels() -> None:
    _register_prefill_and_extend()
    _register_decode_and_store()


def _register_prefill_and_extend() -> None:
    """Owned by the prefill/extend kernels (prefill.py, extend.py)."""
    import os

    import torch

    from tokenspeed_kernel.platform import arch_number
    from tokenspeed_kernel.registry import ANY, Support, register_kernel

    from . import extend, prefill

    platforms = ["nvidia:sm_80+", "amd:gfx942,gfx950"]
    # The CPU runs these kernels only through the Triton interpreter (tests, debugging).
    if os.environ.get("TRITON_INTERPRET") == "1":
        platforms.append("cpu")
    half = (torch.bfloat16, torch.float16)
    common = dict(
        dtype=half, head_dim=prefill.HEAD_DIMS, gqa_ratio=ANY, window=True, sinks=True, lse=True
    )

    def supports_prefill(request, platform) -> Support:
        if platform.vendor == "cpu" and request.dtype == torch.bfloat16:
            return Support.no("the Triton 3.6 interpreter multiplies raw bits in a bf16 tl.dot")
        return Support.yes()

    def supports_extend(request, platform) -> Support:
        verdict = supports_prefill(request, platform)
        if verdict and request.kv_dtype == torch.float8_e4m3fn and platform.vendor == "nvidia":
            if (arch_number(platform.arch) or 0) < 89:
                return Support.no(f"FP8 e4m3 conversion needs sm_89+, this is {platform.arch}")
        return verdict

    register_kernel(
        "mha_prefill",
        name="triton.mha_prefill",
        backend="triton",
        platforms=platforms,
        traits=dict(common, kv_dtype=half, non_causal=True),
        priority=100,
        supports=supports_prefill,
        description="ragged flash attention; window-bounded key loop, unmasked interior blocks",
    )(prefill.mha_prefill)
    register_kernel(
        "mha_extend_with_kvcache",
        name="triton.mha_extend_with_kvcache",
        backend="triton",
        platforms=platforms,
        traits=dict(common, kv_dtype=(*half, torch.float8_e4m3fn), page_size=ANY),
        priority=100,
        supports=supports_extend,
        description="paged chunked prefill; per-token page gather (any page size), FP8 KV",
    )(extend.mha_extend_with_kvcache)


def _register_decode_and_store() -> None:
    """Owned by the decode and kvcache_store kernels (decode.py, kvcache_store.py)."""
    import os

    import torch

    from tokenspeed_kernel.registry import ANY, Support, register_kernel

    from . import decode, kvcache_store

    platforms = ["nvidia:sm_80+", "amd:gfx942,gfx950"]
    # The CPU runs these kernels only through the Triton interpreter (tests, debugging).
    if os.environ.get("TRITON_INTERPRET") == "1":
        platforms.append("cpu")
    half = (torch.bfloat16, torch.float16)
    fp8 = torch.float8_e4m3fn

    def fp8_verdict(request, platform) -> Support:
        if request.kv_dtype == fp8 and platform.vendor == "nvidia":
            sm = int(platform.arch.removeprefix("sm_").rstrip("a") or 0)
            if sm < 89:
                return Support.no(f"FP8 e4m3 conversion needs sm_89+, this is {platform.arch}")
        return Support.yes()

    def supports_decode(request, platform) -> Support:
        if platform.vendor == "cpu" and request.dtype == torch.bfloat16:
            return Support.no("the Triton 3.6 interpreter multiplies raw bits in a bf16 tl.dot")
        return fp8_verdict(request, platform)

    def supports_store(request, platform) -> Support:
        if platform.vendor == "cpu" and request.kv_dtype == fp8 and not _interpreter_fp8_ok():
            return Support.no(
                "this Triton interpreter rounds float32 -> fp8 e4m3 wrongly "
                "(7.75 does not become 8)"
            )
        return fp8_verdict(request, platform)

    register_kernel(
        "mha_decode_with_kvcache",
        name="triton.mha_decode_with_kvcache",
        backend="triton",
        platforms=platforms,
        traits=dict(
            dtype=half,
            kv_dtype=(*half, fp8),
            head_dim=decode.SUPPORTED_HEAD_DIMS,
            gqa_ratio=ANY,
            page_size=decode.SUPPORTED_PAGE_SIZES,
            q_len=range(1, decode.MAX_Q_LEN + 1),
            window=True,
            sinks=True,
            lse=True,
        ),
        priority=100,
        supports=supports_decode,
        description="split-KV paged decode; GQA heads x Q tokens share each K/V tile (tl.dot), "
        "window-bounded splits, sink added once in the reduce, FP8 KV",
    )(decode.mha_decode)
    register_kernel(
        "kvcache_store",
        name="triton.kvcache_store",
        backend="triton",
        platforms=platforms,
        traits=dict(dtype=half, kv_dtype=(*half, fp8), head_dim=ANY, page_size=ANY),
        priority=100,
        supports=supports_store,
        description="paged K/V store; negative slots skipped; FP8 saturating RNE quantization",
    )(kvcache_store.kvcache_store)


def _interpreter_fp8_ok() -> bool:
    """Whether the Triton interpreter's float32 -> fp8 e4m3 cast rounds to nearest even.

    Triton 3.6's interpreter rounds half up on the truncated mantissa and drops the carry into
    the exponent (7.75 -> 4 instead of 8), so a quantizing store run on the CPU would be wrong;
    probed at selection time (a few microseconds) so a fixed interpreter, or the tests' openly
    documented shim, is accepted. Any failure to probe counts as broken.
    """
    try:
        import numpy as np
        import triton.language as tl
        from triton.runtime import interpreter

        rtne = interpreter._ir.ROUNDING_MODE.RTNE
        got = interpreter._convert_float(
            np.array([7.75], np.float32), tl.float32, tl.float8e4nv, rtne
        )
        return int(np.asarray(got).view(np.uint8).reshape(-1)[0]) == 0x50  # e4m3fn 8.0
    except Exception:  # noqa: BLE001 - a private interpreter API; unknown means unsafe
        return False
