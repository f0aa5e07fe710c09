"""Fixtures the CuTe DSL kernels' tests share."""

from __future__ import annotations

import pytest

from tokenspeed_kernel_nvidia import _cute_runtime as rt


@pytest.fixture
def no_dsl(monkeypatch, tmp_path):
    """A machine without the DSL: no cubin directory and an empty disk cache."""
    monkeypatch.setattr(rt, "dsl_version", lambda: None)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.delenv(rt.CUBIN_DIR_ENV, raising=False)
