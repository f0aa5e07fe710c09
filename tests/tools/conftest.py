"""Scripts under benchmarks/ import their siblings (`import record`) as the GPU machine runs
them, from that directory: tests import them the same way."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


@pytest.fixture(scope="session")
def import_benchmark():
    """name -> benchmarks/<name>.py as a module, with benchmarks/ on sys.path while it imports."""

    def load(name: str):
        sys.path.insert(0, str(BENCHMARKS))
        try:
            return importlib.import_module(name)
        finally:
            sys.path.remove(str(BENCHMARKS))

    return load
