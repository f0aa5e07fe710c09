"""Core imports and runs with no GPU, no triton and no vendor package, probing nothing."""

from __future__ import annotations

import subprocess
import sys

SCRIPT = """
import sys
sys.modules["triton"] = None  # any `import triton` now raises ImportError
import torch
import tokenspeed_kernel as tk
assert not torch.cuda.is_initialized(), "importing core touched the GPU"
from tokenspeed_kernel import plugins
q = torch.randn(4, 2, 16, dtype=torch.bfloat16)
cu = torch.tensor([0, 4], dtype=torch.int32)
out = tk.mha_prefill(q, q, q, cu_seqlens=cu, max_seqlen=4)
assert out.shape == q.shape
assert not torch.cuda.is_initialized(), "a CPU op touched the GPU"
vendor_modules = [m for m in sys.modules if m.startswith(("flashinfer", "tokenspeed_kernel_"))]
developer = ("tokenspeed_kernel.tools", "tokenspeed_kernel.testing", "tokenspeed_kernel.cli")
dev_modules = [m for m in sys.modules if m.startswith(developer)]
assert not dev_modules, f"the runtime loaded developer modules: {dev_modules}"
print("loaded", ",".join(sorted(r.name for r in plugins.load_plugins() if r.status == "loaded")))
print("vendor", ",".join(vendor_modules))
"""


def test_core_imports_without_triton_or_gpu_probe():
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT],
        capture_output=True,
        text=True,
        timeout=120,
        env={"TOKENSPEED_KERNEL_PLUGINS": "", "PATH": ""},
    )
    assert done.returncode == 0, done.stderr
    assert "loaded \n" in done.stdout and "vendor \n" in done.stdout


def test_core_never_imports_a_vendor_package_by_name():
    from pathlib import Path

    import tokenspeed_kernel

    root = Path(tokenspeed_kernel.__file__).parent
    for path in root.rglob("*.py"):
        text = path.read_text()
        for vendor in (
            "import triton",
            "from triton",
            "flashinfer",
            "tokenspeed_kernel_triton",
            "tokenspeed_kernel_amd",
            "flash_attn",
        ):
            # Developer tools import triton lazily: the AOT check compiles Triton kernels.
            dev_tool = path.name == "aot.py" and "triton" in vendor
            if vendor in text and "peers" not in path.name and not dev_tool:
                raise AssertionError(f"{path.relative_to(root)} mentions {vendor!r}")
