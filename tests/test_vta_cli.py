"""The vta target through the real command line, runtime.load and TVM's RPC.

``compile --target vta`` with a calibration file, ``run`` on the simulator, ``inspect
--compile --target vta``, and ``deploy --rpc`` to a real RPC server subprocess with the
VTA runtime registered (``python -m tvm_layerfuse.runtime.vta.rpc_server``, what a board runs),
directly and through a real ``tvm.exec.rpc_tracker``, plus a plain ``tvm.exec.rpc_server``
that has none; a board preset that cross-compiles the host steps for aarch64. The outputs
are compared bit for bit with the numpy int8 reference of the same quantized graph.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest

from tvm_layerfuse import runtime
from tvm_layerfuse.compile.vta import pipeline
from tvm_layerfuse.deploy import board
from tvm_layerfuse.errors import ArtifactError
from tvm_layerfuse.testing import zoo

ROOT = Path(__file__).resolve().parents[1]
SHAPE = (1, 3, 16, 16)


def cli(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.run([sys.executable, "-m", "tvm_layerfuse", *args], capture_output=True, text=True, env=env, timeout=timeout)


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    """A small GoogLeNet compiled by ``compile --target vta`` with 2 of 3 calibration samples."""
    tmp = tmp_path_factory.mktemp("vta_cli")
    model = tmp / "g.onnx"
    onnx.save(zoo.googlenet(blocks=1, width=0.25, image=16, seed=1), model)
    rng = np.random.default_rng(3)
    np.savez(tmp / "cal.npz", input=rng.standard_normal((3, *SHAPE)).astype(np.float32))
    x = {k: rng.standard_normal(SHAPE).astype(np.float32) for k in ("a", "b")}
    for k, v in x.items():
        np.save(tmp / f"{k}.npy", v)
    art = tmp / "g.vta"
    proc = cli("compile", str(model), "--target", "vta", "-o", str(art), "--calibration", str(tmp / "cal.npz"),
               "--calibration-count", "2")  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    return {"tmp": tmp, "model": model, "art": art, "x": x, "compile": proc}


def _reference(model: Path, cal: Path, feeds: dict) -> np.ndarray:
    p = pipeline.make_plan(model)
    samples = pipeline.read_calibration(cal, {n: p.first.tensor(n).shape for n in p.first.inputs}, count=2)
    b = pipeline.build(p, calibration=samples)
    return b.reference(feeds)[b.graph.outputs[0]]


def test_compile_run_and_load_match_the_int8_reference(compiled):
    art, tmp, x = compiled["art"], compiled["tmp"], compiled["x"]
    out = compiled["compile"].stdout
    assert "layer placement:" in out and "calibrated on 2 input(s)" in out
    manifest = json.loads((art / "manifest.json").read_text())
    assert manifest["target"]["device"] == "vta" and manifest["library"] == "vta.json"
    assert sorted(manifest["files"]) == ["dram.bin", "host.npz", "host.so", "programs.npz", "vta.json"]
    assert [p.name for p in art.parent.iterdir() if p.name.startswith(".g.vta")] == []

    proc = cli("run", str(art), "--input", str(tmp / "a.npy"), "--output", str(tmp / "ya.npz"))
    assert proc.returncode == 0, proc.stderr
    assert "VTA counters: inp_load_nbytes" in proc.stdout
    with np.load(tmp / "ya.npz") as y:
        ya = y["output"]
    rt = runtime.load(art)  # one runtime.load for every target: the simulator here
    local_a, local_b = rt.run({"input": x["a"]})["output"], rt.run(x["b"])["output"]
    assert rt.counters["insn_count"] > 0
    ref_a = _reference(compiled["model"], tmp / "cal.npz", {"input": x["a"]})
    np.testing.assert_array_equal(ya, local_a)
    np.testing.assert_array_equal(local_a, ref_a.astype(np.float32))
    assert np.abs(local_a - local_b).max() > 0.05 * np.abs(local_a).max()  # live weights: inputs matter


def test_runtime_load_refuses_a_cpu_device_for_a_vta_artifact(compiled):
    with pytest.raises(ArtifactError, match="compiled for vta, but device 'cpu' was requested"):
        runtime.load(compiled["art"], device="cpu")


def test_inspect_compile_vta_reports_placement_and_bytes(compiled):
    proc = cli("inspect", str(compiled["model"]), "--plan-only", "--compile", "--target", "vta", "--calibration-count", "1")
    assert proc.returncode == 0, proc.stderr
    lines = [line.split() for line in proc.stdout.splitlines()]
    rows = {w[0]: w[1:] for w in lines if w and w[0] in ("dram_nbytes", "insn_count")}
    unfused, fused = int(rows["dram_nbytes"][0]), int(rows["dram_nbytes"][1])
    assert fused < unfused and int(rows["insn_count"][1]) < int(rows["insn_count"][0])
    assert "  vta   conv" in proc.stdout and "  host  MaxPool" in proc.stdout


def test_deploy_rpc_runs_on_the_boards_vta_runtime(compiled):
    art, tmp = compiled["art"], compiled["tmp"]
    with board.start_server(port=0, module="tvm_layerfuse.runtime.vta.rpc_server") as server:
        proc = cli("deploy", str(art), "--rpc", f"127.0.0.1:{server.port}", "--input", str(tmp / "b.npy"),
                   "--output", str(tmp / "yb.npz"), "--repeat", "2", "--json")  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout)
    assert result["device"] == "vta" and result["latency"]["runs"] == 2
    rt = runtime.load(art)
    local = rt.run(compiled["x"]["b"])["output"]
    assert result["counters"] == rt.counters
    with np.load(tmp / "yb.npz") as y:
        np.testing.assert_array_equal(y["output"], local)


def test_deploy_to_a_server_without_the_vta_runtime_is_one_line(compiled):
    with board.start_server(port=0) as server:
        proc = cli("deploy", str(compiled["art"]), "--rpc", f"127.0.0.1:{server.port}", "--timeout", "30")
    assert proc.returncode != 0
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "has no VTA runtime" in lines[0] and "tvm_layerfuse.runtime.vta.rpc_server" in lines[0], proc.stderr


def test_bundle_runs_a_vta_artifact_without_the_repository(compiled, tmp_path):
    """A bundle of a vta artifact carries the VTA runtime (simulator included) and its
    rpc_server.sh starts the VTA board server."""
    from tvm_layerfuse.deploy.bundle import make_bundle

    bundle = make_bundle(compiled["art"], tmp_path / "bundle")
    assert "tvm_layerfuse.runtime.vta.rpc_server" in (bundle / "rpc_server.sh").read_text()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "TVM"))}
    proc = subprocess.run(
        [sys.executable, "-I", str(bundle / "run.py"), "--input", str(compiled["tmp"] / "a.npy"), "--output", str(tmp_path / "y.npz")],
        capture_output=True, text=True, env=env, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert "VTA counters:" in proc.stdout
    with np.load(tmp_path / "y.npz") as y:
        np.testing.assert_array_equal(y["output"], runtime.load(compiled["art"]).run(compiled["x"]["a"])["output"])


def test_deploy_through_a_tracker_to_the_vta_rpc_server(compiled):
    """``deploy --tracker H:P --key K``: the tracker hands out the VTA board server registered
    under K (real tracker and server subprocesses); each run is a session of its own."""
    art, tmp = compiled["art"], compiled["tmp"]
    with board.start_tracker(port=0) as tracker:
        with board.start_server(port=0, tracker=tracker.address, key="vta-sim", module="tvm_layerfuse.runtime.vta.rpc_server") as server:
            proc = cli("deploy", str(art), "--tracker", "{}:{}".format(*tracker.address), "--key", "vta-sim", "--input",
                       str(tmp / "a.npy"), "--output", str(tmp / "yt.npz"), "--repeat", "2", "--timeout", "60", "--json")  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout)
    assert result["device"] == "vta" and result["latency"]["runs"] == 2
    assert {r["board"] for r in result["runs"]} == {f"127.0.0.1:{server.port}"}
    rt = runtime.load(art)
    local = rt.run(compiled["x"]["a"])["output"]
    assert result["counters"] == rt.counters
    with np.load(tmp / "yt.npz") as y:
        np.testing.assert_array_equal(y["output"], local)


@pytest.mark.skipif(shutil.which("aarch64-linux-gnu-gcc") is None, reason="needs gcc-aarch64-linux-gnu")
def test_a_board_preset_cross_compiles_the_host_steps(compiled, tmp_path):
    """A VTA preset for an aarch64 board (its CPU target and cross compiler) gives an aarch64
    host.so; this x86 machine refuses to load it, and deploy refuses its x86 board before
    uploading anything - each in one line."""
    from tvm_layerfuse.deploy.inputs import elf_machine

    preset = tmp_path / "vta-ultra96.json"
    preset.write_text(json.dumps({
        "name": "vta-ultra96", "description": "VTA on an Ultra96 (Cortex-A53 host)", "device": "vta", "machine": "aarch64",
        "target": {"kind": "llvm", "mtriple": "aarch64-linux-gnu", "mattr": ["+neon"]}, "cross_compiler": "aarch64-linux-gnu-gcc",
    }))  # fmt: skip
    art = tmp_path / "g.ultra96"
    proc = cli("compile", str(compiled["model"]), "--target", str(preset), "-o", str(art), "--calibration-count", "1", "--quiet")
    assert proc.returncode == 0, proc.stderr
    assert elf_machine((art / "host.so").read_bytes()[:20]) == "aarch64"
    manifest = json.loads((art / "manifest.json").read_text())
    assert manifest["target"]["machine"] == "aarch64" and manifest["target"]["preset"] == "vta-ultra96"
    proc = cli("run", str(art))
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode != 0 and len(lines) == 1, proc.stderr
    assert "holds host steps compiled for aarch64, but this machine is x86_64" in lines[0]
    with board.start_server(port=0, module="tvm_layerfuse.runtime.vta.rpc_server") as server:
        proc = cli("deploy", str(art), "--rpc", f"127.0.0.1:{server.port}", "--timeout", "30")
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode != 0 and len(lines) == 1, proc.stderr
    assert "compiled for aarch64" in lines[0] and "runs x86_64; nothing was uploaded" in lines[0] and "VTA target preset" in lines[0]
