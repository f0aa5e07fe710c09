"""How precise must the MoE SwiGLU intermediate be for the shared bf16 tolerance?

GPT-OSS-120B-sized expert (H = I = 2880, random MXFP4 codes, e8m0 scales around 1/sqrt(K) as
the GPU tests build them, biases 0.5 * N(0, 1)), 64 tokens, float64 math. The exact output is
compared, after the bf16 rounding every kernel does at the end, with the output of a GEMM2
fed `a` rounded to bf16 (one MMA), to fp16 (one MMA), to bf16 hi + lo (the Triton kernels'
two MMAs) and to sums of two or three e4m3 terms (what FP8 MMAs on bf16 activations would take:
each term the e4m3 rounding of what the ones before left, `a` times 8 so that the SwiGLU clamp's
bound, 56, sits below e4m3's largest value, 448), under the conformance tolerance
|err| <= 1e-2 + 1.6e-2 |expected|.

    uv run python scripts/moe_intermediate_precision.py
"""

from __future__ import annotations

import torch

H = I = 2880  # noqa: E741
E2M1 = torch.tensor([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6])


def mxfp4_matrix(rows: int, cols: int, gen: torch.Generator) -> torch.Tensor:
    codes = torch.randint(0, 16, (rows, cols), generator=gen)
    exponents = torch.randint(119, 122, (rows, cols // 32), generator=gen).double() - 127
    return E2M1.double()[codes] * (2.0**exponents).repeat_interleave(32, dim=1)


def e4m3_terms(a: torch.Tensor, terms: int, scale: float = 8.0) -> torch.Tensor:
    rest = a.float().double() * scale
    total = torch.zeros_like(rest)
    for _ in range(terms):
        term = rest.float().to(torch.float8_e4m3fn).double()
        total += term
        rest -= term
    return total / scale


def main() -> None:
    gen = torch.Generator().manual_seed(0)
    w13, w2 = mxfp4_matrix(2 * I, H, gen), mxfp4_matrix(H, I, gen)
    b13 = 0.5 * torch.randn(2 * I, generator=gen, dtype=torch.float64)
    b2 = 0.5 * torch.randn(H, generator=gen, dtype=torch.float64)
    x = torch.randn(64, H, generator=gen).to(torch.bfloat16).double()
    h = x @ w13.T + b13
    g, u = h[:, 0::2].clamp(max=7.0), h[:, 1::2].clamp(-7.0, 7.0)
    a = g * torch.sigmoid(1.702 * g) * (u + 1)
    expected = (a @ w2.T + b2).to(torch.bfloat16).double()
    tolerance = 1e-2 + 1.6e-2 * expected.abs()
    hi = a.float().to(torch.bfloat16)
    lo = (a.float() - hi.float()).to(torch.bfloat16)
    variants = {
        "bf16 (one MMA)": hi.double(),
        "fp16 (one MMA)": a.float().to(torch.float16).double(),
        "bf16 hi + lo (two MMAs)": hi.double() + lo.double(),
        "e4m3 x 2 (two FP8 MMAs)": e4m3_terms(a, 2),
        "e4m3 x 3 (three)": e4m3_terms(a, 3),
    }
    print(f"64 tokens x {H} outputs; worst |err| / tolerance, outputs over tolerance:")
    for name, rounded in variants.items():
        got = (rounded @ w2.T + b2).to(torch.bfloat16).double()
        ratio = (got - expected).abs() / tolerance
        print(f"  {name:24s} {ratio.max().item():6.3f}  {(ratio > 1).sum().item():6d}")


if __name__ == "__main__":
    main()
