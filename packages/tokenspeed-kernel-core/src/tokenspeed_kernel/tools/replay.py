"""`bench --replay FILE`: time exactly the public-op calls recorded with
TOKENSPEED_KERNEL_CAPTURE=FILE, so a user measures the shapes of their real workload.

Each distinct recorded call is rebuilt from its shapes, dtypes, options and recorded values
(sequence offsets and lengths, expert ids) with fresh random data, then the public op is timed
with the same options, under `use_kernel` so that the recorded kernel (or each kernel matching
--kernels) serves it.
"""

from __future__ import annotations

import contextlib
import json
from collections import Counter
from pathlib import Path
from typing import Any

import torch

from ..ops.attention import api as attention_api
from ..ops.moe.api import moe_apply, moe_plan, moe_prepare_weights
from ..registry import op_names, registered_names
from ..selector import use_kernel
from ..testing.cases import Case, attention_case, moe_case, store_case
from ..testing.conformance import case_support, select_kernels
from ..testing.inputs import AttentionShape, MoEShape, StoreShape, moe_weights
from ._common import Progress
from .roofline import Roofline
from .timing import Timer
from .workloads import Point, build_inputs, generator_on, routing_ids, work

_DTYPES = {
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float8_e4m3fn": torch.float8_e4m3fn,
    "float32": torch.float32,
}
_PAGED = ("mha_extend_with_kvcache", "mha_decode_with_kvcache")


def load_capture(path: Path) -> list[tuple[dict[str, Any], int]]:
    """Distinct recorded calls in first-seen order, with how often each occurred."""
    counts: Counter[str] = Counter()
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ValueError(f"--replay: {path}:{number} is not a JSON line ({exc})") from None
        if not isinstance(record, dict) or not {"op", "kernel", "args"} <= set(record):
            raise ValueError(
                f"--replay: {path}:{number} is not a capture record "
                "(expected keys op, kernel, args)"
            )
        counts[json.dumps(record, sort_keys=True)] += 1
    if not counts:
        raise ValueError(f"--replay: {path} holds no recorded calls")
    return [(json.loads(key), n) for key, n in counts.items()]


def _dtype(desc: dict) -> torch.dtype:
    return _DTYPES[desc["dtype"]]


def _lengths(offsets: list[int]) -> tuple[int, ...]:
    return tuple(b - a for a, b in zip(offsets[:-1], offsets[1:], strict=True))


def case_from_record(record: dict, index: int) -> Case:
    """The recorded call's shapes as a conformance-style case (fresh data, same work)."""
    op, a = record["op"], record["args"]
    name = f"replay-{index}-{op}"
    if op == "moe_apply":
        m = a["x"]["shape"][0]
        routing = "logits" if a.get("router_logits") else "precomputed"
        logits_dtype = _dtype(a["router_logits"]) if a.get("router_logits") else torch.float32
        shape = MoEShape(
            m,
            a["num_experts"],
            a["top_k"],
            a["hidden_size"],
            a["intermediate_size"],
            a["weight_format"],
            a["activation_format"],
            a["has_bias"],
            routing=routing,
            logits_dtype=logits_dtype,
        )
        return moe_case(name, shape)
    if op == "kvcache_store":
        num_pages, page, hkv, d = a["k_cache"]["shape"]
        shape = StoreShape(
            a["k"]["shape"][0],
            hkv,
            d,
            page,
            num_pages,
            _dtype(a["k"]),
            _dtype(a["k_cache"]),
            k_scale=_scale(a, "k_scale"),
            v_scale=_scale(a, "v_scale"),
        )
        return store_case(name, shape)
    q = a["q"]["shape"]
    hq, d = q[-2], q[-1]
    common = dict(
        dtype=_dtype(a["q"]),
        window_left=a["window_left"],
        sinks=None if a.get("sinks") is None else 0.0,
        sinks_dtype=_dtype(a["sinks"]) if a.get("sinks") else torch.float32,
        lse=a.get("lse") is not None,
    )
    if op == "mha_prefill":
        offsets = a["cu_seqlens"].get("values") or _even(q[0], a["cu_seqlens"]["shape"][0] - 1)
        shape = AttentionShape(
            _lengths(offsets), hq, a["k"]["shape"][1], d, causal=a["causal"], **common
        )
        return attention_case(name, op, shape)
    _, page, hkv, _ = a["k_cache"]["shape"]
    batch, max_pages = a["page_table"]["shape"]
    seqlens = a["cache_seqlens"].get("values") or [max_pages * page] * batch
    if op == "mha_extend_with_kvcache":
        offsets = a["cu_seqlens_q"].get("values") or _even(q[0], batch)
        q_lens = _lengths(offsets)
    else:
        q_lens = (q[1] if len(q) == 4 else 1,)
    shape = AttentionShape(
        tuple(seqlens),
        hq,
        hkv,
        d,
        kv_dtype=_dtype(a["k_cache"]),
        q_lens=q_lens,
        page_size=page,
        k_scale=_scale(a, "k_scale"),
        v_scale=_scale(a, "v_scale"),
        **common,
    )
    return attention_case(name, op, shape)


def _scale(args: dict, name: str) -> float:
    value = args.get(name)
    return 1.0 if value is None else float(value)


def _even(total: int, parts: int) -> list[int]:
    """Offsets splitting `total` tokens into `parts` near-equal sequences (values too large to
    have been recorded)."""
    parts = max(parts, 1)
    return [total * i // parts for i in range(parts + 1)]


def replay_inputs(record: dict, case: Case, device) -> tuple[tuple, dict]:
    """Fresh inputs of the recorded call's shapes, with the recorded expert ids where the
    capture holds them (they decide which experts' weights the call reads)."""
    inputs = build_inputs(case, device)
    recorded_ids = (record["args"].get("topk_ids") or {}).get("values")
    if case.op == "moe_apply" and recorded_ids is not None:
        inputs[1]["topk_ids"] = torch.tensor(recorded_ids, dtype=torch.int32).to(device)
    return inputs


def replay_points(path: Path) -> list[tuple[Point, dict]]:
    """(point, record) for each distinct recorded call, labelled `#index xcount`."""
    return [
        (Point(case_from_record(record, i), "replay", i, "captured call", f"#{i} x{count}"), record)
        for i, (record, count) in enumerate(load_capture(path))
    ]


def public_call(record: dict, case: Case, inputs, device, weights: dict) -> Any:
    """A zero-argument call of the public op with the recorded options."""
    op, a = record["op"], record["args"]
    args, kwargs = inputs
    if op == "moe_apply":
        key = case.shape.config()
        if key not in weights:
            weights[key] = moe_weights(case.shape, generator_on(device, 1))
        plan = moe_plan(key, device=device, max_num_tokens=max(1, case.shape.num_tokens))
        prepared = moe_prepare_weights(plan, weights[key])
        out = torch.empty_like(args[0])
        return lambda: moe_apply(plan, args[0], prepared, out=out, **kwargs)
    fn = getattr(attention_api, op)
    public = dict(kwargs)
    fp8 = case.shape.cache_dtype == torch.float8_e4m3fn
    if op != "kvcache_store":
        lse = public.pop("lse")
        public.update(return_lse=lse is not None, softmax_scale=a.get("softmax_scale"))
    if op in _PAGED or op == "kvcache_store":
        public.update(
            k_scale=public["k_scale"] if fp8 else None, v_scale=public["v_scale"] if fp8 else None
        )
    return lambda: fn(*args, **public)


def _kernels_for(record: dict, case: Case, device, glob: str | None):
    """(kernel name or None for the selector's choice, note) pairs to time."""
    op = case.op
    if glob is not None:
        return [
            (s.name, "")
            for s in select_kernels(op, kernel=glob)
            if case_support(s, case, device).ok
        ]
    recorded = record["kernel"]
    if recorded in registered_names():
        return [(recorded, "recorded kernel")]
    return [(None, f"recorded kernel {recorded} is not registered here; selector's choice")]


def replay_rows(
    path: Path, device: torch.device, timer: Timer, roof: Roofline, glob: str | None
) -> list[dict]:
    from .bench import row, time_call  # noqa: PLC0415  (bench imports this module lazily)

    calls = load_capture(path)
    progress = Progress(len(calls), "replay")
    rows, weights = [], {}
    for index, (record, count) in enumerate(calls):
        progress.step(record["op"])
        case = case_from_record(record, index)
        point = Point(case, "replay", index, "captured call", f"#{index} x{count}")
        inputs = replay_inputs(record, case, device)
        flops, nbytes = work(case, routing_ids(case, inputs))
        for name, note in _kernels_for(record, case, device, glob):
            scope = use_kernel(case.op, name) if name else contextlib.nullcontext()
            try:
                with scope:
                    call = public_call(record, case, inputs, device, weights)
                    call()
            except Exception as exc:
                rows.append(
                    row(
                        point,
                        name or record["kernel"],
                        status="error",
                        note=f"{type(exc).__name__}: {exc}"[:300],
                    )
                )
                continue
            timed = _scoped(call, scope_for=(case.op, name))
            rows.append(
                time_call(
                    timer,
                    timed,
                    point,
                    name or "selected",
                    flops,
                    nbytes,
                    roof,
                    note=f"{record['op']} x{count}; {note}".rstrip("; "),
                    no_capture=_no_capture(name, device),
                )
            )
    progress.close()
    return rows


def _no_capture(name: str | None, device: torch.device) -> str:
    """Why a kernel must not be captured in a CUDA graph ("" if it may be)."""
    if device.type == "cuda" and name is not None and name.startswith("reference."):
        return "reference synchronizes: not captured"
    return ""


def _scoped(call, scope_for):
    op, name = scope_for
    if name is None or op not in op_names():
        return call

    def forced():
        with use_kernel(op, name):
            call()

    return forced
