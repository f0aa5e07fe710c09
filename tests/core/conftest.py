"""Core tests see only core's own kernels: installed plugins (triton, amd) are switched off so
that selection results do not depend on which backend packages are present."""

import pytest

from tokenspeed_kernel import plugins


@pytest.fixture(autouse=True, scope="module")
def core_kernels_only():
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(plugins.ALLOW_LIST_ENV, "")
        plugins.reload_plugins()
        yield
    plugins.reload_plugins()
