"""Kernel developer tools behind the CLI: check, bench, profile, aot, tune."""

from __future__ import annotations


def add_tool_commands(subparsers) -> None:
    """Register the tool subcommands on the CLI's subparsers."""
    from . import aot, bench, check, profile, tune  # noqa: PLC0415  (only when the CLI builds it)

    check.add_parser(subparsers)
    bench.add_parser(subparsers)
    profile.add_parser(subparsers)
    aot.add_parser(subparsers)
    tune.add_parser(subparsers)
