"""Adapters over FlashInfer (`flashinfer-python`, extra `[flashinfer]`), including its ports of
TensorRT-LLM's kernels: XQA decode, trtllm-gen attention, the TRT-LLM fused MoE."""
