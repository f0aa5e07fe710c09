"""Integrations with model libraries and a GPT-OSS model written on the public ops.

`integrations.transformers`: transformers' GPT-OSS on tokenspeed ops (imports transformers
only when called). `integrations.gpt_oss`: a GPT-OSS decoder on the public ops with a paged KV
cache, for end-to-end checks and benchmarks. Importing `tokenspeed_kernel` loads neither.
"""
