"""Compile check of FlashInfer's trtllm-gen attention (`flashinfer.mha_decode_with_kvcache.
trtllm_gen`, registered for sm_100/sm_103) without a Blackwell GPU, or any GPU.

Needs FlashInfer importable, nvcc and ninja, and TOKENSPEED_KERNEL_TRTLLM_GEN_CUBINS naming a
cubin root holding FlashInfer's trtllm-gen FMHA artifact directory (ArtifactPath.TRTLLM_GEN_FMHA:
checksums.txt, include/flashInferMetaInfo.h, the .cubin files). scripts/check_trtllm_gen_build.sh
sets all of that up and runs this file; without it every test skips naming what is missing.

- The JIT module FlashInfer's decode calls (`gen_trtllm_gen_fmha_module()`: the kernel launcher
  and the reduction kernels) compiles with nvcc for sm_100a, reading the cubin table and its
  checksums from that directory with downloads disabled.
- For every request the adapter admits (its declared traits and `supports()`), the cubin table
  holds a decode kernel for sm_100 and sm_103 under every key the runner may look up: the launcher
  and kernel selection of FlashInfer's headers (csrc/trtllm_fmha_kernel_launcher.cu,
  include/flashinfer/trtllm/fmha/fmhaKernels.cuh) are mirrored below, with the enum values read
  from those headers.
- The cubins those entries name are in the directory with the sha256 the table records (what
  the loader checks before cuModuleLoadData).

Not checked: that the kernels run or compute the right thing. That needs a B200.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import itertools
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import NamedTuple

import pytest
import torch

from tokenspeed_kernel.ops.attention.request import AttentionRequest
from tokenspeed_kernel.platform import KNOWN_PLATFORMS
from tokenspeed_kernel.registry import get_kernel, kernels
from tokenspeed_kernel_nvidia._library import FLASHINFER
from tokenspeed_kernel_nvidia.flashinfer import trtllm_gen_decode

CUBINS_ENV = "TOKENSPEED_KERNEL_TRTLLM_GEN_CUBINS"
SCRIPT = "scripts/check_trtllm_gen_build.sh"
OP = "mha_decode_with_kvcache"
# The compile target, and the GPU SMs the adapter registers for (common.h's kSM_* constants).
ARCH_LIST = "10.0a"
GENCODE = "-gencode=arch=compute_100a,code=sm_100a"
GPU_SMS = ("kSM_100", "kSM_103")
BUILD_TIMEOUT_S = 3600
TLLM_DTYPES = {
    torch.float16: "DATA_TYPE_FP16",
    torch.bfloat16: "DATA_TYPE_BF16",
    torch.float8_e4m3fn: "DATA_TYPE_E4M3",
}


def _nvcc() -> str | None:
    """nvcc where FlashInfer's JIT looks for it (jit/cpp_ext.py `get_cuda_path`)."""
    home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    candidates = [Path(home) / "bin" / "nvcc"] if home else []
    found = shutil.which("nvcc")
    candidates += [Path(found)] if found else [Path("/usr/local/cuda/bin/nvcc")]
    return next((str(c) for c in candidates if c.is_file()), None)


def _missing(*, compiler: bool) -> str:
    missing = []
    if importlib.util.find_spec("flashinfer") is None:
        missing.append("flashinfer is not importable")
    root = os.environ.get(CUBINS_ENV)
    if not root:
        missing.append(f"{CUBINS_ENV} is not set")
    elif not Path(root).is_dir():
        missing.append(f"{CUBINS_ENV}={root} is not a directory")
    if compiler and _nvcc() is None:
        missing.append("nvcc is not found")
    if compiler and shutil.which("ninja") is None:
        missing.append("ninja is not on PATH")
    if not missing:
        return ""
    return "; ".join(missing) + f" (bash {SCRIPT} sets these up and runs this file)"


needs_cubins = pytest.mark.skipif(bool(_missing(compiler=False)), reason=_missing(compiler=False))
needs_nvcc = pytest.mark.skipif(bool(_missing(compiler=True)), reason=_missing(compiler=True))


def _flashinfer_env(base: Path) -> dict[str, str]:
    """FlashInfer's environment for the subprocesses: cubins from the check's directory and
    no downloads; logs and JIT output under `base` (FlashInfer reads both at import)."""
    return {
        **os.environ,
        "FLASHINFER_CUBIN_DIR": os.environ[CUBINS_ENV],
        "FLASHINFER_NO_DOWNLOAD": "1",
        "FLASHINFER_WORKSPACE_BASE": str(base),
        "FLASHINFER_CUDA_ARCH_LIST": ARCH_LIST,
    }


def _run_flashinfer(code: str, base: Path, timeout: float) -> dict:
    """Run `code` in a fresh interpreter under `_flashinfer_env`; it prints one JSON line."""
    done = subprocess.run(
        [sys.executable, "-c", code], env=_flashinfer_env(base), capture_output=True,
        text=True, timeout=timeout,
    )  # fmt: skip
    assert done.returncode == 0, f"exit {done.returncode}:\n{done.stdout}\n{done.stderr}"
    return json.loads(done.stdout.strip().splitlines()[-1])


INFO = """
import json, flashinfer
from flashinfer.artifacts import ArtifactPath, CheckSumHash
from flashinfer.jit import env
print(json.dumps({"version": flashinfer.__version__, "artifact": ArtifactPath.TRTLLM_GEN_FMHA,
    "checksums_sha256": CheckSumHash.TRTLLM_GEN_FMHA, "cubin_dir": str(env.FLASHINFER_CUBIN_DIR),
    "include": str(env.FLASHINFER_INCLUDE_DIR)}))
"""

BUILD = """
import json
from flashinfer.jit.attention.modules import gen_trtllm_gen_fmha_module
spec = gen_trtllm_gen_fmha_module()
spec.build(verbose=False)
print(json.dumps({"so": str(spec.jit_library_path), "ninja": str(spec.ninja_path)}))
"""


@pytest.fixture(scope="module")
def info(tmp_path_factory) -> dict:
    """The installed FlashInfer's artifact path, checksum hash and header directory."""
    result = _run_flashinfer(INFO, tmp_path_factory.mktemp("flashinfer_info"), 300)
    # An installed flashinfer-cubin would take precedence over FLASHINFER_CUBIN_DIR.
    assert Path(result["cubin_dir"]) == Path(os.environ[CUBINS_ENV]), result
    result["fmha"] = Path(os.environ[CUBINS_ENV]) / result["artifact"]
    return result


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> dict:
    """The trtllm-gen JIT module built once per session in a scratch FlashInfer workspace."""
    return _run_flashinfer(BUILD, tmp_path_factory.mktemp("flashinfer_jit"), BUILD_TIMEOUT_S)


# --- FlashInfer's headers: enums and the cubin table ---------------------------------------------


def _source(path: Path) -> str:
    """C++ source without comments."""
    return re.sub(r"//[^\n]*|/\*.*?\*/", "", path.read_text(), flags=re.S)


def _enum(text: str, name: str) -> dict[str, int]:
    """Values of C++ `enum [class] name { A = 0, B, ... }` (implicit values counted on)."""
    match = re.search(rf"enum\s+(?:class\s+)?{name}\s*\{{(.*?)\}}", text, re.S)
    assert match, f"enum {name} not found"
    values, value = {}, -1
    for item in filter(None, (part.strip() for part in match.group(1).split(","))):
        label, _, given = item.partition("=")
        value = int(given, 0) if given.strip() else value + 1
        values[label.strip()] = value
    return values


class Enums(NamedTuple):
    data_type: dict[str, int]
    sm: dict[str, int]
    kernel_type: dict[str, int]
    qkv_layout: dict[str, int]
    mask: dict[str, int]
    scheduler: dict[str, int]
    multi_ctas_kv: dict[str, int]
    sparse_mla: dict[str, int]


@functools.cache
def _enums(include: str) -> Enums:
    trtllm = Path(include) / "flashinfer" / "trtllm"
    common = _source(trtllm / "common.h")
    runner = _source(trtllm / "fmha" / "fmhaRunnerParams.h")
    sm = re.findall(r"constexpr\s+int32_t\s+(kSM_\w+)\s*=\s*(\d+)\s*;", common)
    return Enums(
        data_type=_enum(common, "Data_type"),
        sm={label: int(value) for label, value in sm},
        kernel_type=_enum(runner, "FmhaKernelType"),
        qkv_layout=_enum(runner, "QkvLayout"),
        mask=_enum(runner, "TrtllmGenAttentionMaskType"),
        scheduler=_enum(runner, "TileScheduler"),
        multi_ctas_kv=_enum(runner, "MultiCtasKvMode"),
        sparse_mla=_enum(runner, "TrtllmGenSparseMlaType"),
    )


def _value(token: str, symbols: dict[str, int]):
    if token.startswith('"'):
        return token[1:-1]
    if token in ("true", "false"):
        return token == "true"
    if token == "nullptr":
        return None
    if token in symbols:
        return symbols[token]
    return int(token, 0)


@functools.cache
def _meta_rows(header: str, include: str) -> tuple[dict, ...]:
    """sTllmGenFmhaKernelMetaInfos as dicts keyed by the struct's field names (read from the
    header, so a reordered struct is still read right), symbols resolved to their values."""
    text = _source(Path(header))
    body = re.search(r"struct\s+TllmGenFmhaKernelMetaInfo\s*\{(.*?)\};", text, re.S)
    assert body, f"{header}: no TllmGenFmhaKernelMetaInfo"
    fields = re.findall(r"(\w+)\s*;", body.group(1))
    table = re.search(r"sTllmGenFmhaKernelMetaInfos\[\]\s*=\s*\{(.*)\};", text, re.S)
    assert table, f"{header}: no sTllmGenFmhaKernelMetaInfos"
    enums = _enums(include)
    symbols = {**enums.data_type, **enums.sm}
    rows = []
    for entry in re.findall(r"\{([^{}]*)\}", table.group(1)):
        tokens = re.findall(r'"[^"]*"|[^,\s]+', entry)
        assert len(tokens) == len(fields), f"{header}: {len(tokens)} values in {entry[:200]}"
        rows.append({f: _value(t, symbols) for f, t in zip(fields, tokens, strict=True)})
    return tuple(rows)


class KernelKey(NamedTuple):
    """The traits fmhaKernels.cuh `TllmGenFmhaKernel::hashID` keys a kernel by."""

    qkv_layout: int
    mask: int
    kernel_type: int
    scheduler: int
    multi_ctas_kv: int
    head_dim_per_cta_v: int
    head_dim_qk: int
    head_dim_v: int
    tile_q: int
    tile_kv: int
    tokens_per_page: int
    dynamic_tokens_per_page: bool
    reuse_smem_k_for_v: bool
    two_cta_mma: bool
    sparse_mla: int
    skips_softmax: bool

    def hash_id(self) -> int:
        """The same 64-bit packing as hashID: keys that it would merge, merge here too."""
        fields = (
            (self.qkv_layout, 0), (self.mask, 4), (self.kernel_type, 8), (self.scheduler, 12),
            (self.multi_ctas_kv, 16), (self.head_dim_per_cta_v >> 3, 18),
            (self.head_dim_qk >> 3, 26), (self.head_dim_v >> 3, 34), (self.tile_kv >> 6, 42),
            (_log2(self.tokens_per_page), 44), (_log2(self.tile_q), 49),
            (self.reuse_smem_k_for_v, 53), (self.two_cta_mma, 54), (self.sparse_mla, 55),
            (self.skips_softmax, 57), (self.dynamic_tokens_per_page, 58),
        )  # fmt: skip
        return sum(int(value) << shift for value, shift in fields)


def _log2(n: int) -> int:
    """log2 of a power of two, 0 for 0 (hashID's page count: 0 for non-paged kernels)."""
    return n.bit_length() - 1 if n else 0


def _row_key(row: dict) -> KernelKey:
    # isDynamicNumTokensPerPageKernel: page key 128 without "P128" in the name.
    dynamic = row["mNumTokensPerPage"] == 128 and "P128" not in row["mFuncName"]
    return KernelKey(
        row["mQkvLayout"], row["mMaskType"], row["mKernelType"], row["mTileScheduler"],
        row["mMultiCtasKvMode"], row["mHeadDimPerCtaV"], row["mHeadDimQk"], row["mHeadDimV"],
        row["mTileSizeQ"], row["mTileSizeKv"], row["mNumTokensPerPage"], dynamic,
        row["mReuseSmemKForV"], row["m2CtaMma"], row["mSparseAttn"],
        row["mSkipsSoftmaxWhenPossible"],
    )  # fmt: skip


def _kernel_map(rows, enums: Enums, gpu_sm: int, dtypes: tuple[int, int, int, int]) -> dict:
    """What `TllmGenFmhaKernel::loadKernels` keeps for one GPU and (q, k, v, o) dtypes: hash id
    -> row. The family build (sm_100f) serves sm_100 and sm_103; a specific build of the same
    key wins over it, any other duplicate is an error there (FLASHINFER_CHECK) and here."""
    sm = enums.sm
    compatible = {sm["kSM_100"]: (sm["kSM_100f"], sm["kSM_100"]),
                  sm["kSM_103"]: (sm["kSM_100f"], sm["kSM_103"])}[gpu_sm]  # fmt: skip
    found: dict[int, dict] = {}
    for row in rows:
        row_dtypes = (row["mDataTypeQ"], row["mDataTypeK"], row["mDataTypeV"], row["mDataTypeO"])
        sage = any(row[f"mNumEltsPerSageAttnBlk{x}"] for x in "QKPV")
        if row["mSM"] not in compatible or row_dtypes != dtypes or sage:
            continue
        key = _row_key(row).hash_id()
        if key in found:
            pair = {found[key]["mSM"], row["mSM"]}
            assert sm["kSM_100f"] in pair and len(pair) == 2, (
                f"hash conflict: {found[key]['mFuncName']} and {row['mFuncName']}"
            )
            if row["mSM"] != sm["kSM_100f"]:
                found[key] = row
        else:
            found[key] = row
    return found


# --- What the runner looks up for one of our decode requests -------------------------------------


def _runner_keys(request: AttentionRequest, enums: Enums) -> list[tuple[str, KernelKey]]:
    """Every key `TllmGenFmhaKernel::run` may look up for this decode request, as our adapter
    calls it (q_len_per_req=1, no skip-softmax threshold, out in q's dtype), each with a label.

    The launcher asks for a Generation kernel, Causal mask, Static scheduler, multi-CTA KV on
    (GmemReduction). selectGqGenerationKernel picks SwapsMmaAb with tile Q 8/16 (mixed q/kv
    dtypes: 8 up to 8 heads per KV head, else 16; same dtype: by heads x tokens, KeepsMmaAb from
    64). With a window, calls whose longest sequence exceeds it use SlidingOrChunkedCausal, the
    others Causal. computeCtaAndClusterConfig then moves to (Disabled, Persistent) when one CTA
    per sequence suffices, and SwapsMmaAb to CgaSmemReduction at 2..16 CTAs: which one depends
    on batch and lengths, so all are required."""
    assert request.q_len == 1, "the tile-size cost model for q_len > 1 is not mirrored"
    assert request.head_dim <= 256, "KeepsMmaAb's split-V form (head dim > 256) is not mirrored"
    ratio = request.num_q_heads // request.num_kv_heads
    kind = enums.kernel_type
    if request.kv_dtype != request.dtype:
        kernel_type, tile_q = kind["SwapsMmaAbForGeneration"], 8 if ratio <= 8 else 16
    else:
        tile_q = next((t for t in (8, 16, 32, 64) if ratio <= t), 128)
        swaps = tile_q <= 32
        kernel_type = kind["SwapsMmaAbForGeneration" if swaps else "KeepsMmaAbForGeneration"]
    # selectNumTokensPerPage: pages of 128+ with grouped heads use the dynamic-page kernels.
    dynamic = ratio > 1 and request.page_size >= 128
    page = 128 if dynamic else request.page_size
    masks = ["Causal"] + (["SlidingOrChunkedCausal"] if request.window_left >= 0 else [])
    base = KernelKey(
        qkv_layout=enums.qkv_layout["PagedKv"], mask=enums.mask["Causal"], kernel_type=kernel_type,
        scheduler=enums.scheduler["Static"], multi_ctas_kv=enums.multi_ctas_kv["GmemReduction"],
        head_dim_per_cta_v=request.head_dim, head_dim_qk=request.head_dim,
        head_dim_v=request.head_dim, tile_q=tile_q, tile_kv=128, tokens_per_page=page,
        dynamic_tokens_per_page=dynamic, reuse_smem_k_for_v=False, two_cta_mma=False,
        sparse_mla=enums.sparse_mla["None"], skips_softmax=False,
    )  # fmt: skip
    modes = [("GmemReduction", "Static"), ("Disabled", "Persistent")]
    if kernel_type == kind["SwapsMmaAbForGeneration"]:
        modes.append(("CgaSmemReduction", "Static"))
    return [
        (f"{mask}/{multi}/{scheduler}", base._replace(
            mask=enums.mask[mask], multi_ctas_kv=enums.multi_ctas_kv[multi],
            scheduler=enums.scheduler[scheduler]))
        for mask in masks
        for multi, scheduler in modes
    ]  # fmt: skip


def _spec():
    # The entry point registers the nvidia package; from sources alone, register here.
    if not any(s.name == trtllm_gen_decode.KERNEL_NAME for s in kernels(OP)):
        trtllm_gen_decode.register()
    return get_kernel(OP, trtllm_gen_decode.KERNEL_NAME)


def _admitted_requests() -> list[AttentionRequest]:
    """Every request the adapter admits on a B200: the product of its declared trait values,
    kept where `supports()` says yes. The library verdict is taken from the version alone:
    importing FlashInfer here would log under ~/.cache (the subprocesses prove the import)."""
    spec = _spec()
    traits = spec.traits
    axes = itertools.product(
        traits["dtype"], traits["kv_dtype"], traits["head_dim"], traits["gqa_ratio"],
        traits["page_size"], traits["q_len"], (-1, 127) if traits.get("window") else (-1,),
    )  # fmt: skip
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(FLASHINFER, "verdict", FLASHINFER.version_verdict)
        assert FLASHINFER.verdict().ok, FLASHINFER.verdict().reason
        requests = [
            AttentionRequest(
                dtype=dtype, kv_dtype=kv_dtype, head_dim=head_dim, num_q_heads=8 * ratio,
                num_kv_heads=8, page_size=page, q_len=q_len, window_left=window,
                sinks=bool(traits.get("sinks")),
            )
            for dtype, kv_dtype, head_dim, ratio, page, q_len, window in axes
        ]  # fmt: skip
        return [r for r in requests if spec.supports(r, KNOWN_PLATFORMS["b200"]).ok]


@pytest.fixture(scope="module")
def lookups(info) -> dict:
    """Each (request, GPU SM, runner key) -> the table row serving it, or None if none does."""
    header = info["fmha"] / "include" / "flashInferMetaInfo.h"
    rows = _meta_rows(str(header), info["include"])
    enums = _enums(info["include"])
    result = {}
    for request in _admitted_requests():
        out = TLLM_DTYPES[request.dtype]
        dtypes = tuple(
            enums.data_type[name]
            for name in (out, TLLM_DTYPES[request.kv_dtype], TLLM_DTYPES[request.kv_dtype], out)
        )
        for gpu in GPU_SMS:
            found = _kernel_map(rows, enums, enums.sm[gpu], dtypes)
            for label, key in _runner_keys(request, enums):
                result[request, gpu, label] = found.get(key.hash_id())
    return result


# --- The tests -----------------------------------------------------------------------------------


@needs_nvcc
def test_trtllm_gen_module_builds_for_sm100a(info, built):
    so = Path(built["so"])
    assert so.is_file() and so.stat().st_size > 0, f"{so} was not built"
    ninja = Path(built["ninja"]).read_text()
    assert GENCODE in ninja, f"{GENCODE} not among the nvcc flags of {built['ninja']}"
    # The module looks its cubins up under this path, the one checked below.
    assert f'TLLM_GEN_FMHA_CUBIN_PATH=\\"{info["artifact"]}\\"' in ninja
    # Loading the module needs the CUDA driver, so its dynamic strings are read instead: the
    # function FlashInfer's decode calls (tvm-ffi exports it by this name), and the driver it
    # binds cuModuleLoadData and cuLaunchKernelEx from.
    strings = so.read_bytes()
    assert b"__tvm_ffi_trtllm_paged_attention_decode" in strings
    assert b"libcuda.so.1" in strings, f"{so} does not record its dependency on the driver"


@needs_cubins
def test_every_admitted_request_has_a_decode_kernel(lookups):
    # supports() must not have declined a declared value outright: the check covers them all.
    requests = {request for request, _, _ in lookups}
    checked = {
        "dtype": {r.dtype for r in requests},
        "kv_dtype": {r.kv_dtype for r in requests},
        "head_dim": {r.head_dim for r in requests},
        "page_size": {r.page_size for r in requests},
        "gqa_ratio": {r.num_q_heads // r.num_kv_heads for r in requests},
    }
    traits = _spec().traits
    for feature, values in checked.items():
        assert values == set(traits[feature]), f"{feature}: checked {values}, declared {traits}"
    missing = [key for key, row in lookups.items() if row is None]
    shown = "\n".join(f"  {r} on {gpu}: {label}" for r, gpu, label in missing[:40])
    assert not missing, f"{len(missing)} lookups find no trtllm-gen kernel:\n{shown}"


@needs_cubins
def test_table_and_cubins_match_their_checksums(info, lookups):
    fmha = info["fmha"]
    checksums = (fmha / "checksums.txt").read_bytes()
    assert hashlib.sha256(checksums).hexdigest() == info["checksums_sha256"], (
        f"{fmha}/checksums.txt is not the one FlashInfer {info['version']} expects"
    )
    listed = {name: sha for sha, name in (line.split() for line in checksums.decode().splitlines())}
    header = fmha / "include" / "flashInferMetaInfo.h"
    assert hashlib.sha256(header.read_bytes()).hexdigest() == listed["include/flashInferMetaInfo.h"]
    rows = {row["mFuncName"]: row for row in lookups.values() if row is not None}
    wrong = []
    for name, row in sorted(rows.items()):
        cubin = fmha / f"{name}.cubin"
        if not cubin.is_file():
            wrong.append(f"{cubin.name}: missing")
        elif hashlib.sha256(cubin.read_bytes()).hexdigest() != row["sha256"]:
            wrong.append(f"{cubin.name}: sha256 differs from the table's {row['sha256']}")
    assert not wrong, f"{len(wrong)} of {len(rows)} cubins:\n" + "\n".join(wrong[:40])
