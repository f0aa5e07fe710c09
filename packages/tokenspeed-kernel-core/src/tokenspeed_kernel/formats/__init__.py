"""Number formats: MXFP4 (e2m1 elements, e8m0 block-32 scales) and FP8 e4m3 with float32 scales."""

from tokenspeed_kernel.formats.fp8 import FP8_DTYPE, FP8_E4M3_MAX, dequantize_fp8, quantize_fp8
from tokenspeed_kernel.formats.mxfp4 import (
    E2M1_VALUES,
    MXFP4_BLOCK,
    dequantize_mxfp4,
    e2m1_to_float,
    float_to_e2m1,
    pack_e2m1,
    quantize_mxfp4,
    unpack_e2m1,
)

__all__ = [
    "E2M1_VALUES",
    "FP8_DTYPE",
    "FP8_E4M3_MAX",
    "MXFP4_BLOCK",
    "dequantize_fp8",
    "dequantize_mxfp4",
    "e2m1_to_float",
    "float_to_e2m1",
    "pack_e2m1",
    "quantize_fp8",
    "quantize_mxfp4",
    "unpack_e2m1",
]
