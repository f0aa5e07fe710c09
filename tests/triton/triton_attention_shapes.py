"""The attention shapes the Triton safety tests run: a small one the CPU interpreter can take,
and GPT-OSS-120B's on the GPU (marker)."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch


@dataclass(frozen=True)
class Shape:
    heads_q: int
    heads_kv: int
    dim: int
    page_size: int
    dtype: torch.dtype


CPU_SHAPE = Shape(4, 2, 64, 16, torch.float16)
GPT_OSS = Shape(64, 8, 64, 64, torch.bfloat16)
SHAPES = [
    pytest.param(CPU_SHAPE, id="cpu"),
    pytest.param(GPT_OSS, id="gpt-oss", marks=pytest.mark.gpu),
]
