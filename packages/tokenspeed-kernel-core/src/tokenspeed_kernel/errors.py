"""Error types raised by the public operators."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Candidate:
    """One registered kernel's verdict on a request."""

    name: str
    priority: int
    accepted: bool
    reason: str

    def __str__(self) -> str:
        verdict = "accepted" if self.accepted else "rejected"
        return f"{self.name} (priority {self.priority}): {verdict}: {self.reason}"


class UnsupportedError(NotImplementedError):
    """A valid request that no registered kernel (or the forced one) can serve."""

    def __init__(self, op: str, summary: str, candidates: Sequence[Candidate]):
        self.op = op
        self.candidates = tuple(candidates)
        lines = [f"{op}: {summary}"]
        lines += [f"  - {c}" for c in self.candidates] or ["  (no kernels registered)"]
        super().__init__("\n".join(lines))
