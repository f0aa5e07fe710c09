"""Plugins through real entry points: a temporary *.dist-info on sys.path."""

from __future__ import annotations

import sys
import textwrap

import pytest
import torch

import tokenspeed_kernel as tk
from tokenspeed_kernel import cli, plugins

GOOD_PLUGIN = """
    import tokenspeed_kernel as tk
    from tokenspeed_kernel.ops.attention.reference import reference_prefill

    CALLS = []

    def register():
        @tk.register_kernel(
            "mha_prefill", name="outoftree.mha_prefill", backend="outoftree",
            platforms=["cpu"], priority=500,
            traits={"dtype": {__import__("torch").float16}, "kv_dtype": tk.ANY,
                    "head_dim": tk.ANY, "gqa_ratio": tk.ANY},
        )
        def prefill(q, k, v, **kwargs):
            CALLS.append(q.shape)
            reference_prefill(q, k, v, **kwargs)
"""

BROKEN_PLUGIN = """
    import tokenspeed_kernel as tk

    def register():
        tk.register_kernel("kvcache_store", name="broken.kvcache_store", backend="broken",
                           platforms=["*"], traits={}, priority=1)(lambda *a, **k: None)
        raise RuntimeError("CUDA library libmissing.so not found")
"""


@pytest.fixture
def plugin_dir(tmp_path, monkeypatch):
    (tmp_path / "tk_good_plugin.py").write_text(textwrap.dedent(GOOD_PLUGIN))
    (tmp_path / "tk_broken_plugin.py").write_text(textwrap.dedent(BROKEN_PLUGIN))
    info = tmp_path / "tk_test_plugins-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: tk-test-plugins\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(
        "[tokenspeed_kernel.plugins]\n"
        "zz_good = tk_good_plugin:register\n"
        "zz_broken = tk_broken_plugin:register\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv(plugins.ALLOW_LIST_ENV, "zz_good,zz_broken")
    yield tmp_path
    monkeypatch.undo()
    for module in ("tk_good_plugin", "tk_broken_plugin"):
        sys.modules.pop(module, None)
    plugins.reload_plugins()


def _by_name(results):
    return {r.name: r for r in results}


def test_out_of_tree_plugin_is_loaded_and_selected(plugin_dir):
    results = _by_name(plugins.reload_plugins())
    assert results["zz_good"].status == "loaded"
    assert results["zz_good"].kernels == ("outoftree.mha_prefill",)
    q = torch.randn(5, 4, 16, dtype=torch.float16)
    k = torch.randn(5, 2, 16, dtype=torch.float16)
    cu = torch.tensor([0, 5], dtype=torch.int32)
    out = tk.mha_prefill(q, k, k, cu_seqlens=cu, max_seqlen=5)
    assert sys.modules["tk_good_plugin"].CALLS == [q.shape]
    with tk.use_kernel("mha_prefill", "reference.mha_prefill"):
        expected = tk.mha_prefill(q, k, k, cu_seqlens=cu, max_seqlen=5)
    torch.testing.assert_close(out, expected)


def test_broken_plugin_is_isolated_and_rolled_back(plugin_dir):
    results = _by_name(plugins.reload_plugins())
    broken = results["zz_broken"]
    assert broken.status == "failed"
    assert "RuntimeError: CUDA library libmissing.so not found" in broken.error
    # Its half-done registration is undone; the other plugin still works.
    assert "broken.kvcache_store" not in {s.name for s in tk.kernels("kvcache_store")}
    assert results["zz_good"].status == "loaded"


def test_plugins_command_shows_failure(plugin_dir, capsys):
    plugins.reload_plugins()
    code = cli.main(["plugins"])
    shown = capsys.readouterr().out
    assert "zz_broken" in shown and "FAILED: RuntimeError: CUDA library" in shown
    assert "zz_good" in shown and "loaded, 1 kernels" in shown
    assert code == 1


@pytest.mark.parametrize(
    "allow, good, broken",
    [
        ("", "skipped", "skipped"),
        ("zz_good", "loaded", "skipped"),
        ("zz_good, zz_broken", "loaded", "failed"),
    ],
)
def test_allow_list(plugin_dir, monkeypatch, allow, good, broken):
    monkeypatch.setenv("TOKENSPEED_KERNEL_PLUGINS", allow)
    results = _by_name(plugins.reload_plugins())
    assert (results["zz_good"].status, results["zz_broken"].status) == (good, broken)
    selected = tk.kernels("mha_prefill")[0].name
    assert (selected == "outoftree.mha_prefill") == (good == "loaded")


def test_plugins_load_once():
    first = plugins.load_plugins()
    assert plugins.load_plugins() == first
