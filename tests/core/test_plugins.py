"""Plugins through real entry points: a temporary *.dist-info on sys.path."""

from __future__ import annotations

import sys
import textwrap
import threading

import pytest
import torch

import tokenspeed_kernel as tk
from tokenspeed_kernel import cli, plugins, registry

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


EXITING_PLUGIN = """
    import sys
    import tokenspeed_kernel as tk

    def register():
        tk.register_kernel("kvcache_store", name="exiting.kvcache_store", backend="exiting",
                           platforms=["*"], traits={}, priority=1)(lambda *a, **k: None)
        sys.exit(3)
"""

BASE_EXCEPTION_PLUGIN = """
    class Abort(BaseException):
        pass

    def register():
        raise Abort("gave up")
"""

REPLACING_PLUGIN = """
    import tokenspeed_kernel as tk

    def register():
        tk.register_kernel("kvcache_store", name="reference.kvcache_store", backend="reference",
                           platforms=["*"], traits={}, priority=1, replace=True)(print)
        raise ImportError("half done")
"""

SLOW_DECODE_PLUGIN = """
    import threading, time
    import tokenspeed_kernel as tk
    from tokenspeed_kernel.ops.attention.reference import reference_decode

    THREADS = []

    def register():
        time.sleep(0.3)  # a wide window for other threads to select from a half-loaded registry
        spec = tk.get_kernel("mha_decode_with_kvcache", "reference.mha_decode_with_kvcache")

        @tk.register_kernel("mha_decode_with_kvcache", name="slow.mha_decode_with_kvcache",
                            backend="slow", platforms=["cpu"], traits=spec.traits, priority=900)
        def decode(*args, **kwargs):
            THREADS.append(threading.get_ident())
            reference_decode(*args, **kwargs)
"""


@pytest.fixture
def install(tmp_path, monkeypatch):
    """install({entry name: source}) makes them the installed (and allowed) plugins."""
    modules = []

    def install_plugins(sources):
        lines = []
        for name, source in sources.items():
            module = f"tk_plugin_{name}"
            (tmp_path / f"{module}.py").write_text(textwrap.dedent(source))
            lines.append(f"{name} = {module}:register")
            modules.append(module)
        info = tmp_path / "tk_more_plugins-0.1.dist-info"
        info.mkdir(exist_ok=True)
        (info / "METADATA").write_text("Metadata-Version: 2.1\nName: tk-more\nVersion: 0.1\n")
        (info / "entry_points.txt").write_text(
            "[tokenspeed_kernel.plugins]\n" + "\n".join(lines) + "\n"
        )
        monkeypatch.syspath_prepend(str(tmp_path))
        monkeypatch.setenv(plugins.ALLOW_LIST_ENV, ",".join(sources))

    yield install_plugins
    monkeypatch.undo()
    for module in modules:
        sys.modules.pop(module, None)
    plugins.reload_plugins()


def test_sys_exit_and_base_exceptions_are_recorded_failures(install):
    install(dict(zz_exit=EXITING_PLUGIN, zz_abort=BASE_EXCEPTION_PLUGIN, zz_good=GOOD_PLUGIN))
    results = _by_name(plugins.reload_plugins())
    assert results["zz_exit"].status == "failed" and results["zz_exit"].error == "SystemExit: 3"
    assert results["zz_abort"].status == "failed" and "Abort: gave up" in results["zz_abort"].error
    assert results["zz_good"].status == "loaded"
    assert "exiting.kvcache_store" not in {s.name for s in tk.kernels("kvcache_store")}
    # The records survive later calls: nothing reloads or erases them.
    assert _by_name(plugins.load_plugins()) == results


def test_failed_plugin_replacement_is_rolled_back(install):
    original = tk.get_kernel("kvcache_store", "reference.kvcache_store")
    install(dict(zz_replacing=REPLACING_PLUGIN))
    results = _by_name(plugins.reload_plugins())
    assert results["zz_replacing"].error == "ImportError: half done"
    assert tk.get_kernel("kvcache_store", "reference.kvcache_store") is original


def test_unloading_a_plugin_restores_what_it_replaced(install):
    original = tk.get_kernel("kvcache_store", "reference.kvcache_store")
    install(dict(zz_replacing=REPLACING_PLUGIN.replace('raise ImportError("half done")', "")))
    results = _by_name(plugins.reload_plugins())
    assert results["zz_replacing"].kernels == ("reference.kvcache_store",)
    assert tk.get_kernel("kvcache_store", "reference.kvcache_store").fn is print
    plugins.unload_plugins()  # a snapshot, since any registry query would load them again
    assert registry.snapshot()["reference.kvcache_store"] is original


def test_unknown_allowed_names_are_warned_and_recorded(install, monkeypatch, caplog):
    install(dict(zz_good=GOOD_PLUGIN))
    monkeypatch.setenv(plugins.ALLOW_LIST_ENV, "zz_good,zz_goood,  tritn")
    with caplog.at_level("WARNING", logger="tokenspeed_kernel.plugins"):
        results = _by_name(plugins.reload_plugins())
    assert results["zz_good"].status == "loaded"
    for typo in ("zz_goood", "tritn"):
        assert results[typo].status == "skipped"
        assert f"names {typo!r}, but no installed plugin has that name" in results[typo].detail
        assert any(typo in record.getMessage() for record in caplog.records)


def test_eight_threads_from_a_cold_start_all_get_the_plugin_kernel(install):
    install(dict(zz_slow=SLOW_DECODE_PLUGIN))
    plugins.unload_plugins()  # cold: the first op call loads the plugins
    cache = torch.randn(4, 8, 2, 16, dtype=torch.bfloat16)
    kwargs = dict(
        page_table=torch.tensor([[0, 1], [2, 3]], dtype=torch.int32),
        cache_seqlens=torch.tensor([11, 16], dtype=torch.int32),
    )
    start, errors = threading.Barrier(8), []

    def worker():
        try:
            start.wait()
            for _ in range(20):
                q = torch.randn(2, 4, 16, dtype=torch.bfloat16)
                tk.mha_decode_with_kvcache(q, cache, cache, **kwargs)
        except BaseException as exc:  # reported below, on the main thread
            errors.append(exc)

    threads = [threading.Thread(target=worker) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    called = sys.modules["tk_plugin_zz_slow"].THREADS
    assert len(called) == 160 and len(set(called)) == 8
