"""scripts/bench_tactics.py: the chart option says in one line what it needs when matplotlib
is missing, before any model is built, and the per-kernel breakdown sorts library calls by kind;
scripts/kernel_times.py times every kernel call of an artifact."""

import importlib.util
import json
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
        "layerfuse.onednn.shuffle": "layout",  # a channel shuffle's gather
        "fused_conv2d_add_relu": "conv",
        "max_pool2d": "pool",
    }
    assert {k: bench.kind_of(k) for k in kinds} == kinds


def test_kernel_times_covers_every_kernel_call_of_an_artifact(tmp_path):
    """scripts/kernel_times.py: one minimum per kernel call the artifact makes (as many as the
    manifest counts), each a positive time, the convs among them."""
    import onnx

    from tvm_layerfuse.compile.build import compile_model
    from tvm_layerfuse.testing import zoo

    model = zoo.squeezenet1_1(image=32, seed=5)
    path = tmp_path / "m.onnx"
    onnx.save(model, str(path))
    art = compile_model(path, tmp_path / "art", target="cpu", tactics="tvm", progress=False)
    env = dict(os.environ)
    sys.path.insert(0, str(SCRIPT.parent))
    try:
        import kernel_times  # sets OMP/TVM_NUM_THREADS where unset: for this process, not the next tests
    finally:
        sys.path.remove(str(SCRIPT.parent))
        os.environ.clear()
        os.environ.update(env)
    best = {k: v for k, v in kernel_times.call_minima(str(art), 2).items() if not k[1].startswith("vm.")}
    manifest = json.loads((art / "manifest.json").read_text())
    assert len(best) == manifest["fusion"]["kernels"]["kernels"], (len(best), manifest["fusion"]["kernels"])
    assert all(v > 0 for v in best.values())
    assert sum(kernel_times.kind_of(s) == "conv" for _, s in best) == 26, sorted(best)  # SqueezeNet's 26 convs
