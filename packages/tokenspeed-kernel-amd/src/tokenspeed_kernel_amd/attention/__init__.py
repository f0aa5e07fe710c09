"""Gluon attention kernels for CDNA3/CDNA4: prefill, extend (chunked prefill over the paged
cache) and split-KV decode, over one shared attention body (`_common.attend`)."""
