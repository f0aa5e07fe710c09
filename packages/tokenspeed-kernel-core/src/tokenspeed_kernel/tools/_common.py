"""Shared pieces of the tools: run metadata, a progress bar, plain-text tables, op names."""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform as _pyplatform
import sys
import time
from collections.abc import Sequence
from importlib import metadata
from pathlib import Path
from typing import Any

import torch

from ..platform import Platform, default_device, platform_of
from ..presets import PRESETS


def resolve_device(name: str | None) -> torch.device:
    device = default_device() if name is None else torch.device(name)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"cpu ({_pyplatform.processor() or _pyplatform.machine()}, {os.cpu_count()} cores)"


def platform_words(platform: Platform) -> str:
    """The platform as a report line says it: "cpu, 2 cores" rather than "cpu CPU, 2 cores"."""
    if platform.vendor == "cpu":
        return f"cpu, {platform.sm_count} cores"
    return str(platform)


def versions() -> dict[str, str | None]:
    from .. import __version__  # noqa: PLC0415  (the package imports tools lazily)

    found: dict[str, str | None] = {
        "tokenspeed_kernel": __version__,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "hip": torch.version.hip,
        "python": sys.version.split()[0],
    }
    # Read installed versions from metadata: core never imports a kernel backend itself.
    for dist in ("triton", "tokenspeed-kernel-triton", "tokenspeed-kernel-amd"):
        try:
            found[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            found[dist] = None
    return found


def run_metadata(device: torch.device) -> dict[str, Any]:
    return {
        # argv[1:] are the CLI arguments under the entry point and `python -m` alike.
        "command": " ".join(["tokenspeed-kernel", *sys.argv[1:]]),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": device_name(device),
        "platform": str(platform_of(device)),
        "versions": versions(),
    }


def write_json(path: str | os.PathLike, payload: dict[str, Any]) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=2, default=str) + "\n", encoding="utf-8")
    return path


class Progress:
    """A one-line progress bar on stderr, redrawn at most every 0.1 s. Silent when stderr is
    not a terminal (logs and CI keep clean output) and for a single step."""

    def __init__(self, total: int, label: str, *, stream=None, width: int = 24):
        self.total, self.label, self.width = max(total, 1), label, width
        self.stream = sys.stderr if stream is None else stream
        self.done = 0
        self.enabled = self.total > 1 and getattr(self.stream, "isatty", lambda: False)()
        self._last = 0.0
        self._start = time.perf_counter()

    def step(self, what: str = "") -> None:
        self.done += 1
        now = time.perf_counter()
        if self.enabled and (now - self._last > 0.1 or self.done == self.total):
            self._last = now
            filled = self.width * self.done // self.total
            bar = "#" * filled + "." * (self.width - filled)
            self.stream.write(
                f"\r{self.label} [{bar}] {self.done}/{self.total} "
                f"{now - self._start:5.1f}s {what[:50]:<50}"
            )
            self.stream.flush()

    def close(self) -> None:
        if self.enabled and self.done:
            self.stream.write("\n")
            self.stream.flush()


def format_table(
    headers: Sequence[str], rows: Sequence[Sequence[object]], align: str | None = None
) -> str:
    """Columns padded to their widest cell; `align` per column: "l" or "r" (default "l")."""
    cells = [[str(c) for c in headers]] + [[str(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    align = align or "l" * len(headers)
    lines = []
    for n, row in enumerate(cells):
        parts = [
            c.rjust(w) if a == "r" else c.ljust(w)
            for c, w, a in zip(row, widths, align, strict=True)
        ]
        lines.append("  ".join(parts).rstrip())
        if n == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)


def fmt(value: float | None, spec: str = ".3g") -> str:
    return "-" if value is None else format(value, spec)


def tool_parser(sub, name: str, doc: str | None, *, summary: str, preset: str):
    """A tool's subcommand with the options every tool has: --preset (`preset` says what its
    shapes are for) and --device."""
    p = sub.add_parser(
        name, help=summary, description=doc, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--preset", dest="tool_preset", choices=sorted(PRESETS), help=preset)
    p.add_argument("--device", help="torch device (default: the current GPU, else cpu)")
    return p


def add_out_option(p, default: str, what: str) -> None:
    p.add_argument(
        "--out", default=default, metavar="DIR", help=f"where {what} (default: ./{default})"
    )
