"""`deploy` over TVM's own RPC: real rpc_server / rpc_tracker processes on loopback.

Every server here is a real ``python -m tvm.exec.rpc_server`` (runtime-only TVM) in a
process group of its own, stopped in teardown; the failures (nothing listening, a board
that never answers, a server killed or frozen mid-run) are real ones too.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import onnx
import pytest

from graphs import Net
from tvm_layerfuse import deploy as rpc
from tvm_layerfuse import runtime
from tvm_layerfuse.compile.build import compile_model
from tvm_layerfuse.deploy import board
from tvm_layerfuse.errors import ArtifactError, InputError, UsageError
from tvm_layerfuse.testing import zoo
from tvm_layerfuse.testing.checks import run_onnxruntime
from tvm_layerfuse.testing.weights import assert_live

RTOL = 1e-4  # max |a - b| / max |a| against onnxruntime with optimisations off


def rel_err(ref: np.ndarray, got: np.ndarray) -> float:
    return float(np.abs(ref.astype(np.float64) - got).max() / max(np.abs(ref).max(), 1e-30))


# ---------------------------------------------------------------------- fixtures
@pytest.fixture(scope="module")
def squeezenet(tmp_path_factory):
    """(onnx model, its path, fused CPU artifact): a small SqueezeNet 1.1 (32x32 input)."""
    d = tmp_path_factory.mktemp("squeezenet")
    model = zoo.squeezenet1_1(image=32)
    assert_live(model)
    path = d / "squeezenet.onnx"
    onnx.save(model, path)
    art = compile_model(path, d / "cpu", target="cpu", fuse=True, progress=False, tactics="tvm")
    return model, path, art


@pytest.fixture(scope="module")
def image(squeezenet):
    return {"input": np.random.default_rng(7).standard_normal((1, 3, 32, 32)).astype(np.float32)}


@pytest.fixture(scope="module")
def server():
    """One RPC server (runtime-only TVM) shared by the tests that do not harm it."""
    with board.start_server(port=0) as s:
        yield s


@pytest.fixture
def own_server():
    """A server of the test's own, for tests that kill or freeze it."""
    with board.start_server(port=0) as s:
        yield s


@pytest.fixture
def refused():
    """(host, port) of a TCP socket bound but not listening: connections are refused, and the
    port stays ours for the whole test (a port looked up and released could be taken)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        yield s.getsockname()


@pytest.fixture
def cli_main(monkeypatch):
    """``cli.main`` with the ``deploy`` command registered (a no-op once cli.py wires it in)."""
    from tvm_layerfuse.cli import commands as cli

    original = cli.build_parser

    def build_parser():
        parser = original()
        sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        if "deploy" not in sub.choices:
            cli.add_deploy_parser(sub, parents=[cli.verbosity_parent()])
        return parser

    monkeypatch.setattr(cli, "build_parser", build_parser)
    return cli.main


# ---------------------------------------------------------------------- numbers
def test_deploy_matches_local_runtime_and_onnxruntime(squeezenet, image, server):
    model, _, art = squeezenet
    steps: list[str] = []
    result = rpc.deploy(art, rpc=server.address, inputs=image, repeat=3, progress=steps.append)

    local = runtime.load(art).run(image)
    (ref,) = run_onnxruntime(model, image)
    assert list(result.outputs) == ["output"]
    np.testing.assert_allclose(result.outputs["output"], local["output"], rtol=1e-6, atol=0)
    assert rel_err(ref, result.outputs["output"]) <= RTOL

    assert [r.board for r in result.runs] == [f"127.0.0.1:{server.port}"] * 3
    lat = result.latency
    assert lat.runs == 3 and 0 < lat.min_ms <= lat.median_ms <= lat.max_ms
    assert result.board.machine == runtime.this_machine()
    assert any("uploading model.so" in s for s in steps) and any("timing runs 1-3 of 3" in s for s in steps)
    text = result.summary()
    assert "top-5" in text and f"127.0.0.1:{server.port}" in text


def test_tuple_outputs_come_back_by_name(tmp_path, server):
    """Two graph outputs (a horizontally merged concat and a pooled branch) over RPC."""
    n = Net(seed=3)
    x = n.input("x", (1, 4, 8, 8))
    cat = n.concat([n.relu(n.conv(x, 6, k=1)), n.relu(n.conv(x, 6, k=1))])
    pooled = n.maxpool(n.relu(n.bn(n.conv(cat, 5))), k=2, stride=2, pad=0)
    model = n.build([cat, pooled])
    onnx.save(model, tmp_path / "two.onnx")
    art = compile_model(tmp_path / "two.onnx", tmp_path / "art", target="cpu", progress=False, tactics="tvm")
    feeds = {"x": np.random.default_rng(1).standard_normal((1, 4, 8, 8)).astype(np.float32)}

    result = rpc.deploy(art, rpc=server.address, inputs=feeds)
    refs = run_onnxruntime(model, feeds)
    assert list(result.outputs) == [cat, pooled]
    for ref, got in zip(refs, result.outputs.values()):
        assert rel_err(ref, got) <= RTOL


def test_scalar_weights_survive_the_trip(tmp_path, server):
    """MobileNetV2's folded Clip bounds are 0-d weights: they must stay 0-d on the board."""
    model = zoo.mobilenet_v2(image=32)
    onnx.save(model, tmp_path / "mobilenet.onnx")
    art = compile_model(tmp_path / "mobilenet.onnx", tmp_path / "art", target="cpu", progress=False, tactics="tvm")
    with np.load(art / "params.npz") as weights:
        assert any(weights[n].ndim == 0 for n in weights.files)
    x = {"input": np.random.default_rng(5).standard_normal((1, 3, 32, 32)).astype(np.float32)}
    (ref,) = run_onnxruntime(model, x)
    assert rel_err(ref, rpc.deploy(art, rpc=server.address, inputs=x).outputs["output"]) <= RTOL


def test_random_inputs_are_seeded(squeezenet, server):
    model, _, art = squeezenet
    a = rpc.deploy(art, rpc=f"127.0.0.1:{server.port}", seed=3)
    b = rpc.deploy(art, rpc=f"127.0.0.1:{server.port}", seed=3)
    c = rpc.deploy(art, rpc=f"127.0.0.1:{server.port}", seed=4)
    np.testing.assert_array_equal(a.outputs["output"], b.outputs["output"])
    # the seed is used: another seed gives another input, hence (live weights) another output ...
    assert rel_err(a.outputs["output"], c.outputs["output"]) > 0.01
    # ... and it is the documented one: standard normal from default_rng(seed)
    x = {"input": np.random.default_rng(3).standard_normal((1, 3, 32, 32)).astype(np.float32)}
    (ref,) = run_onnxruntime(model, x)
    assert rel_err(ref, a.outputs["output"]) <= RTOL


# ---------------------------------------------------------------------- tracker
def test_tracker_spreads_runs_over_both_boards(squeezenet, image):
    model, _, art = squeezenet
    with board.start_tracker(port=0) as tracker:
        with (
            board.start_server(port=0, tracker=tracker.address, key="edge") as a,
            board.start_server(port=0, tracker=tracker.address, key="edge") as b,
        ):
            result = rpc.deploy(art, tracker=tracker.address, key="edge", inputs=image, repeat=4, timeout=30)
    names = {f"127.0.0.1:{a.port}", f"127.0.0.1:{b.port}"}
    assert len(result.runs) == 4
    assert {r.board for r in result.runs} == names, "both boards behind the key should have run the model"
    assert {bi.address for bi in result.boards} == names
    assert set(result.latency_by_board()) == names
    assert result.max_run_difference == 0.0  # the same library on the same machine: the same bits
    (ref,) = run_onnxruntime(model, image)
    assert rel_err(ref, result.outputs["output"]) <= RTOL


# "Fails fast" is asserted by its kind: with a generous timeout, the error is the refusal
# itself, never a DeployTimeoutError (which only waiting out the timeout could give).
def test_tracker_without_the_key_fails_fast_and_names_the_keys(squeezenet):
    _, _, art = squeezenet
    with board.start_tracker(port=0) as tracker:
        with board.start_server(port=0, tracker=tracker.address, key="rasp4"):
            with pytest.raises(rpc.DeployError, match=r"no board registered under key 'jetson' \(keys there: rasp4\)") as e:
                rpc.deploy(art, tracker=tracker.address, key="jetson", timeout=120)
            assert not isinstance(e.value, rpc.DeployTimeoutError)


def test_tracker_not_running(squeezenet, refused):
    _, _, art = squeezenet
    with pytest.raises(rpc.DeployError, match="cannot connect to the tracker .*connection refused") as e:
        rpc.deploy(art, tracker=refused, key="edge", timeout=120)
    assert not isinstance(e.value, rpc.DeployTimeoutError)


# ---------------------------------------------------------------------- failures, each one line and bounded
def test_server_not_listening_fails_fast(squeezenet, refused):
    _, _, art = squeezenet
    port = refused[1]
    with pytest.raises(rpc.DeployError) as e:
        rpc.deploy(art, rpc=refused, timeout=120)
    assert not isinstance(e.value, rpc.DeployTimeoutError)
    msg = str(e.value)
    assert f"cannot connect to board 127.0.0.1:{port}: connection refused" in msg
    assert "python -m tvm.exec.rpc_server" in msg and "\n" not in msg


def test_board_that_never_answers_times_out(squeezenet):
    """Something accepts the TCP connection but never speaks: the C++ client would wait forever."""
    _, _, art = squeezenet
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(4)
    try:
        t = time.monotonic()
        with pytest.raises(
            rpc.DeployTimeoutError, match=r"board 127\.0\.0\.1:\d+: timed out after 2 s while connecting"
        ):
            rpc.deploy(art, rpc=silent.getsockname(), timeout=2)
        assert time.monotonic() - t >= 2  # not before its time (a bound that holds under any load)
    finally:
        silent.close()


def _when_timing(action, delay: float):
    """A progress callback that runs ``action`` ``delay`` seconds after the timed runs start."""
    fired = []

    def progress(line: str) -> None:
        if "timing runs" in line and not fired:
            fired.append(threading.Timer(delay, action))
            fired[0].start()

    return progress, fired


def test_server_killed_during_the_run(squeezenet, own_server):
    _, _, art = squeezenet
    progress, fired = _when_timing(lambda: own_server.signal(signal.SIGKILL), 0.5)
    with pytest.raises(rpc.DeployError) as e:
        rpc.deploy(art, rpc=own_server.address, repeat=200_000, timeout=120, progress=progress)
    assert fired, "the timed runs never started"
    assert not isinstance(e.value, rpc.DeployTimeoutError)  # a dropped connection is seen at once
    assert f"board 127.0.0.1:{own_server.port} dropped the connection while timing runs" in str(e.value)


def test_frozen_server_times_out_mid_run(squeezenet, own_server):
    """SIGSTOP: the connection stays open and silent, as with a hung board or a dead link."""
    _, _, art = squeezenet
    progress, fired = _when_timing(lambda: own_server.signal(signal.SIGSTOP), 0.3)
    with pytest.raises(rpc.DeployTimeoutError, match=r"timed out after 3 s while timing runs .*raise --timeout"):
        rpc.deploy(art, rpc=own_server.address, repeat=200_000, timeout=3, progress=progress)
    assert fired  # the freeze came during the timed runs, and the timeout after it


def test_board_ends_a_session_longer_than_its_session_timeout(squeezenet, own_server):
    _, _, art = squeezenet
    with pytest.raises(rpc.DeployError, match=r"ended the session after its 1 s session timeout") as e:
        rpc.deploy(art, rpc=own_server.address, repeat=200_000, timeout=120, session_timeout=1)
    assert not isinstance(e.value, rpc.DeployTimeoutError)  # the board's own limit, not ours
    # ... and the board is free again for the next client.
    assert rpc.deploy(art, rpc=own_server.address).latency.runs == 1


# ---------------------------------------------------------------------- refused before anything is uploaded
@pytest.mark.skipif(runtime.this_machine() != "x86_64", reason="an x86_64 board (this machine) refusing aarch64 code")
@pytest.mark.skipif(
    shutil.which("aarch64-linux-gnu-gcc") is None,
    reason="needs aarch64-linux-gnu-gcc (scripts/setup_arm64_board.sh installs it)",
)
def test_aarch64_artifact_refused_by_x86_board_before_upload(squeezenet, own_server, tmp_path):
    _, path, _ = squeezenet
    art = compile_model(path, tmp_path / "arm", target="aarch64", progress=False)
    steps: list[str] = []
    with pytest.raises(rpc.BoardMismatchError) as e:
        rpc.deploy(art, rpc=own_server.address, progress=steps.append)
    msg = str(e.value)
    assert f"compiled for aarch64 (target aarch64), but board 127.0.0.1:{own_server.port} runs x86_64" in msg
    assert "nothing was uploaded" in msg and "--target cpu" in msg
    assert not any("upload" in s for s in steps)
    assert "load_module" not in own_server.log_tail(100)


def test_device_mismatch_refused_before_connecting(squeezenet, refused):
    _, _, art = squeezenet
    with pytest.raises(rpc.BoardMismatchError, match=r"compiled for cpu .* but --device cuda was requested"):
        rpc.deploy(art, rpc=refused, device="cuda")


def test_damaged_artifact_refused_before_connecting(squeezenet, tmp_path, refused):
    _, _, art = squeezenet
    copy = tmp_path / "copy"
    shutil.copytree(art, copy)
    lib = bytearray((copy / "model.so").read_bytes())
    lib[-100] ^= 0xFF
    (copy / "model.so").write_bytes(bytes(lib))
    with pytest.raises(ArtifactError, match="'model.so' in artifact .* has sha256"):
        rpc.deploy(copy, rpc=refused)


def test_bad_inputs_and_options(squeezenet, refused):
    _, _, art = squeezenet
    nowhere = refused
    with pytest.raises(InputError, match=r"input 'input' has shape \[1, 3, 16, 16\]; expected \[1, 3, 32, 32\]"):
        rpc.deploy(art, rpc=nowhere, inputs={"input": np.zeros((1, 3, 16, 16), np.float32)})
    with pytest.raises(InputError, match="has dtype float64; expected float32"):
        rpc.deploy(art, rpc=nowhere, inputs=np.zeros((1, 3, 32, 32)))
    with pytest.raises(UsageError, match="--rpc 'localhost' is malformed; expected HOST:PORT"):
        rpc.deploy(art, rpc="localhost")
    with pytest.raises(UsageError, match="--tracker needs --key"):
        rpc.deploy(art, tracker="127.0.0.1:9190")
    with pytest.raises(UsageError, match="--repeat 0 is not a positive integer"):
        rpc.deploy(art, rpc=nowhere, repeat=0)
    with pytest.raises(UsageError, match="TVM's RPC server cannot wait longer"):
        rpc.deploy(art, rpc=nowhere, session_timeout=1e7)


# ---------------------------------------------------------------------- command line
def test_cli_deploy_writes_outputs_and_prints_top5(squeezenet, image, server, cli_main, tmp_path, capsys):
    model, _, art = squeezenet
    np.save(tmp_path / "x.npy", image["input"])
    out = tmp_path / "y.npz"
    code = cli_main(
        [
            "deploy",
            str(art),
            "--rpc",
            f"127.0.0.1:{server.port}",
            "--input",
            str(tmp_path / "x.npy"),
            "--output",
            str(out),
            "--repeat",
            "2",
        ]
    )
    captured = capsys.readouterr()
    assert code == 0, captured.err
    assert "top-5" in captured.out and "latency: median" in captured.out
    with np.load(out, allow_pickle=False) as y:
        assert list(y.files) == ["output"]
        (ref,) = run_onnxruntime(model, image)
        assert rel_err(ref, y["output"]) <= RTOL
    assert sorted(p.name for p in tmp_path.iterdir()) == ["x.npy", "y.npz"]


def test_cli_failure_is_one_line_and_writes_nothing(squeezenet, own_server, cli_main, tmp_path, capsys):
    _, _, art = squeezenet
    out = tmp_path / "y.npz"
    stop = threading.Event()

    def kill_once_loaded() -> None:  # the event: the server logs load_module (the runs follow)
        while not stop.wait(0.05):
            if "load_module" in own_server.log_tail(50):
                own_server.signal(signal.SIGKILL)
                return

    killer = threading.Thread(target=kill_once_loaded)
    killer.start()
    try:
        argv = ["deploy", str(art), "--rpc", f"127.0.0.1:{own_server.port}", "--output", str(out)]
        code = cli_main(argv + ["--repeat", "200000", "--timeout", "20"])
    finally:
        stop.set()
        killer.join()
    err = capsys.readouterr().err.strip()
    assert code == 1
    assert err.startswith("error: board 127.0.0.1:") and "\n" not in err
    assert list(tmp_path.iterdir()) == []  # neither y.npz nor a temporary file

    with pytest.raises(SystemExit):  # argparse: --rpc and --tracker exclude each other
        cli_main(["deploy", str(art), "--rpc", "127.0.0.1:9091", "--tracker", "127.0.0.1:9190"])
    with pytest.raises(SystemExit) as e:
        cli_main(["deploy", str(art), "--rpc", "127.0.0.1:9091", "--repeat", "0"])
    assert e.value.code == 2 and "argument --repeat: 0 is not positive" in capsys.readouterr().err
    code = cli_main(["deploy", str(art), "--tracker", "127.0.0.1:9190"])
    assert code == 2
    assert capsys.readouterr().err.strip().startswith("error: --tracker needs --key KEY: the key the boards registered")


# ---------------------------------------------------------------------- the board script
def test_board_script_serves_until_interrupted(squeezenet):
    _, _, art = squeezenet
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parent.parent))
    proc = subprocess.Popen(
        [sys.executable, "-m", "tvm_layerfuse.board", "server", "--port", "0"],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        env=env,
        start_new_session=True,
    )
    try:
        line = proc.stdout.readline()  # printed once the server listens (bounded by its ready_timeout)
        m = re.search(r"RPC server \(\w+\) ready on 127\.0\.0\.1:(\d+)", line)
        assert m, line
        port = int(m.group(1))
        assert rpc.deploy(art, rpc=("127.0.0.1", port), timeout=20).board.address == f"127.0.0.1:{port}"
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=20) == 0
        with pytest.raises(OSError):  # the server went with it
            socket.create_connection(("127.0.0.1", port), timeout=2).close()
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)  # the script stops its server (a process group of its own)
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


def test_board_script_stops_its_server_on_sigterm():
    """``kill`` (or a service manager) stops the board script as Ctrl-C does: exit 0, its
    server's process group gone with it, not orphaned."""
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parent.parent))
    proc = subprocess.Popen(
        [sys.executable, "-m", "tvm_layerfuse.board", "server", "--port", "0"],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env, start_new_session=True,
    )  # fmt: skip
    try:
        line = proc.stdout.readline()
        m = re.search(r"RPC server \(\w+\) ready on 127\.0\.0\.1:(\d+)", line)
        assert m, line
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=20) == 0
        with pytest.raises(OSError):
            socket.create_connection(("127.0.0.1", int(m.group(1))), timeout=2).close()
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
