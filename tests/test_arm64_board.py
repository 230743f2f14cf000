"""`deploy` to an emulated 64-bit Arm board: qemu-user runs the board's AArch64 Python with a
runtime-only TVM (no compiler library), started from the tree that
``scripts/setup_arm64_board.sh`` prepares. CI runs that script first; elsewhere these tests
are skipped, saying so, until it has been run.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import onnx
import pytest

from tvm_layerfuse import deploy as rpc
from tvm_layerfuse import runtime
from tvm_layerfuse.compile.build import compile_model
from tvm_layerfuse.deploy import board
from tvm_layerfuse.testing import zoo
from tvm_layerfuse.testing.checks import run_onnxruntime

ROOT = Path(__file__).resolve().parents[1]
RTOL = 1e-4  # max |a - b| / max |a| against onnxruntime with optimisations off


def _board_or_skip() -> dict:
    if shutil.which("qemu-aarch64-static") is None:
        pytest.skip("qemu-aarch64-static is missing: run scripts/setup_arm64_board.sh (apt: qemu-user-static)")
    if shutil.which("aarch64-linux-gnu-gcc") is None:
        pytest.skip("aarch64-linux-gnu-gcc is missing: run scripts/setup_arm64_board.sh (apt: gcc-aarch64-linux-gnu)")
    try:
        return board.arm64_board()
    except board.BoardError as e:
        pytest.skip(f"emulated AArch64 board not set up: {e}")


@pytest.fixture(scope="module")
def arm64_server():
    _board_or_skip()
    with board.start_arm64_board(port=0) as server:
        yield server


@pytest.fixture(scope="module")
def squeezenet(tmp_path_factory):
    d = tmp_path_factory.mktemp("arm64")
    model = zoo.squeezenet1_1(image=32)
    onnx.save(model, d / "squeezenet.onnx")
    return model, d


def test_aarch64_artifact_runs_on_the_emulated_board(arm64_server, squeezenet):
    model, d = squeezenet
    art = compile_model(d / "squeezenet.onnx", d / "aarch64", target="aarch64", fuse=True, progress=False)
    x = {"input": np.random.default_rng(11).standard_normal((1, 3, 32, 32)).astype(np.float32)}

    result = rpc.deploy(art, rpc=arm64_server.address, inputs=x, repeat=3, timeout=120)

    (ref,) = run_onnxruntime(model, x)
    got = result.outputs["output"]
    assert float(np.abs(ref - got).max() / np.abs(ref).max()) <= RTOL
    assert result.board.machine == "aarch64"  # what the board said, from its own executable
    assert result.latency.runs == 3 and result.latency.min_ms > 0


def test_x86_artifact_refused_by_the_arm64_board(arm64_server, squeezenet):
    _, d = squeezenet
    # TVM's kernels only: an artifact that needs the oneDNN library is refused before the board is asked
    art = compile_model(d / "squeezenet.onnx", d / "cpu", target="cpu", tactics="tvm", progress=False)
    steps: list[str] = []
    with pytest.raises(rpc.BoardMismatchError) as e:
        rpc.deploy(art, rpc=arm64_server.address, timeout=120, progress=steps.append)
    assert f"compiled for x86_64 (target cpu), but board 127.0.0.1:{arm64_server.port} runs aarch64" in str(e.value)
    assert "--target aarch64" in str(e.value)
    assert not any("upload" in s for s in steps)


# ---------------------------------------------------------------------- VTA on the emulated board
VTA_SHAPE = (1, 3, 16, 16)
# An output that VTA writes (the inception block's concat, stored in place by its producers):
# its int8 values come back dequantized by a power of two, exact in float32, so comparing it
# bit for bit compares the int8 tensor.
VTA_TENSOR = "/inception3a/Concat_output_0"


@pytest.fixture(scope="module")
def vta_models(tmp_path_factory):
    """A reduced GoogLeNet (stem conv, pools and classifier on the host, 6 VTA programs) with a
    second output that VTA stores, compiled for the simulator on this machine (``vta``) and
    with an Ultra96-like preset whose host steps are cross-compiled for aarch64."""
    if shutil.which("aarch64-linux-gnu-gcc") is None:
        pytest.skip("aarch64-linux-gnu-gcc is missing: run scripts/setup_arm64_board.sh (apt: gcc-aarch64-linux-gnu)")
    import json

    from tvm_layerfuse.compile.vta import pipeline

    d = tmp_path_factory.mktemp("vta_arm64")
    model = zoo.googlenet(blocks=1, width=0.25, image=16, seed=1)
    (info,) = [v for v in onnx.shape_inference.infer_shapes(model).graph.value_info if v.name == VTA_TENSOR]
    model.graph.output.append(info)
    onnx.save(model, d / "g.onnx")
    rng = np.random.default_rng(3)
    calibration = [{"input": rng.standard_normal(VTA_SHAPE).astype(np.float32)} for _ in range(2)]
    preset = d / "vta-ultra96.json"
    preset.write_text(json.dumps({
        "name": "vta-ultra96", "device": "vta", "machine": "aarch64", "cross_compiler": "aarch64-linux-gnu-gcc",
        "target": {"kind": "llvm", "mtriple": "aarch64-linux-gnu", "mattr": ["+neon"]},
    }))  # fmt: skip
    for name, target in (("x86", "vta"), ("arm", str(preset))):
        pipeline.compile_vta(d / "g.onnx", d / name, calibration=calibration, target=target)
    x = {"input": rng.standard_normal(VTA_SHAPE).astype(np.float32)}
    np.save(d / "x.npy", x["input"])
    return d, x


@pytest.mark.slow  # ~37 s: qemu starts the board's server (~25 s), two host libraries are compiled
def test_vta_artifact_for_an_aarch64_preset_runs_on_the_emulated_board(vta_models):
    """``board arm64 --vta`` (the VTA server, simulator device, tvm_layerfuse's runtime files on
    the board's PYTHONPATH) runs the aarch64 build through ``deploy --rpc``: outputs and VTA
    counters equal a local run of the x86 build of the same model - the int8 tensor VTA stores
    and the float outputs of the host steps (float64 in host.so) bit for bit."""
    import json
    import os
    import subprocess
    import sys

    d, x = vta_models
    _board_or_skip()
    local = runtime.load(d / "x86")
    expect = local.run(x)
    with board.start_arm64_board(port=0, vta=True) as server:
        env = dict(os.environ, PYTHONPATH=str(ROOT))
        proc = subprocess.run(
            [sys.executable, "-m", "tvm_layerfuse", "deploy", str(d / "arm"), "--rpc", f"127.0.0.1:{server.port}",
             "--input", str(d / "x.npy"), "--output", str(d / "y.npz"), "--json", "--timeout", "300"],
            capture_output=True, text=True, env=env, timeout=600,
        )  # fmt: skip
        site = server._owns_site
    assert proc.returncode == 0, proc.stderr
    assert not site.exists()  # the runtime files lived as long as the server
    result = json.loads(proc.stdout)
    assert result["device"] == "vta" and result["boards"][0]["machine"] == "aarch64"
    assert result["counters"] == local.counters and local.counters["insn_count"] > 0
    with np.load(d / "y.npz") as y:
        got = {k: y[k] for k in y.files}
    assert sorted(got) == sorted(expect)
    for name, value in expect.items():
        np.testing.assert_array_equal(got[name], value, err_msg=name)
    assert np.abs(expect[VTA_TENSOR]).max() > 0  # live: the VTA tensor is not all zeros


def test_vta_on_a_board_set_up_by_an_older_script_says_to_run_it_again(tmp_path):
    """An older board's python3 replaced PYTHONPATH, so the VTA server could not import the
    runtime files: refused before anything starts, saying what to run."""
    import json

    (tmp_path / "board.json").write_text(json.dumps({"version": 1, "machine": "aarch64", "python": shutil.which("true")}))
    with pytest.raises(board.BoardError) as e:
        board.start_arm64_board(port=0, vta=True, cache=tmp_path)
    assert str(e.value) == (
        f"the emulated board in {str(tmp_path)!r} is version 1, --vta needs version 2 (its python3 must keep PYTHONPATH); "
        "run scripts/setup_arm64_board.sh again (seconds, the downloads are cached)"
    )
