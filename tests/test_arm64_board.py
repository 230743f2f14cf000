"""`deploy` to an emulated 64-bit Arm board: qemu-user runs the board's AArch64 Python with a
runtime-only TVM (no compiler library), started from the tree that
``scripts/setup_arm64_board.sh`` prepares. CI runs that script first; elsewhere these tests
are skipped, saying so, until it has been run.
"""

from __future__ import annotations

import shutil

import numpy as np
import onnx
import pytest

from tvm_layerfuse import deploy as rpc
from tvm_layerfuse.compile.build import compile_model
from tvm_layerfuse.deploy import board
from tvm_layerfuse.testing import zoo
from tvm_layerfuse.testing.checks import run_onnxruntime

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
