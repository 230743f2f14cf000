"""What a deployment returns: outputs, remote latency and the boards that ran it."""

from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Optional, Sequence

import numpy as np


@dataclass(frozen=True)
class BoardInfo:
    """A board (RPC server) that ran the model, as it described itself."""

    address: str  # "host:port" the client connected to
    machine: Optional[str]  # from the ELF header of the server's executable; None if unknown
    hostname: Optional[str] = None
    key: Optional[str] = None  # tracker key it was handed out under


@dataclass(frozen=True)
class RunRecord:
    """One timed run: which board, and the remote latency time_evaluator measured."""

    board: str
    latency_ms: float


@dataclass(frozen=True)
class Latency:
    median_ms: float
    min_ms: float
    max_ms: float
    runs: int


@dataclass
class DeployResult:
    """Outputs (by name, from the first session), remote latency, and who ran it."""

    artifact: Path
    device: str
    outputs: dict[str, np.ndarray]
    latency: Latency
    runs: list[RunRecord]
    boards: list[BoardInfo]
    max_run_difference: float = 0.0  # max |output - first session's output| over all sessions
    wall_s: float = 0.0
    manifest: dict[str, Any] = field(default_factory=dict, repr=False)

    @property
    def board(self) -> BoardInfo:
        return self.boards[0]

    def latency_by_board(self) -> dict[str, Latency]:
        by: dict[str, list[float]] = {}
        for r in self.runs:
            by.setdefault(r.board, []).append(r.latency_ms)
        return {b: stats(v) for b, v in by.items()}

    def to_dict(self) -> dict[str, Any]:
        return {
            "artifact": str(self.artifact),
            "device": self.device,
            "latency": asdict(self.latency),
            "runs": [asdict(r) for r in self.runs],
            "boards": [asdict(b) for b in self.boards],
            "max_run_difference": self.max_run_difference,
            "wall_s": round(self.wall_s, 3),
            "outputs": {n: {"shape": list(v.shape), "dtype": str(v.dtype)} for n, v in self.outputs.items()},
        }

    def summary(self, *, top: int = 5) -> str:
        """A few lines for people: where it ran, how fast, what came out (top-k for classifiers)."""
        target = self.manifest.get("target", {})
        name = (self.manifest.get("model") or {}).get("name") or self.artifact.name
        lines = [
            f"deployed {name} (target {target.get('preset', '?')}) to {len(self.boards)} board(s), device {self.device}: "
            f"{len(self.runs)} timed run(s) in {self.wall_s:.1f} s"
        ]
        by = self.latency_by_board()
        for b in self.boards:
            s = by.get(b.address)
            where = ", ".join(x for x in (b.machine, f"host {b.hostname}" if b.hostname else None) if x)
            if s:
                lines.append(
                    f"  board {b.address} ({where}): {s.runs} run(s), median {s.median_ms:.3f} ms "
                    f"(min {s.min_ms:.3f}, max {s.max_ms:.3f})"
                )
        lat = self.latency
        lines.append(
            f"latency: median {lat.median_ms:.3f} ms, min {lat.min_ms:.3f} ms, max {lat.max_ms:.3f} ms over {lat.runs} run(s)"
        )
        if len(self.runs) > 1 and len({r.board for r in self.runs}) > 1:
            lines.append(f"outputs agree across boards within {self.max_run_difference:.3g} (max abs difference)")
        for n, v in self.outputs.items():
            lines.append(f"output {n!r} {list(v.shape)} {v.dtype}: {_describe_output(v, top=top)}")
        return "\n".join(lines)


def stats(values_ms: Sequence[float]) -> Latency:
    return Latency(
        median_ms=float(statistics.median(values_ms)),
        min_ms=float(min(values_ms)),
        max_ms=float(max(values_ms)),
        runs=len(values_ms),
    )


def _describe_output(v: np.ndarray, *, top: int) -> str:
    """Top-k classes for classifier-shaped outputs ([N, C]), else range and mean."""
    if v.ndim == 2 and v.shape[1] >= 2 and np.issubdtype(v.dtype, np.number) and v.size:
        parts = []
        for i, row in enumerate(v[:4]):
            k = min(top, row.shape[0])
            idx = np.argsort(-row, kind="stable")[:k]
            ranked = ", ".join(f"{int(j)} ({float(row[j]):.4g})" for j in idx)
            parts.append((f"[{i}] " if v.shape[0] > 1 else "") + f"top-{k} {ranked}")
        return "; ".join(parts) + (" ..." if v.shape[0] > 4 else "")
    if v.size and np.issubdtype(v.dtype, np.number):
        return f"min {float(v.min()):.4g}, max {float(v.max()):.4g}, mean {float(v.mean()):.4g}"
    return "(empty)" if not v.size else f"{v.dtype} values"
