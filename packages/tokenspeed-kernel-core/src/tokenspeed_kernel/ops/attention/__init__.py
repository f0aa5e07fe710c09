from . import reference  # noqa: F401  (registers the reference kernels)
from .api import kvcache_store, mha_decode_with_kvcache, mha_extend_with_kvcache, mha_prefill
from .request import AttentionRequest, KVStoreRequest

__all__ = [
    "AttentionRequest",
    "KVStoreRequest",
    "kvcache_store",
    "mha_decode_with_kvcache",
    "mha_extend_with_kvcache",
    "mha_prefill",
]
