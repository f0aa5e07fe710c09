"""Session-wide test setup.

Without a GPU, Triton kernels run through the Triton interpreter. Triton decides that when a
kernel module is imported (at `@triton.jit` time), so the switch is set here, before any
test module imports a kernel. GPU-marked tests run on the GPU machine with `-m gpu`.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
