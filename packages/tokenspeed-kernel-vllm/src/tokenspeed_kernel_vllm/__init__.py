"""vLLM general plugin: registers tokenspeed-kernel's attention backend and GPT-OSS MXFP4 MoE."""
