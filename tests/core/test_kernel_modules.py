"""A backend's plugin registers every kernel module of its package: adding a kernel is adding
its module (which ends with `register()`), with no list to edit."""

from __future__ import annotations

import sys
import textwrap

from tokenspeed_kernel import registry
from tokenspeed_kernel.plugins import register_kernel_modules


def test_every_module_with_register_is_registered(tmp_path, monkeypatch):
    package = tmp_path / "demo_backend"
    (package / "attention").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "attention" / "__init__.py").write_text("")
    (package / "registration.py").write_text("raise AssertionError('never imported')\n")
    (package / "_common.py").write_text("HELPER = 1\n")
    (package / "attention" / "store.py").write_text(
        textwrap.dedent(
            """
            from tokenspeed_kernel.registry import ANY, register_kernel

            def store(k, v, k_cache, v_cache, *, slot_mapping, k_scale, v_scale):
                k_cache.view(-1, *k.shape[1:])[slot_mapping] = k

            def register():
                register_kernel(
                    "kvcache_store", name="demo.kvcache_store", backend="demo",
                    platforms=["cpu"], priority=1,
                    traits=dict(dtype=ANY, kv_dtype=ANY, head_dim=ANY, page_size=ANY),
                )(store)
            """
        )
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        register_kernel_modules("demo_backend")
        assert registry.get_kernel("kvcache_store", "demo.kvcache_store").fn.__name__ == "store"
    finally:
        registry.unregister_kernel("demo.kvcache_store")
        for name in [m for m in sys.modules if m.startswith("demo_backend")]:
            del sys.modules[name]
