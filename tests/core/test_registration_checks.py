"""Registrations are checked where they are written, and a kernel's own `supports()` that
misbehaves declines instead of breaking the op."""

from __future__ import annotations

import pytest
import torch

import tokenspeed_kernel as tk
from tokenspeed_kernel import registry, selector
from tokenspeed_kernel.platform import KNOWN_PLATFORMS
from tokenspeed_kernel.presets import get_preset

OP = "mha_decode_with_kvcache"
REQUEST = get_preset("gpt-oss-120b").attention_request(OP)
CPU = KNOWN_PLATFORMS["cpu"]
GOOD = dict(
    backend="t", platforms=["*"], priority=5,
    traits={"dtype": tk.ANY, "kv_dtype": tk.ANY, "head_dim": tk.ANY, "gqa_ratio": tk.ANY,
            "page_size": tk.ANY, "q_len": tk.ANY, "sinks": True, "window": True, "lse": True},
)  # fmt: skip


@pytest.fixture
def scratch():
    before = registry.registered_names()
    yield
    for name in registry.registered_names() - before:
        registry.unregister_kernel(name)


def _register(name="t.decode", op=OP, **over):
    return tk.register_kernel(op, name=name, **(GOOD | over))(lambda *a, **k: None)


BAD_REGISTRATIONS = [
    (dict(priority="high"), TypeError, "priority is 'high', expected an int"),
    (dict(priority=True), TypeError, "priority is True, expected an int"),
    (dict(priority=2.5), TypeError, "priority is 2.5, expected an int"),
    (
        dict(traits={"head_dims": {64}}),
        ValueError,
        r"trait 'head_dims' is not a feature of mha_decode_with_kvcache, expected one of "
        r"dtype, gqa_ratio, head_dim, kv_dtype, lse, non_causal, page_size, q_len, sinks, window",
    ),
    (
        dict(traits={"dtype": "float16"}),
        TypeError,
        r"trait 'dtype' is 'float16', expected True, ANY or a collection of accepted values",
    ),
    (dict(traits={"head_dim": 64}), TypeError, "trait 'head_dim' is 64, expected True, ANY"),
    (dict(traits={"sinks": False}), TypeError, "trait 'sinks' is False, expected True, ANY"),
    (dict(traits={"dtype": b"bf16"}), TypeError, "trait 'dtype' is b'bf16'"),
    (dict(traits=[("dtype", tk.ANY)]), TypeError, "traits is list, expected a mapping"),
    (dict(supports=42), TypeError, "supports is int, expected a callable"),
    (dict(platforms="cpu"), TypeError, "platforms is 'cpu', expected a list of platform specs"),
    (dict(platforms=[]), ValueError, "declares no platforms"),
    (dict(description=7), TypeError, "description is int, expected a str"),
    (dict(aot_cases=[1]), TypeError, "aot_cases holds a non-mapping"),
    (dict(backend=None), TypeError, "backend is None, expected a non-empty str"),
]


@pytest.mark.parametrize("over, exc, match", BAD_REGISTRATIONS)
def test_bad_registrations_fail_where_they_are_written(scratch, over, exc, match):
    with pytest.raises(exc, match=r"register_kernel\('t.decode'\): " + match):
        _register(**over)
    assert "t.decode" not in registry.registered_names()


def test_store_traits_are_the_store_features(scratch):
    with pytest.raises(ValueError, match="trait 'q_len' is not a feature of kvcache_store"):
        _register("t.store", op="kvcache_store", traits={"q_len": tk.ANY})


def test_every_request_feature_is_a_declared_trait_name():
    preset = get_preset("gpt-oss-120b")
    requests = {
        op: preset.attention_request(op, window=True)._replace(lse=True)
        for op in registry.op_names()
    }
    requests["kvcache_store"] = preset.kvcache_store_request()
    requests["moe_apply"] = preset.moe_request(16)
    requests["mha_prefill"] = requests["mha_prefill"]._replace(causal=False, window_left=-1)
    for op, request in requests.items():
        names = {feature for feature, _ in request.features()}
        assert names <= registry._op_traits[op], op


def test_trait_collections_are_frozen_values_not_characters(scratch):
    _register(traits=GOOD["traits"] | {"dtype": [torch.bfloat16], "q_len": range(1, 3)})
    spec = tk.get_kernel(OP, "t.decode")
    assert spec.traits["dtype"] == frozenset({torch.bfloat16})
    assert spec.traits["q_len"] == frozenset({1, 2})


def _raising(request, platform):
    raise RuntimeError("probe exploded")


@pytest.mark.parametrize(
    "supports, reason",
    [
        (_raising, "supports() raised RuntimeError: probe exploded"),
        (lambda r, p: True, "supports() returned bool True, expected a Support"),
        (lambda r, p: None, "supports() returned NoneType None, expected a Support"),
        (lambda r, p: "yes", "supports() returned str 'yes', expected a Support"),
    ],
)
def test_misbehaving_supports_declines_and_others_still_serve(scratch, supports, reason):
    _register("t.decode.broken", priority=100, supports=supports)
    _register("t.decode.fine", priority=50)
    assert selector.select(OP, REQUEST, CPU).name == "t.decode.fine"
    verdicts = {c.name: c for c in tk.explain(OP, REQUEST, CPU).candidates}
    assert not verdicts["t.decode.broken"].accepted
    assert verdicts["t.decode.broken"].reason == reason


def test_a_selection_made_while_the_registry_changed_is_not_cached(scratch):
    _register("t.decode.first", priority=60)
    generation = registry.generation()
    _register("t.decode.second", priority=70)
    assert registry.generation() > generation
    assert selector.select(OP, REQUEST, CPU).name == "t.decode.second"
