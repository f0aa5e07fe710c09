"""Registration of the AMD attention kernels and their traits, on faked gfx942 (MI300X) and
gfx950 (MI355X) platforms: the selector picks them for GPT-OSS requests there, declines them
elsewhere with a reason, and the traits refuse what the kernels cannot do."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tokenspeed_kernel.platform import KNOWN_PLATFORMS
from tokenspeed_kernel.plugins import load_plugins
from tokenspeed_kernel.presets import get_preset
from tokenspeed_kernel.registry import get_kernel
from tokenspeed_kernel.selector import explain, select
from tokenspeed_kernel.tuning import pin_config
from tokenspeed_kernel_amd.attention import decode, extend, prefill
from tokenspeed_kernel_amd.attention._common import CODE_GFX942, CODE_GFX950
from tokenspeed_kernel_amd.attention._launch import RaggedConfig, ragged_config, ragged_launch

OPS = ("mha_prefill", "mha_extend_with_kvcache", "mha_decode_with_kvcache")
AMD = ("mi300x", "mi355x")
FP8 = torch.float8_e4m3fn
GPT_OSS = get_preset("gpt-oss-120b")


def _request(op, *, window=False, q_len=1, kv_dtype=None, **changes):
    request = GPT_OSS.attention_request(op, window=window, q_len=q_len, kv_dtype=kv_dtype)
    return request._replace(**changes)


@pytest.fixture(scope="module", autouse=True)
def plugins_loaded():
    results = {r.name: r for r in load_plugins()}
    if "amd" not in results:
        pytest.skip("the amd entry point is not installed (run from the uv workspace)")
    assert results["amd"].status == "loaded", results["amd"]


@pytest.mark.parametrize("op", OPS)
def test_registered_for_cdna_only_at_priority_200(op):
    spec = get_kernel(op, f"amd.{op}")
    assert spec.backend == "amd" and spec.priority == 200
    assert [str(p) for p in spec.platforms] == ["amd:gfx942,gfx950"]
    assert spec.fn is {"mha_prefill": prefill.mha_prefill,
                       "mha_extend_with_kvcache": extend.mha_extend_with_kvcache,
                       "mha_decode_with_kvcache": decode.mha_decode_with_kvcache}[op]  # fmt: skip


@pytest.mark.parametrize("platform", AMD)
@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("window", (False, True), ids=("full", "sliding"))
def test_selected_for_gpt_oss_on_cdna(platform, op, window):
    assert select(op, _request(op, window=window), KNOWN_PLATFORMS[platform]).name == f"amd.{op}"


@pytest.mark.parametrize("platform", AMD)
@pytest.mark.parametrize("op", ("mha_extend_with_kvcache", "mha_decode_with_kvcache"))
def test_fp8_kv_cache_selected_on_cdna(platform, op):
    request = _request(op, kv_dtype=FP8, q_len=2)
    assert select(op, request, KNOWN_PLATFORMS[platform]).name == f"amd.{op}"


@pytest.mark.parametrize("platform", ("h100", "b200", "cpu"))
@pytest.mark.parametrize("op", OPS)
def test_declined_off_cdna_with_the_platform_reason(platform, op):
    verdict = get_kernel(op, f"amd.{op}").supports(_request(op), KNOWN_PLATFORMS[platform])
    assert not verdict.ok and "amd:gfx942,gfx950" in verdict.reason
    assert select(op, _request(op), KNOWN_PLATFORMS[platform]).name != f"amd.{op}"


@pytest.mark.parametrize(
    "op,changes,reason",
    [
        ("mha_prefill", dict(head_dim=96), "head_dim 96"),
        ("mha_prefill", dict(kv_dtype=FP8), "kv_dtype"),
        ("mha_prefill", dict(dtype=torch.float32, kv_dtype=torch.float32), "dtype"),
        ("mha_extend_with_kvcache", dict(head_dim=256), "head_dim 256"),
        ("mha_decode_with_kvcache", dict(q_len=decode.MAX_Q_LEN + 1), "q_len"),
    ],
)
def test_traits_decline_what_the_kernels_cannot_do(op, changes, reason):
    for platform in AMD:
        verdict = explain(op, _request(op, **changes), KNOWN_PLATFORMS[platform])
        (mine,) = [c for c in verdict.candidates if c.name == f"amd.{op}"]
        assert not mine.accepted and reason in mine.reason


@pytest.mark.parametrize("op", OPS)
def test_traits_accept_the_contract_variety(op):
    """GQA 1 and 8, head dims 64 and 128, fp16, page sizes 1 and 128, sinks/lse/no window."""
    mi355x = KNOWN_PLATFORMS["mi355x"]
    for changes in (dict(num_kv_heads=64), dict(head_dim=128), dict(dtype=torch.float16,
                    kv_dtype=torch.float16), dict(sinks=False, lse=True)):  # fmt: skip
        assert select(op, _request(op, **changes), mi355x).name == f"amd.{op}", changes
    if op != "mha_prefill":
        for page in (1, 16, 128):
            assert select(op, _request(op, page_size=page), mi355x).name == f"amd.{op}"


def test_configs_differ_by_arch_for_hardware_reasons():
    for configs in (ragged_config, decode.decode_config):
        gfx942, gfx950 = configs(CODE_GFX942, 64), configs(CODE_GFX950, 64)
        assert dataclasses.is_dataclass(gfx942) and gfx942 != gfx950
        with pytest.raises(dataclasses.FrozenInstanceError):
            gfx942.block_n = 1  # type: ignore[misc]


def test_pinned_config_replaces_the_heuristic():
    """`tuning.pin_config(KERNEL_NAME, ...)` is the one way to force a config (tests,
    benchmarks); the launch options follow it, and the heuristic comes back after the block."""
    q = torch.empty(8, 64, 64, dtype=torch.bfloat16)
    k = torch.empty(8, 8, 64, dtype=torch.bfloat16)
    kwargs = dict(max_seqlen=8, window_left=-1, arch="gfx942", direct_to_lds=None, num_seqs=1)
    pinned = RaggedConfig(64, 32, 2, 16, 4)
    with pin_config(prefill.KERNEL_NAME, pinned):
        _, options = ragged_launch(prefill.KERNEL_NAME, q, k, k, q, None, None, **kwargs)
    assert (options["BLOCK_M"], options["BLOCK_N"], options["H_PACK"]) == (64, 32, 4)
    _, options = ragged_launch(prefill.KERNEL_NAME, q, k, k, q, None, None, **kwargs)
    assert options["BLOCK_M"] == ragged_config(CODE_GFX942, 64).block_m


def test_every_kernel_module_registers_itself():
    from tokenspeed_kernel.plugins import load_plugins

    [amd] = [r for r in load_plugins() if r.name == "amd"]
    assert set(amd.kernels) == {f"amd.{op}" for op in OPS} | {"amd.moe_apply"}
