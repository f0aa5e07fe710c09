"""Exhaustive search for the bit placements of the Triton MoE's shift-decode LAYOUTS
(packages/tokenspeed-kernel-triton/src/tokenspeed_kernel_triton/moe/shift_words_sm90.py).

A 32-bit word holds 8 e2m1 codes; output register k (two halves) needs its two 3-bit magnitudes
at bits field..field+2 and field+16..field+18 and its two signs at bits 15 and 31. Register k
takes its magnitudes from the word shifted by one amount and its signs from the word shifted by
another (the same one where possible). Cost per word, on the integer-ALU pipe (the contended
one; left shifts run as IMAD.SHL on the FMA pipe): one lop3 per register, one more where the
sign shift differs from the magnitude shift, one per distinct right shift.

Usage: python3 scripts/shift_words_search.py   (prints the cheapest placements per half type)
"""

from __future__ import annotations

import itertools

FIELDS = {"bf16": 6, "fp16": 9}
SHIFTS = range(-31, 32)


def sources(bits: list[int], shift: int) -> set[int] | None:
    """Source bits that `shift` (left if positive) moves onto `bits`, or None if off the word."""
    src = {b - shift for b in bits}
    return src if min(src) >= 0 and max(src) <= 31 else None


def search(field: int) -> list[tuple]:
    magnitude_bits = [field + i for i in range(3)] + [field + 16 + i for i in range(3)]
    found = []
    for mags in itertools.combinations(SHIFTS, 4):
        used: set[int] = set()
        for shift in mags:
            src = sources(magnitude_bits, shift)
            if src is None or used & src:
                break
            used |= src
        else:
            free = set(range(32)) - used
            sign_shifts = [s for s in SHIFTS if (sources([15, 31], s) or {-1}) <= free]
            for order in itertools.permutations(mags):
                for signs in itertools.permutations(sign_shifts, 4):
                    taken = [sources([15, 31], s) for s in signs]
                    if len(set().union(*taken)) != 8:
                        continue
                    distinct = {s for s in (*order, *signs) if s}
                    extra = sum(a != b for a, b in zip(order, signs, strict=True))
                    alu = 4 + extra + sum(s < 0 for s in distinct)
                    found.append((alu, len(distinct) + 4 + extra, order, signs))
    return sorted(set(found))


def main() -> None:
    for kind, field in FIELDS.items():
        best = search(field)
        alu, total, mags, signs = best[0]
        print(f"{kind}: {alu} ALU-pipe ops, {total} integer ops per word")
        for k, (m, s) in enumerate(zip(mags, signs, strict=True)):
            print(
                f"  register {k}: magnitudes from bits {field - m}, {field + 16 - m}; "
                f"signs from bits {15 - s}, {31 - s}"
            )


if __name__ == "__main__":
    main()
