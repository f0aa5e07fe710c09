"""Measured rankings: which kernel `tokenspeed-kernel tune` found fastest for a request bucket.

A rankings file (JSON) holds one platform's measurements:

    {"format": "tokenspeed-kernel-rankings", "version": 1,
     "platform": {"vendor": "nvidia", "arch": "sm_90", "name": "NVIDIA H100 80GB HBM3"},
     "created": {...how it was measured: command, date, versions, timing...},
     "rankings": [
       {"op": "mha_decode_with_kvcache",
        "key": "dtype=bfloat16;kv_dtype=bfloat16;head_dim=64;...;lse=false",
        "sizes": {"tokens": 64},
        "label": "B=64 ctx=8192",
        "times_us": {"triton.mha_decode_with_kvcache": 12.3, ...},
        "spread_us": {"triton.mha_decode_with_kvcache": [12.1, 12.6]}}]}

The bucket of a request is its `key` (`request_key`: every request field but the size fields,
exactly) plus its `sizes` (`SIZE_FIELDS`, already powers of two in the request). A request
uses the entry with its key whose sizes are nearest on the log2 scale (ties: the larger); a
request without sizes (0, built by hand) and a MoE request (`max_num_tokens`: one plan serves
every batch up to it) rank kernels by the geometric mean of their times over the entries with
its key (for MoE, those with tokens <= max_num_tokens). Among the kernels that support the
request, the measured fastest wins; kernels the entry did not measure come after the measured
ones, in priority order.

Platforms match by vendor and arch; a file measured on a GPU of the same name wins over one of
the same arch. Sources, first wins: the files in TOKENSPEED_KERNEL_RANKINGS (paths separated
by `os.pathsep`, read on first use, `reload()` re-reads it), then those vendor packages add at
registration (`registry.add_rankings`), in that order. Everything here runs when the selector
misses its cache, never on the cached path.
"""

from __future__ import annotations

import json
import logging
import math
import os
import threading
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from .platform import Platform

logger = logging.getLogger(__name__)

RANKINGS_ENV = "TOKENSPEED_KERNEL_RANKINGS"
FORMAT = "tokenspeed-kernel-rankings"
VERSION = 1
# Request fields that are sizes (powers of two): the coordinates a nearest bucket is found on.
SIZE_FIELDS = ("tokens", "seqlen")
# A request field that bounds the sizes one selection serves: rank over every bucket up to it.
LIMIT_FIELD = "max_num_tokens"


@dataclass(frozen=True)
class Source:
    """One validated rankings file (or dict)."""

    origin: str  # the path, or what registered the dict
    platform: Mapping[str, str]
    entries: tuple[Mapping[str, Any], ...]
    created: Mapping[str, Any]


@dataclass(frozen=True)
class Measured:
    """A ranking that applies to one request: `order` is (kernel, µs) fastest first, over the
    kernels that support the request and were measured."""

    order: tuple[tuple[str, float], ...]
    platform_name: str
    bucket: str
    origin: str

    def __str__(self) -> str:
        (best, t), rest = self.order[0], self.order[1:]
        versus = ", ".join(f"{name} {time:.1f} us" for name, time in rest[:3])
        figures = f"{best} {t:.1f} us" + (f" vs {versus}" if versus else " (only one measured)")
        return (
            f"measured fastest on {self.platform_name} for {self.bucket}: {figures} ({self.origin})"
        )


_lock = threading.RLock()
_registered: list[Source] = []
_env_sources: list[Source] | None = None  # None: TOKENSPEED_KERNEL_RANKINGS not read yet
_warned: set[tuple[str, str]] = set()


def load(source: str | os.PathLike | Mapping[str, Any], *, origin: str | None = None) -> Source:
    """Read and validate a rankings file (a path) or its parsed contents (a mapping)."""
    if isinstance(source, Mapping):
        where = origin or "rankings dict"
        return _validate(where, source)
    if not isinstance(source, (str, os.PathLike)):
        raise TypeError(
            f"rankings: source is {type(source).__name__}, expected a path or a mapping"
        )
    path = Path(source)
    where = origin or str(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ValueError(f"rankings file {where}: cannot read it: {exc}") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"rankings file {where}: not valid JSON: {exc}") from None
    return _validate(where, data)


def _validate(where: str, data: Any) -> Source:
    from .registry import op_names  # noqa: PLC0415  (registry imports this module lazily)

    def bad(what: str) -> ValueError:
        return ValueError(f"rankings file {where}: {what}")

    if not isinstance(data, Mapping):
        raise bad(f"top level is {type(data).__name__}, expected a JSON object")
    if data.get("format") != FORMAT or data.get("version") != VERSION:
        raise bad(
            f"format {data.get('format')!r} version {data.get('version')!r}, expected "
            f"{FORMAT!r} version {VERSION}"
        )
    platform = data.get("platform")
    if not isinstance(platform, Mapping) or not all(
        isinstance(platform.get(k), str) and platform.get(k) for k in ("vendor", "arch")
    ):
        raise bad(f"platform is {platform!r}, expected {{'vendor': ..., 'arch': ..., 'name': ...}}")
    entries = data.get("rankings")
    if not isinstance(entries, list):
        raise bad(f"rankings is {type(entries).__name__}, expected a list of entries")
    for n, entry in enumerate(entries):
        _check_entry(bad, n, entry, op_names())
    created = data.get("created", {})
    return Source(
        where, dict(platform), tuple(entries), created if isinstance(created, Mapping) else {}
    )


def _check_entry(bad, n: int, entry: Any, ops: tuple[str, ...]) -> None:
    if not isinstance(entry, Mapping):
        raise bad(f"rankings[{n}] is {type(entry).__name__}, expected an object")
    op = entry.get("op")
    if op not in ops:
        raise bad(f"rankings[{n}]: unknown op {op!r}, expected one of {', '.join(ops)}")
    if not isinstance(entry.get("key"), str):
        raise bad(f"rankings[{n}]: key is {entry.get('key')!r}, expected a str")
    sizes = entry.get("sizes", {})
    if not isinstance(sizes, Mapping) or not all(
        name in SIZE_FIELDS and type(v) is int and v >= 0 for name, v in sizes.items()
    ):
        raise bad(
            f"rankings[{n}]: sizes is {sizes!r}, expected ints >= 0 named by "
            f"{', '.join(SIZE_FIELDS)}"
        )
    times = entry.get("times_us")
    if not isinstance(times, Mapping) or not times:
        raise bad(f"rankings[{n}]: times_us is {times!r}, expected {{kernel: microseconds}}")
    for name, value in times.items():
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        if not ok or not math.isfinite(value) or value <= 0:
            raise bad(f"rankings[{n}]: times_us[{name!r}] is {value!r}, expected a positive number")


def add(source: str | os.PathLike | Mapping[str, Any], *, origin: str | None = None) -> Source:
    """Validate and add a source after those already added (`registry.add_rankings`)."""
    loaded = load(source, origin=origin)
    with _lock:
        _registered.append(loaded)
    return loaded


def remove(source: Source) -> None:
    """Drop a source `add` returned (tests, a plugin rolled back)."""
    from .registry import rankings_changed  # noqa: PLC0415

    with _lock:
        _registered[:] = [s for s in _registered if s is not source]
    rankings_changed()


def reload() -> None:
    """Re-read TOKENSPEED_KERNEL_RANKINGS on the next selection (dropping cached selections)."""
    global _env_sources
    from .registry import rankings_changed  # noqa: PLC0415

    with _lock:
        _env_sources = None
        _warned.clear()
    rankings_changed()


def sources() -> list[Source]:
    """Every source, first wins: the environment's files, then the registered ones."""
    global _env_sources
    with _lock:
        if _env_sources is None:
            raw = os.environ.get(RANKINGS_ENV, "")
            paths = [p for p in raw.split(os.pathsep) if p.strip()]
            _env_sources = [load(p.strip(), origin=f"{p.strip()} ({RANKINGS_ENV})") for p in paths]
        return [*_env_sources, *_registered]


def _fmt(value: Any) -> str:
    if isinstance(value, torch.dtype):
        return str(value).removeprefix("torch.")
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def request_key(request: Any) -> str:
    """Every field of the request but its sizes, as `name=value;...` (dtype names, true/false)."""
    return ";".join(
        f"{name}={_fmt(getattr(request, name))}"
        for name in request._fields
        if name not in SIZE_FIELDS and name != LIMIT_FIELD
    )


def request_sizes(request: Any) -> dict[str, int]:
    return {name: getattr(request, name) for name in SIZE_FIELDS if name in request._fields}


def describe_sizes(sizes: Mapping[str, int]) -> str:
    """`tokens <= 64, seqlen <= 16` (in SIZE_FIELDS order, whatever the mapping's)."""
    shown = [f"{name} <= {sizes[name]}" for name in SIZE_FIELDS if sizes.get(name)]
    return ", ".join(shown) or "any size"


def lookup(op: str, request: Any, platform: Platform, names: Iterable[str]) -> Measured | None:
    """The measured order of the kernels in `names` (those that support `request`), or None
    when no source covers the request on this platform."""
    if not hasattr(request, "_fields"):  # requests are NamedTuples; a test's own type is not
        return None
    key = request_key(request)
    known = set(names)
    for source, entries in _matching(op, key, platform):
        measured = _rank(source, entries, request, known)
        if measured is not None:
            return measured
    return None


def _matching(op: str, key: str, platform: Platform):
    """(source, its entries for op/key) in the order they apply: same GPU name first."""
    candidates = []
    for rank, source in enumerate(sources()):
        p = source.platform
        if p["vendor"] != platform.vendor or p["arch"] != platform.arch:
            continue
        entries = [e for e in source.entries if e["op"] == op and e["key"] == key]
        if entries:
            same_name = bool(platform.name) and p.get("name") == platform.name
            candidates.append((not same_name, rank, source, entries))
    candidates.sort(key=lambda c: (c[0], c[1]))
    return [(source, entries) for _, _, source, entries in candidates]


def _rank(source: Source, entries, request, known: set[str]) -> Measured | None:
    sizes = request_sizes(request)
    limit = getattr(request, LIMIT_FIELD, None)
    if limit is not None or not any(sizes.values()):
        if limit is not None:
            cap = 1 << (limit - 1).bit_length() if limit > 0 else 0
            within = [e for e in entries if e.get("sizes", {}).get("tokens", 0) <= cap]
            entries = within or entries
            bucket = f"{LIMIT_FIELD} {limit}"
        else:
            bucket = "any size"
        times = _geomean_times(entries, source, known)
        bucket += (
            f" (geometric mean over {len(entries)} measured sizes)" if len(entries) > 1 else ""
        )
    else:
        entry = min(entries, key=lambda e: _distance(sizes, e.get("sizes", {})))
        times = _times(entry, source, known)
        bucket = describe_sizes({k: v for k, v in entry.get("sizes", {}).items() if v})
        if bucket != describe_sizes(sizes):
            bucket += f" (nearest measured to {describe_sizes(sizes)})"
    if not times:
        return None
    order = tuple(sorted(times.items(), key=lambda item: (item[1], item[0])))
    name = source.platform.get("name") or f"{source.platform['vendor']} {source.platform['arch']}"
    return Measured(order, name, bucket, source.origin)


def _distance(want: Mapping[str, int], have: Mapping[str, int]) -> tuple[float, float]:
    """log2 distance over the size fields; ties go to the larger measured sizes."""
    total, larger = 0.0, 0.0
    for name in SIZE_FIELDS:
        a, b = want.get(name, 0), have.get(name, 0)
        if a and b:
            total += abs(math.log2(a) - math.log2(b))
        elif a or b:
            total += 64.0  # measured with a size the request lacks, or the other way round
        larger -= b
    return total, larger


def _times(entry, source: Source, known: set[str]) -> dict[str, float]:
    times = {}
    for name, value in entry["times_us"].items():
        if name in known:
            times[name] = float(value)
        else:
            _warn_unknown(source, name)
    return times


def _geomean_times(entries, source: Source, known: set[str]) -> dict[str, float]:
    """Geometric mean per kernel over the entries, for kernels measured in every one of them
    (ranking by it is ranking by the geometric mean of each kernel's ratio to the best)."""
    per_entry = [_times(e, source, known) for e in entries]
    common = set.intersection(*(set(t) for t in per_entry)) if per_entry else set()
    return {
        name: math.exp(sum(math.log(t[name]) for t in per_entry) / len(per_entry))
        for name in common
    }


def _warn_unknown(source: Source, name: str) -> None:
    """A kernel that is not registered here (its package not installed, or the request not
    supported by it): unknown names are logged once per source."""
    from .registry import registered_names  # noqa: PLC0415

    if name in registered_names() or (source.origin, name) in _warned:
        return
    _warned.add((source.origin, name))
    logger.warning(
        "rankings %s: kernel %s is not registered here; ignoring it", source.origin, name
    )
