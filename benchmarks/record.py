"""The benchmark record: each script rewrites benchmarks/results/<op>_<gpu>.md in place, so the
file always holds the last run of the current code, headed by what it takes to reproduce it
(date, device, versions, commit, command). Rejected designs and their figures live in
docs/decisions.md, not here."""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import platform
import re
import shlex
import subprocess
import sys
from collections.abc import Iterable, Sequence
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"


def gpu_kind(device_name: str) -> str:
    """The GPU kind a results file is named by: 'h100' for 'NVIDIA H100 80GB HBM3', 'h200'
    for 'NVIDIA H200', 'mi300x' for 'AMD Instinct MI300X'; the first token that mixes letters
    and digits, else the whole name in lower case with dashes."""
    tokens = re.findall(r"[a-z0-9]+", device_name.lower())
    for token in tokens:
        if re.fullmatch(r"[a-z]+\d+[a-z]*", token):
            return token
    return "-".join(tokens) or "unknown"


def device_name() -> str:
    """The CUDA/ROCm device's name, or 'cpu' where torch sees no GPU."""
    import torch

    return torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"


def gpu_state() -> str | None:
    """The NVIDIA GPU's UUID, power limit and top SM clock (nvidia-smi, found by the PCI bus id
    torch reports), or None elsewhere. Machines of one GPU kind differ: our MoE serving sizes
    ran 4-9% slower on one H200 than on another while the peer's times matched
    (docs/decisions.md), so a results file says which one it ran on."""
    import torch

    if not torch.cuda.is_available() or torch.version.cuda is None:
        return None
    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    bus_id = f"{props.pci_domain_id:08X}:{props.pci_bus_id:02X}:{props.pci_device_id:02X}.0"
    query = "uuid,power.limit,clocks.max.sm"
    command = ["nvidia-smi", "-i", bus_id, f"--query-gpu={query}", "--format=csv,noheader"]
    try:
        run = subprocess.run(command, capture_output=True, text=True, check=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    fields = [field.strip() for field in run.stdout.strip().split(",")]
    if len(fields) != 3:
        return None
    uuid, power, clock = fields
    return f"{uuid}, power limit {power}, max SM clock {clock}"


def command_line(argv: Sequence[str] | None = None) -> str:
    """The command as run from the repository root: `python3 benchmarks/x.py --flag ...`."""
    argv = list(sys.argv if argv is None else argv)
    script = Path(argv[0]).resolve()
    if script.is_relative_to(REPO):
        argv[0] = str(script.relative_to(REPO))
    return shlex.join(["python3", *argv])


def package_version(*names: str) -> str | None:
    """The installed version of the first distribution among `names`, or None."""
    for name in names:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def _commit() -> str | None:
    """The measured tree's commit (`+dirty` with local changes), where git and .git exist."""
    try:
        head = subprocess.run(
            ["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "-C", str(REPO), "status", "--porcelain", "--untracked-files=no"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None
    return head + ("+dirty" if dirty else "")


def header(title: str, device: str, peers: dict[str, str | None] | None = None) -> list[str]:
    """The file's title and the lines that say how its figures were produced."""
    import torch
    import triton

    versions = f"torch {torch.__version__}, triton {triton.__version__}"
    versions += f", python {platform.python_version()}"
    for peer, version in (peers or {}).items():
        versions += f", {peer} {version or 'not installed'}"
    lines = [
        f"# {title}",
        "",
        f"- date: {datetime.date.today().isoformat()}",
        f"- device: {device}",
    ]
    state = gpu_state()
    if state:
        lines.append(f"- gpu: {state}")
    lines.append(f"- versions: {versions}")
    commit = _commit()
    if commit:
        lines.append(f"- commit: {commit}")
    lines += [f"- command: `{command_line()}`", ""]
    return lines


def table(columns: Sequence[str], rows: Iterable[Sequence[object]]) -> list[str]:
    """A markdown table; numbers are written as given (format them before)."""
    lines = ["| " + " | ".join(columns) + " |", "|" + " --- |" * len(columns)]
    lines += ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]
    return lines


def add_record_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--no-record",
        action="store_true",
        help="print the results without rewriting benchmarks/results/<op>_<gpu>.md "
        "(for partial runs and sweeps that should not replace the record)",
    )


SECTION_MARK = "<!-- section: {} -->"


def write(
    op: str,
    lines: Sequence[str],
    *,
    device: str,
    record: bool = True,
    section: str | None = None,
) -> Path | None:
    """Print the results and, with `record`, rewrite benchmarks/results/<op>_<gpu kind>.md.
    With `section` (one model's run, say) the file holds one section per name, each headed by
    its own run's lines: this run replaces its section and keeps the others as they were."""
    text = "\n".join(lines).rstrip() + "\n"
    print(text)
    if not record:
        return None
    path = RESULTS / f"{op}_{gpu_kind(device)}.md"
    path.parent.mkdir(parents=True, exist_ok=True)
    if section is not None:
        sections = _sections(path.read_text()) if path.exists() else {}
        sections[section] = text
        text = "\n".join(
            SECTION_MARK.format(name) + "\n\n" + body for name, body in sections.items()
        )
    path.write_text(text)
    print(f"wrote {path.relative_to(REPO)}")
    return path


def _sections(text: str) -> dict[str, str]:
    """A results file's sections by name, in file order; a file without section marks holds
    none worth keeping (it was written whole)."""
    pattern = re.compile("^" + re.escape(SECTION_MARK).replace(r"\{\}", "(.+?)") + "$", re.M)
    marks = list(pattern.finditer(text))
    sections = {}
    for i, mark in enumerate(marks):
        end = marks[i + 1].start() if i + 1 < len(marks) else len(text)
        sections[mark.group(1)] = text[mark.end() : end].strip("\n") + "\n"
    return sections
