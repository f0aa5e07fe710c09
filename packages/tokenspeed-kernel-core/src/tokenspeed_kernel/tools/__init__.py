"""Kernel developer tools behind the CLI: check, bench, profile."""

from __future__ import annotations


def add_tool_commands(subparsers) -> None:
    """Register the tool subcommands on the CLI's subparsers."""
