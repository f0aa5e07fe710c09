"""vLLM attention backend (`--attention-backend CUSTOM`) over tokenspeed-kernel's public ops.

KV cache: vLLM allocates one tensor per layer of `get_kv_cache_shape` = [2, num_blocks, P,
Hkv, D]; `kv_cache[0]` and `kv_cache[1]` are then exactly our separate K and V caches
[num_pages, P, Hkv, D] ("NHD"), contiguous, with no copy (FP8 caches arrive as uint8 and are
viewed as float8_e4m3fn). The cache write is `kvcache_store` (vLLM calls `do_kv_cache_update`
before `forward`); a batch is split as vLLM orders it, decodes first: the decode rows go to
`mha_decode_with_kvcache`, the rest to `mha_prefill` when every one of them is a fresh prompt
(no cached context) and to `mha_extend_with_kvcache` otherwise.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from vllm.v1.attention.backend import (
    AttentionBackend,
    AttentionCGSupport,
    AttentionImpl,
    AttentionMetadata,
    AttentionMetadataBuilder,
    AttentionType,
    CommonAttentionMetadata,
)
from vllm.v1.attention.backends.utils import split_decodes_and_prefills

import tokenspeed_kernel as tk

from .serving import current_platform, decline_reason

# vLLM's --kv-cache-dtype values we map to a cache dtype of our contract (None: the model's).
KV_CACHE_DTYPES: dict[str, torch.dtype | None] = {
    "auto": None,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "fp8": torch.float8_e4m3fn,
    "fp8_e4m3": torch.float8_e4m3fn,
}
# Kernel page sizes vLLM may split its blocks into (the Triton decode kernel's set).
PAGE_SIZES = (16, 32, 64, 128, 256)
# vLLM's default block size on CUDA: what a check probes when the user gave none.
DEFAULT_PAGE_SIZE = 16
_SINK_DTYPES = (torch.float32, torch.bfloat16)


def kernel_reasons(
    *,
    dtype: torch.dtype,
    kv_cache_dtype: str | None,
    head_size: int,
    num_heads: int,
    num_kv_heads: int,
    page_size: int | None,
    has_sink: bool,
    window_left: int,
    platform: tk.Platform | None = None,
) -> list[str]:
    """Why tokenspeed-kernel cannot serve a layer like this here (empty: it can). Checks the
    four ops a layer calls: the store, prefill, extend and decode."""
    kv_cache_dtype = kv_cache_dtype or "auto"
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        return [
            f"kv_cache_dtype {kv_cache_dtype!r} has no tokenspeed-kernel cache format "
            f"(supported: {', '.join(KV_CACHE_DTYPES)})"
        ]
    if page_size is not None and page_size not in PAGE_SIZES:
        return [f"block size {page_size} is not one of {', '.join(map(str, PAGE_SIZES))}"]
    page_size = page_size or DEFAULT_PAGE_SIZE
    kv_dtype = KV_CACHE_DTYPES[kv_cache_dtype] or dtype
    platform = platform or current_platform()
    common = dict(window_left=window_left, sinks=has_sink)
    requests = (
        ("kvcache_store", tk.KVStoreRequest(dtype, kv_dtype, head_size, num_kv_heads, page_size)),
        (
            "mha_prefill",
            tk.AttentionRequest(dtype, dtype, head_size, num_heads, num_kv_heads, **common),
        ),
        (
            "mha_extend_with_kvcache",
            tk.AttentionRequest(
                dtype, kv_dtype, head_size, num_heads, num_kv_heads, page_size, **common
            ),
        ),
        (
            "mha_decode_with_kvcache",
            tk.AttentionRequest(
                dtype, kv_dtype, head_size, num_heads, num_kv_heads, page_size, 1, **common
            ),
        ),
    )  # fmt: skip
    reasons = []
    for op, request in requests:
        try:
            reason = decline_reason(op, request, platform)
        except ValueError as exc:  # e.g. head counts no request can have
            reason = f"{op}: {exc}"
        if reason:
            reasons.append(reason)
    return reasons


def _model_heads() -> tuple[int, int] | None:
    """(query heads, KV heads) per rank of the model being built, if vLLM has a model config."""
    from vllm.config import get_current_vllm_config_or_none

    config = get_current_vllm_config_or_none()
    if config is None or config.model_config is None:
        return None
    model, parallel = config.model_config, config.parallel_config
    return model.get_num_attention_heads(parallel), model.get_num_kv_heads(parallel)


class TokenspeedAttentionBackend(AttentionBackend):
    """GQA attention with sinks and sliding windows on tokenspeed-kernel's ops."""

    supported_dtypes: ClassVar[list[torch.dtype]] = [torch.float16, torch.bfloat16]
    supported_kv_cache_dtypes: ClassVar[list[str]] = list(KV_CACHE_DTYPES)
    # vLLM calls do_kv_cache_update (kvcache_store) before forward.
    forward_includes_kv_cache_update: bool = False

    @staticmethod
    def get_name() -> str:
        return "CUSTOM"  # vLLM looks the backend up as AttentionBackendEnum[get_name()]

    @staticmethod
    def get_impl_cls() -> type[TokenspeedAttentionImpl]:
        return TokenspeedAttentionImpl

    @staticmethod
    def get_builder_cls() -> type[TokenspeedAttentionMetadataBuilder]:
        return TokenspeedAttentionMetadataBuilder

    @staticmethod
    def get_supported_kernel_block_sizes() -> list[int]:
        return list(PAGE_SIZES)

    @staticmethod
    def get_kv_cache_shape(
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_size: int,
        cache_dtype_str: str = "auto",
    ) -> tuple[int, ...]:
        if block_size not in PAGE_SIZES:
            raise ValueError(
                f"tokenspeed-kernel attention: block size {block_size}, expected one of "
                f"{', '.join(map(str, PAGE_SIZES))}"
            )
        if cache_dtype_str not in KV_CACHE_DTYPES:
            raise ValueError(
                f"tokenspeed-kernel attention: kv cache dtype {cache_dtype_str!r}, expected one "
                f"of {', '.join(KV_CACHE_DTYPES)}"
            )
        return (2, num_blocks, block_size, num_kv_heads, head_size)

    @classmethod
    def supports_sink(cls) -> bool:
        return True

    @classmethod
    def supports_sliding_window(cls) -> bool:
        return True

    @classmethod
    def validate_configuration(
        cls,
        head_size: int,
        dtype: torch.dtype,
        kv_cache_dtype: str | None,
        block_size: int | None,
        use_mla: bool,
        has_sink: bool,
        use_sparse: bool,
        use_mm_prefix: bool,
        use_per_head_quant_scales: bool,
        device_capability,
        attn_type: str,
        has_sliding_window: bool = False,
        use_non_causal: bool = False,
        use_batch_invariant: bool = False,
        use_kv_connector: bool = False,
        use_pcp: bool = False,
    ) -> list[str]:
        """vLLM's generic checks, then whether a tokenspeed-kernel kernel (not the reference)
        serves each op of such a layer on this device, with every candidate's reason."""
        reasons = super().validate_configuration(
            head_size, dtype, kv_cache_dtype, block_size, use_mla, has_sink, use_sparse,
            use_mm_prefix, use_per_head_quant_scales, device_capability, attn_type,
            has_sliding_window, use_non_causal, use_batch_invariant, use_kv_connector, use_pcp,
        )  # fmt: skip
        if reasons:
            return reasons
        # vLLM does not pass the head counts: the model's if it is being built, else GQA
        # ratio 1 (the impl re-checks each layer with its real heads, window and page size).
        heads = _model_heads() or (1, 1)
        return kernel_reasons(
            dtype=dtype,
            kv_cache_dtype=kv_cache_dtype,
            head_size=head_size,
            num_heads=heads[0],
            num_kv_heads=heads[1],
            page_size=block_size,
            has_sink=has_sink,
            # The window's size is not passed either; selection only sees whether there is one.
            window_left=127 if has_sliding_window else -1,
        )


@dataclass
class DecodeBatch:
    """The decode rows (one query token each), first in vLLM's reordered batch."""

    page_table: torch.Tensor  # [num_decodes, max_pages] int32
    cache_seqlens: torch.Tensor  # [num_decodes] int32, including the new token


@dataclass
class PrefillBatch:
    """The other rows: fresh prompts (`mha_prefill`) or chunks over a cached context (extend)."""

    cu_seqlens_q: torch.Tensor  # [num_prefills + 1] int32, from 0
    max_seqlen_q: int
    page_table: torch.Tensor
    cache_seqlens: torch.Tensor
    fresh: bool  # every row is a whole prompt with nothing cached before it


@dataclass
class TokenspeedAttentionMetadata(AttentionMetadata):
    num_actual_tokens: int
    num_decode_tokens: int  # = the number of decode rows
    decode: DecodeBatch | None
    prefill: PrefillBatch | None


class TokenspeedAttentionMetadataBuilder(AttentionMetadataBuilder[TokenspeedAttentionMetadata]):
    # Decode-only steps of one query token per request may be captured whole: the metadata reads
    # the runner's persistent buffers in place (tests/vllm/test_attention.py) and a captured
    # step replays correctly over them refilled (tests/vllm/test_gpu.py). Steps with prefill or
    # extend rows plan on the host (max query length, the fresh-prompt test), so they stay
    # piecewise: attention runs eagerly between the captured pieces.
    _cudagraph_support: ClassVar[AttentionCGSupport] = (
        AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE
    )

    def __init__(self, kv_cache_spec, layer_names, vllm_config, device):
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        # vLLM moves requests with one query token to the front of the batch.
        self._init_reorder_batch_threshold(1)

    def build(
        self,
        common_prefix_len: int,
        common_attn_metadata: CommonAttentionMetadata,
        fast_build: bool = False,
    ) -> TokenspeedAttentionMetadata:
        m = common_attn_metadata
        num_reqs, num_tokens = m.num_reqs, m.num_actual_tokens
        num_decodes, _, num_decode_tokens, _ = split_decodes_and_prefills(m, decode_threshold=1)
        if num_decode_tokens != num_decodes:  # a padding row with no token: all go to extend
            num_decodes = num_decode_tokens = 0
        decode = None
        if num_decodes:
            decode = DecodeBatch(m.block_table_tensor[:num_decodes], m.seq_lens[:num_decodes])
        prefill = None
        if num_decodes < num_reqs:
            starts = m.query_start_loc_cpu[num_decodes : num_reqs + 1]
            query_lens = starts[1:] - starts[:-1]
            upper = m.seq_lens_cpu_upper_bound
            # The CPU bound is exact for prefill rows; without it, assume a cached context.
            fresh = upper is not None and bool(
                torch.equal(upper[num_decodes:num_reqs].to(query_lens.dtype), query_lens)
            )
            prefill = PrefillBatch(
                m.query_start_loc[num_decodes : num_reqs + 1] - num_decode_tokens,
                int(query_lens.max()),
                m.block_table_tensor[num_decodes:num_reqs],
                m.seq_lens[num_decodes:num_reqs],
                fresh,
            )
        return TokenspeedAttentionMetadata(num_tokens, num_decode_tokens, decode, prefill)


class TokenspeedAttentionImpl(AttentionImpl[TokenspeedAttentionMetadata]):
    # Decode context parallelism merges shards by their lse, which forward does not return.
    supports_dcp: bool = False

    def __init__(
        self,
        num_heads: int,
        head_size: int,
        scale: float,
        num_kv_heads: int,
        alibi_slopes: list[float] | None,
        sliding_window: int | None,
        kv_cache_dtype: str,
        logits_soft_cap: float | None = None,
        attn_type: str = AttentionType.DECODER,
        kv_sharing_target_layer_name: str | None = None,
        sinks: torch.Tensor | None = None,
    ) -> None:
        unsupported = {
            "ALiBi slopes": alibi_slopes is not None,
            "a logits soft cap": bool(logits_soft_cap),
            f"attention type {attn_type}": attn_type != AttentionType.DECODER,
        }
        for what, present in unsupported.items():
            if present:
                raise NotImplementedError(f"tokenspeed-kernel attention: {what} is not supported")
        if kv_cache_dtype not in KV_CACHE_DTYPES:
            raise NotImplementedError(
                f"tokenspeed-kernel attention: kv_cache_dtype {kv_cache_dtype!r}, expected one "
                f"of {', '.join(KV_CACHE_DTYPES)}"
            )
        if sinks is not None and sinks.shape != (num_heads,):
            raise ValueError(
                f"tokenspeed-kernel attention: sinks has shape {list(sinks.shape)}, expected "
                f"[{num_heads}] (one per query head of this rank)"
            )
        self.num_heads = num_heads
        self.head_size = head_size
        self.scale = float(scale)
        self.num_kv_heads = num_kv_heads
        self.kv_cache_dtype = kv_cache_dtype
        self.kv_sharing_target_layer_name = kv_sharing_target_layer_name
        self.attn_type = attn_type
        # vLLM's sliding_window counts the query itself (GPT-OSS: 128); window_left does not.
        self.window_left = -1 if sliding_window is None else sliding_window - 1
        self.sinks = sinks
        self.fp8 = KV_CACHE_DTYPES[kv_cache_dtype] == torch.float8_e4m3fn
        self._check_served()

    def _check_served(self) -> None:
        """Fail at model construction, naming every candidate's reason, rather than at the
        first forward."""
        from vllm.config import get_current_vllm_config_or_none

        config = get_current_vllm_config_or_none()
        model = None if config is None else config.model_config
        cache = None if config is None else config.cache_config
        block = cache.block_size if cache is not None and cache.user_specified_block_size else None
        reasons = kernel_reasons(
            dtype=model.dtype if model is not None else torch.get_default_dtype(),
            kv_cache_dtype=self.kv_cache_dtype,
            head_size=self.head_size,
            num_heads=self.num_heads,
            num_kv_heads=self.num_kv_heads,
            page_size=block,
            has_sink=self.sinks is not None,
            window_left=self.window_left,
        )
        if reasons:
            raise NotImplementedError(
                "tokenspeed-kernel attention cannot serve this layer here:\n  "
                + "\n  ".join(reasons)
            )

    def process_weights_after_loading(self, act_dtype: torch.dtype) -> None:
        # The ops take float32 or bfloat16 sinks; a float16 model's are widened once here.
        if self.sinks is not None and self.sinks.dtype not in _SINK_DTYPES:
            self.sinks = self.sinks.detach().float()

    def _caches(self, kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        k_cache, v_cache = kv_cache[0], kv_cache[1]
        if self.fp8 and k_cache.dtype != torch.float8_e4m3fn:
            k_cache, v_cache = k_cache.view(torch.float8_e4m3fn), v_cache.view(torch.float8_e4m3fn)
        return k_cache, v_cache

    def _scales(self, layer) -> dict[str, float]:
        if not self.fp8:
            return {}
        return {"k_scale": layer._k_scale_float, "v_scale": layer._v_scale_float}

    def do_kv_cache_update(
        self,
        layer,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> None:
        """Store key/value [T, Hkv, D] at slot_mapping [T'] (negative: padding, skipped)."""
        k_cache, v_cache = self._caches(kv_cache)
        # CUDA-graph padding may give more key rows than slots; rows beyond them are padding.
        n = slot_mapping.shape[0]
        tk.kvcache_store(
            key[:n], value[:n], k_cache, v_cache, slot_mapping=slot_mapping, **self._scales(layer)
        )

    def forward(
        self,
        layer,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        attn_metadata: TokenspeedAttentionMetadata,
        output: torch.Tensor,
        output_scale: torch.Tensor | None = None,
        output_block_scale: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """query [T, Hq, D], key/value [T, Hkv, D] (already stored), output [T, Hq, D]."""
        if output_scale is not None or output_block_scale is not None:
            raise NotImplementedError(
                "tokenspeed-kernel attention: fused output quantization is not supported"
            )
        if attn_metadata is None:  # vLLM's profiling run
            return output.fill_(0)
        m = attn_metadata
        k_cache, v_cache = self._caches(kv_cache)
        options = dict(window_left=self.window_left, sinks=self.sinks, softmax_scale=self.scale)
        scales = self._scales(layer)
        d = m.num_decode_tokens
        if m.decode is not None:
            tk.mha_decode_with_kvcache(
                query[:d], k_cache, v_cache, page_table=m.decode.page_table,
                cache_seqlens=m.decode.cache_seqlens, out=output[:d], **options, **scales,
            )  # fmt: skip
        p, rows = m.prefill, slice(d, m.num_actual_tokens)
        if p is not None and p.fresh and key is not None:
            tk.mha_prefill(
                query[rows], key[rows], value[rows], cu_seqlens=p.cu_seqlens_q,
                max_seqlen=p.max_seqlen_q, out=output[rows], **options,
            )  # fmt: skip
        elif p is not None:
            tk.mha_extend_with_kvcache(
                query[rows], k_cache, v_cache, cu_seqlens_q=p.cu_seqlens_q,
                page_table=p.page_table, cache_seqlens=p.cache_seqlens,
                max_seqlen_q=p.max_seqlen_q, out=output[rows], **options, **scales,
            )  # fmt: skip
        return output
