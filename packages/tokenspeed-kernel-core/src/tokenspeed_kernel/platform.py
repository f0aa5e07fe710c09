"""Platform detection (from a tensor's own device) and platform requirements of kernels.

Nothing here touches hardware at import time: a device is queried the first time a request
runs on it, then cached. This is the only place any package reads device properties: kernels
take their SM count, shared memory and arch from `platform_of(device)`. Tests and the
ahead-of-time compile check fake a platform with `fake_platform(...)`.
"""

from __future__ import annotations

import contextlib
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

VENDORS = ("cpu", "nvidia", "amd")


@dataclass(frozen=True)
class Platform:
    """The silicon a request runs on. `sm_count` is SMs on NVIDIA, CUs on AMD, cores on CPU.
    `shared_memory_bytes` is what one block (workgroup) may use, `shared_memory_per_sm_bytes`
    what one SM (CU) holds for all its resident blocks."""

    vendor: str
    arch: str
    device_index: int | None = None
    sm_count: int = 0
    name: str = ""
    shared_memory_bytes: int = 0
    l2_bytes: int = 0
    shared_memory_per_sm_bytes: int = 0
    _hash: int = field(default=0, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        # Platforms are part of every selector cache key: hash once, not on every call.
        key = (self.vendor, self.arch, self.device_index, self.sm_count, self.name)
        object.__setattr__(self, "_hash", hash(key))

    def __hash__(self) -> int:
        return self._hash

    @property
    def sm(self) -> int:
        """NVIDIA compute capability as an int (`sm_90` -> 90); 0 on other vendors."""
        return arch_number(self.arch) or 0

    @property
    def capabilities(self) -> frozenset[str]:
        return _capabilities(self.vendor, self.arch)

    @property
    def label(self) -> str:
        """`nvidia sm_90`, `amd gfx950`, `cpu`."""
        return self.vendor if self.arch == self.vendor else f"{self.vendor} {self.arch}"

    def __str__(self) -> str:
        where = "" if self.device_index is None else f" (device {self.device_index})"
        label = f" {self.name}" if self.name else ""
        units = {"nvidia": "SMs", "amd": "CUs"}.get(self.vendor, "cores")
        return f"{self.label}{label}, {self.sm_count} {units}{where}"


def arch_number(arch: str) -> int | None:
    """`sm_90` -> 90, `sm_100` -> 100; None for non-NVIDIA archs."""
    match = re.fullmatch(r"sm_(\d+)a?", arch)
    return int(match.group(1)) if match else None


def _capabilities(vendor: str, arch: str) -> frozenset[str]:
    caps: set[str] = set()
    if vendor == "nvidia":
        sm = arch_number(arch) or 0
        if sm >= 80:
            caps |= {"bf16", "cp_async"}
        if sm >= 89:
            caps.add("fp8")
        if sm == 90:
            caps |= {"wgmma", "tma"}
        if sm >= 100:
            caps |= {"tma", "tcgen05"}
    elif vendor == "amd":
        if arch in ("gfx942", "gfx950"):
            caps |= {"bf16", "fp8", "mfma"}
        if arch == "gfx950":
            caps.add("mfma_scale")
    elif vendor == "cpu":
        caps.add("bf16")
    return frozenset(caps)


# Platforms of the machines we target, for tests and for `explain` on machines we lack.
KNOWN_PLATFORMS: dict[str, Platform] = {
    "cpu": Platform("cpu", "cpu", None, 2, "CPU"),
    "h100": Platform("nvidia", "sm_90", 0, 132, "NVIDIA H100 80GB HBM3", 232448, 50 << 20, 233472),
    "h200": Platform("nvidia", "sm_90", 0, 132, "NVIDIA H200", 232448, 60 << 20, 233472),
    "b200": Platform("nvidia", "sm_100", 0, 148, "NVIDIA B200", 232448, 126 << 20, 233472),
    "mi300x": Platform("amd", "gfx942", 0, 304, "AMD Instinct MI300X", 65536, 4 << 20, 65536),
    "mi355x": Platform("amd", "gfx950", 0, 256, "AMD Instinct MI355X", 163840, 4 << 20, 163840),
}
# The platform each ahead-of-time compile target is checked as.
AOT_TARGETS: dict[str, Platform] = {
    "sm_90": KNOWN_PLATFORMS["h100"],
    "gfx942": KNOWN_PLATFORMS["mi300x"],
    "gfx950": KNOWN_PLATFORMS["mi355x"],
}

_fake: Platform | None = None
_detected: dict[torch.device, Platform] = {}


@contextlib.contextmanager
def fake_platform(platform: Platform | str) -> Iterator[Platform]:
    """Make every request resolve to `platform` (a Platform or a KNOWN_PLATFORMS key)."""
    global _fake
    if isinstance(platform, str):
        if platform not in KNOWN_PLATFORMS:
            known = ", ".join(KNOWN_PLATFORMS)
            raise ValueError(
                f"fake_platform: unknown platform {platform!r}, expected one of {known}"
            )
        platform = KNOWN_PLATFORMS[platform]
    previous, _fake = _fake, platform
    try:
        yield platform
    finally:
        _fake = previous


def platform_of(device: torch.device) -> Platform:
    """The platform of `device` (cached per device; a faked platform wins)."""
    if _fake is not None:
        return _fake
    platform = _detected.get(device)
    if platform is None:
        platform = _detected[device] = _detect(device)
    return platform


def default_device() -> torch.device:
    """The device a runtime would use here: the current GPU if there is one, else the CPU."""
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _detect(device: torch.device) -> Platform:
    if device.type == "meta":
        raise ValueError("meta tensors hold no data: kernels need cpu or cuda tensors")
    if device.type == "cpu":
        return Platform("cpu", "cpu", None, os.cpu_count() or 1, "CPU")
    if device.type != "cuda":
        return Platform(device.type, device.type, device.index, 0, device.type)
    index = device.index if device.index is not None else torch.cuda.current_device()
    props = torch.cuda.get_device_properties(index)
    if torch.version.hip:
        vendor, arch = "amd", props.gcnArchName.split(":")[0]
    else:
        vendor, arch = "nvidia", f"sm_{props.major}{props.minor}"
    shared = getattr(props, "shared_memory_per_block_optin", 0) or 0
    per_sm = getattr(props, "shared_memory_per_multiprocessor", 0) or 0
    l2 = getattr(props, "L2_cache_size", 0) or 0
    return Platform(
        vendor, arch, index, props.multi_processor_count, props.name, shared, l2, per_sm
    )


def interpreting() -> bool:
    """Whether Triton kernels run through the Triton interpreter (how a CPU runs them)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


@dataclass(frozen=True)
class PlatformSpec:
    """What a kernel needs: a vendor, optionally an arch set or an NVIDIA sm range, and
    capabilities. Written as strings too: "cpu", "nvidia:sm_80+", "nvidia:sm_90..sm_100",
    "amd:gfx942,gfx950", "*" (anywhere)."""

    vendor: str
    archs: frozenset[str] | None = None
    min_sm: int | None = None
    max_sm: int | None = None
    capabilities: frozenset[str] = frozenset()

    @classmethod
    def parse(cls, text: str) -> PlatformSpec:
        vendor, _, archs = text.partition(":")
        if vendor != "*" and vendor not in VENDORS:
            raise ValueError(f"platform spec {text!r}: vendor must be *, {', '.join(VENDORS)}")
        if not archs:
            return cls(vendor)
        if match := re.fullmatch(r"sm_(\d+)\+", archs):
            return cls(vendor, min_sm=int(match.group(1)))
        if match := re.fullmatch(r"sm_(\d+)\.\.sm_(\d+)", archs):
            return cls(vendor, min_sm=int(match.group(1)), max_sm=int(match.group(2)))
        return cls(vendor, archs=frozenset(a.strip() for a in archs.split(",")))

    def mismatch(self, platform: Platform) -> str:
        """Why `platform` does not satisfy this spec, or "" if it does."""
        if self.vendor not in ("*", platform.vendor):
            return f"needs {self}, this is {platform.label}"
        if self.archs is not None and platform.arch not in self.archs:
            return f"needs {self}, this is {platform.label}"
        if self.min_sm is not None or self.max_sm is not None:
            sm = arch_number(platform.arch)
            low, high = self.min_sm or 0, self.max_sm or 10**9
            if sm is None or not low <= sm <= high:
                return f"needs {self}, this is {platform.label}"
        missing = self.capabilities - platform.capabilities
        if missing:
            return f"needs {', '.join(sorted(missing))}, which {platform.arch} lacks"
        return ""

    def __str__(self) -> str:
        text = self.vendor
        if self.archs is not None:
            text += ":" + ",".join(sorted(self.archs))
        elif self.min_sm is not None and self.max_sm is not None:
            text += f":sm_{self.min_sm}..sm_{self.max_sm}"
        elif self.min_sm is not None:
            text += f":sm_{self.min_sm}+"
        return text
