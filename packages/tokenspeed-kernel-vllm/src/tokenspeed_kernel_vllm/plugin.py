"""Entry point of the `vllm.general_plugins` group."""

from __future__ import annotations


def register() -> None:
    pass
