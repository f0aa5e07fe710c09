"""Session-wide test setup.

`pytest` with the default mark expression ("not gpu", pyproject's addopts) runs the CPU suite:
the references, the Triton kernels through the Triton interpreter, the ahead-of-time compiles.
It runs the same on a machine with a GPU: the GPUs are hidden and the interpreter switched on
here, before any test module imports torch or a kernel (CUDA reads the visible devices when it
starts, Triton picks the interpreter at `@triton.jit` time). Otherwise (`pytest -m gpu` on the
GPU machine) the GPU stays visible, and the interpreter is on only where torch sees no GPU; a
run that selects both kinds at once therefore runs its CPU tests without the interpreter there.
"""

import os


def pytest_configure(config):
    if config.option.markexpr == "not gpu":
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
        os.environ["HIP_VISIBLE_DEVICES"] = ""
        os.environ.setdefault("TRITON_INTERPRET", "1")
        return
    import torch

    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")
