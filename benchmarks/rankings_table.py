"""Every kernel `tokenspeed-kernel tune` measured, side by side per request bucket, with the one
selection picks marked; rewrites benchmarks/results/kernels_<gpu>.md from a rankings file.

    python3 benchmarks/rankings_table.py [RANKINGS_JSON]   # default: the nvidia package's H100 file

The figures are the rankings file's own (its date, device, versions and tune command head the
page): medians of CUDA-graph replays with the L2 flushed, per bucket. "x selected" is each
kernel's time over the selected kernel's; the selected kernel is the fastest measured one, or,
where that declines on a machine (its library not installed), the next.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import record

DEFAULT = (
    record.REPO
    / "packages/tokenspeed-kernel-nvidia/src/tokenspeed_kernel_nvidia/rankings/h100.json"
)


EARLIER = " †"


def tables(data: dict) -> list[str]:
    lines: list[str] = []
    ops = dict.fromkeys(entry["op"] for entry in data["rankings"])
    for op in ops:
        entries = [e for e in data["rankings"] if e["op"] == op]
        kernels = list(dict.fromkeys(name for e in entries for name in e["times_us"]))
        rows = []
        for entry in entries:
            times = entry["times_us"]
            best = min(times, key=times.get)
            cells = [entry["label"]]
            for name in kernels:
                if name not in times:
                    cells.append("-")
                    continue
                mark = " **(selected)**" if name == best else ""
                if entry.get("notes", {}).get(name, "").startswith("measured "):
                    mark = EARLIER + mark
                cells.append(f"{times[name]:.1f} ({times[name] / times[best]:.2f}x){mark}")
            rows.append(cells)
        lines += [f"## {op}", "", "us (x selected)", ""]
        lines += record.table(["bucket", *kernels], rows) + [""]
    if any(EARLIER in line for line in lines):
        lines += [
            f"{EARLIER.strip()} timed in an earlier run on the same GPU kind and kept by `tune "
            "--merge --keep-kernels` (FA3 and FlashInfer do not fit one upload to the GPU "
            "machine, so each library is timed in a run of its own); each such kernel's run "
            "date is in the rankings file's notes.",
            "",
        ]
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("rankings", nargs="?", type=Path, default=DEFAULT)
    record.add_record_argument(parser)
    args = parser.parse_args()
    data = json.loads(args.rankings.read_text())
    created = data["created"]
    device = created["device"]
    versions = ", ".join(f"{k} {v}" for k, v in created["versions"].items() if v)
    lines = [
        f"# Every kernel per GPT-OSS request bucket, {device}",
        "",
        f"- measured: {created['date']} on {created['platform']}",
        f"- versions: {versions}",
        f"- measured with: `{created['command']}`",
        f"- rankings file: `{args.rankings.resolve().relative_to(record.REPO)}`",
        f"- this page: `{record.command_line()}`",
        *([f"- note: {created['note']}"] if created.get("note") else []),
        *(_earlier(run) for run in created.get("merged", [])),
        "",
        __doc__.split("\n\n")[2].replace("\n", " ").strip(),
        "",
    ]
    lines += tables(data)
    record.write("kernels", lines, device=device, record=not args.no_record)


def _earlier(run: dict) -> str:
    """A line for an earlier run whose other ops `tune --merge` kept in the file."""
    note = f"; note: {run['note']}" if run.get("note") else ""
    return f"- an earlier run merged into this file: {run['date']}, `{run['command']}`{note}"


if __name__ == "__main__":
    main()
