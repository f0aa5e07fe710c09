"""Weight order and register layouts of the Hopper fragment GEMM (wgmma_gemm_sm90.py).

wgmma's A operand in registers (bf16, k_width 2) gives thread (warp w, lane l) of a
[64 rows, 128 K] chunk the rows 16w + l/4 (+8) and, per row, the K elements
2 * (l % 4) + {0, 1} (+8, +16, +32, +64). The prepared MXFP4 words are reordered so that a thread
loads exactly those: within each 128-element K chunk, word j = 4 * jhi + jlo (16 words per row)
holds the elements

    k = 32 * jlo + 16 * b2 + 8 * b1 + 2 * jhi + b0   in slot  i = 4 * b2 + 2 * b1 + b0,

so the lane's K pair index jhi picks 4 consecutive words (one 16-byte load), slot pairs (b0) are
the bf16x2 register pairs, and every word stays inside one 32-element scale block (jlo). Each
word then takes shift_words' or mxfp4_words' bit encoding of its 8 slots (layout.py).

GEMM1's rows are regrouped too: each 16-row group holds the gate rows of 8 intermediate channels
then their up rows, because the accumulator gives rows r and r + 8 to the same thread.

Storage is panel-major: a panel of 64 rows (wgmma's M, the smallest row block a CTA takes) keeps
each K chunk's 64 x 16 words (64 x 4 scale bytes) together, chunk after chunk. A ring step's
copy (64 rows x a few chunks) is then one run of contiguous bytes; in row-major words it is 64
runs of 256 bytes, 1.5 KB apart, which the HBM serves at a fraction of its streaming rate.
The tensors keep the logical index order [E, N / 64, 64, K / 128, 16 words or 4 scale bytes]
(a permuted view), so the kernel takes any of these layouts through its strides.
"""

from __future__ import annotations

import torch

CHUNK_K = 128
CHUNK_WORDS = CHUNK_K // 8
PANEL_ROWS = 64


def panel_view(t: torch.Tensor) -> torch.Tensor:
    """[E, N, K / 8] words or [E, N, K / 32] scale bytes -> the view [E, N / 64, 64, K / 128,
    16 or 4] of the same storage (N a multiple of 64, K of 128)."""
    E, N, width = t.shape
    per_chunk = {torch.int32: CHUNK_WORDS, torch.uint8: CHUNK_K // 32}[t.dtype]
    if N % PANEL_ROWS or width % per_chunk:
        raise ValueError(
            f"panel_view: {N} rows x {width} {t.dtype} is not whole panels of {PANEL_ROWS} rows "
            f"and chunks of {per_chunk}"
        )
    return t.reshape(E, N // PANEL_ROWS, PANEL_ROWS, width // per_chunk, per_chunk)


def panel_major(t: torch.Tensor) -> torch.Tensor:
    """panel_view(t) stored panel-major: each panel's chunks one after another, a chunk's rows
    contiguous (a fresh tensor, same logical indices)."""
    return panel_view(t).transpose(2, 3).contiguous().transpose(2, 3)


def fragment_order(packed: torch.Tensor) -> torch.Tensor:
    """[..., K/2] uint8 checkpoint MXFP4 (K a multiple of 128) -> the same codes, repacked
    (low nibble first) in fragment order, ready for mxfp4_words.encode_words."""
    K = packed.shape[-1] * 2
    if K % CHUNK_K:
        raise ValueError(f"fragment_order: K = {K} is not a multiple of {CHUNK_K}")
    lead = packed.shape[:-1]
    codes = torch.stack((packed & 0xF, packed >> 4), dim=-1)
    # k = 32 jlo + 16 b2 + 8 b1 + 2 jhi + b0  ->  order (jhi, jlo, b2, b1, b0).
    codes = codes.reshape(*lead, K // CHUNK_K, 4, 2, 2, 4, 2)
    n = codes.dim()
    codes = codes.permute(*range(n - 5), n - 2, n - 5, n - 4, n - 3, n - 1)
    codes = codes.reshape(*lead, K // 2, 2)
    return codes[..., 0] | (codes[..., 1] << 4)


def group_gate_up(t: torch.Tensor) -> torch.Tensor:
    """[E, 2I, ...] with interleaved gate (even) / up (odd) rows -> 16-row groups of 8 gate rows
    then the matching 8 up rows (2I a multiple of 16)."""
    E, rows = t.shape[:2]
    if rows % 16:
        raise ValueError(f"group_gate_up: {rows} rows is not a multiple of 16")
    grouped = t.reshape(E, rows // 16, 8, 2, *t.shape[2:]).transpose(2, 3)
    return grouped.reshape(t.shape)


def kernel_layouts(
    block_w: int, block_t: int, num_warps: int, chunks: int = 1, e4m3: bool = False
) -> dict:
    """The Gluon layouts the fragment GEMM is compiled with (constexpr arguments); the copy
    layouts cover a ring step of `chunks` K chunks. e4m3: e4m3 fragments and activations
    (e4m3_fragments_sm90.py): k32 MMAs, and the words layout is the 4-D [block_w, 4 quads, 4
    words, 4 bytes] one that fragment_steps_sm90.e4m3_fragment decodes in."""
    from triton.experimental.gluon import language as gl

    rows_per_pass = 16 * num_warps
    if block_w % rows_per_pass or block_t % 8 or not 8 <= block_t <= 256:
        raise ValueError(
            f"kernel_layouts: block_w {block_w} must be a multiple of {rows_per_pass} and "
            f"block_t {block_t} a multiple of 8 in [8, 256]"
        )
    mma = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, block_t, 32 if e4m3 else 16]
    )
    repeats = [[rows_per_pass << i, 0] for i in range((block_w // rows_per_pass).bit_length() - 1)]
    warps = [[16 << i, 0] for i in range(num_warps.bit_length() - 1)]
    if e4m3:
        # A thread's 4 words of its lane quad q (words 4q .. 4q + 3: one 16-byte load), the
        # 4th dimension the 4 e4m3 bytes each word's half decodes to.
        words = gl.DistributedLinearLayout(
            reg_bases=[[0, 0, 0, 1], [0, 0, 0, 2], [0, 0, 1, 0], [0, 0, 2, 0], [8, 0, 0, 0]]
            + [[r, 0, 0, 0] for r, _ in repeats],
            lane_bases=[[0, 1, 0, 0], [0, 2, 0, 0], [1, 0, 0, 0], [2, 0, 0, 0], [4, 0, 0, 0]],
            warp_bases=[[r, 0, 0, 0] for r, _ in warps],
            block_bases=[],
            shape=[block_w, 4, 4, 4],
        )
    else:
        words = gl.DistributedLinearLayout(
            reg_bases=[[0, 1], [0, 2], [8, 0], *repeats],
            lane_bases=[[0, 4], [0, 8], [1, 0], [2, 0], [4, 0]],
            warp_bases=warps,
            block_bases=[],
            shape=[block_w, CHUNK_WORDS],
        )
    act_type = gl.float8e4nv if e4m3 else gl.bfloat16
    scale_warps_w = max(1, min(num_warps, block_w // 32))
    scale_warps_c = num_warps // scale_warps_w
    rows_lanes = min(32, block_w // 8)
    return dict(
        mma=mma,
        dot_a=gl.DotOperandLayout(operand_index=0, parent=mma, k_width=4 if e4m3 else 2),
        words_layout=words,
        # [block_t, chunks * 128] activations: 16-byte cp.async per thread.
        copy_layout=gl.BlockedLayout([1, 16], [4, 8], [num_warps, 1], [1, 0])
        if e4m3
        else gl.BlockedLayout([1, 8], [2, 16], [num_warps, 1], [1, 0]),
        smem_layout=gl.NVMMASharedLayout.get_default_for([block_t, chunks * CHUNK_K], act_type),
        # The weight ring: 16-byte cp.async per thread; a warp's 16-byte reads in the words
        # layout cover 8 whole 64-byte rows, so the plain row-major tile has no bank conflicts.
        words_copy=gl.BlockedLayout([1, 1, 4], [1, 8, 4], [1, num_warps, 1], [2, 1, 0]),
        # [chunks, block_w] scale words, one per thread where the step has that many.
        scales_copy=gl.BlockedLayout([1, 1], [1, 32], [scale_warps_c, scale_warps_w], [1, 0]),
        words_smem_layout=gl.SwizzledSharedLayout(1, 1, 1, [1, 0]),
        scales_smem_layout=gl.SwizzledSharedLayout(1, 1, 1, [0]),
        # The same rings seen one ring step ([chunks, ...]) at a time, for its copies.
        words_step_layout=gl.SwizzledSharedLayout(1, 1, 1, [2, 1, 0]),
        scales_step_layout=gl.SwizzledSharedLayout(1, 1, 1, [1, 0]),
        # GEMM2's [block_w, block_t] tile as its fp16 pair rows are stored: 8 consecutive
        # weight rows (output columns) of one token per thread, 16-byte stores.
        pair_rows_layout=gl.BlockedLayout(
            [8, 1], [rows_lanes, 32 // rows_lanes], [1, num_warps], [0, 1]
        ),
        stage_layout=gl.SwizzledSharedLayout(8, 1, 8, [0, 1]),
    )
