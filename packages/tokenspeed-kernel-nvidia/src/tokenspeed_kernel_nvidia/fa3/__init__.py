"""Adapters over FlashAttention-3 with sinks (`tokenspeed-fa3`, extra `[fa3]`): prefill, extend
and decode on sm_90."""
