"""scripts/bench_tactics.py: the chart option says in one line what it needs when matplotlib
is missing, before any model is built, and the per-kernel breakdown sorts library calls by kind."""

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "bench_tactics.py"


@pytest.mark.skipif(importlib.util.find_spec("matplotlib") is not None, reason="matplotlib is installed here")
def test_png_without_matplotlib_is_one_line(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "squeezenet1_1", "--png", str(tmp_path / "c.png")],
        env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode != 0 and not (tmp_path / "c.png").exists()
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "matplotlib" in lines[0] and ".[bench]" in lines[0], proc.stderr


def test_breakdown_kinds():
    spec = importlib.util.spec_from_file_location("bench_tactics", SCRIPT)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    kinds = {
        "layerfuse.onednn.conv2d": "conv",
        "layerfuse.onednn.conv2d_pre": "conv",
        "layerfuse.onednn.pool2d": "pool",
        "layerfuse.onednn.concat": "concat",
        "layerfuse.onednn.concat_convs": "conv",  # convs writing into the block, no copy
        "layerfuse.onednn.to_blocked": "layout",
        "fused_conv2d_add_relu": "conv",
        "max_pool2d": "pool",
    }
    assert {k: bench.kind_of(k) for k in kinds} == kinds
