"""A oneDNN artifact wherever it goes: oneDNN found in the Python environment (PyPI), the
artifact run through a real RPC server, a board that cannot load the tactic library refused
in one line, and a bundle that runs where no oneDNN is installed."""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest

from graphs import RTOL, rel_err
from tvm_layerfuse.compile import compile_model
from tvm_layerfuse.compile.tactics import onednn
from tvm_layerfuse.deploy import board
from tvm_layerfuse.errors import DeployError
from tvm_layerfuse.runtime import load
from tvm_layerfuse.runtime.tactics import system_library
from tvm_layerfuse.testing import random_inputs, run_onnxruntime, zoo

MISSING = onednn.availability()
needs_onednn = pytest.mark.skipif(MISSING is not None, reason=f"oneDNN is not installed here: {MISSING}")


@pytest.fixture(scope="module")
def onednn_artifact(tmp_path_factory):
    """(model, artifact) of a small SqueezeNet whose layers run on oneDNN."""
    d = tmp_path_factory.mktemp("onednn")
    model = zoo.squeezenet1_1(image=32, seed=11)
    onnx.save(model, str(d / "m.onnx"))
    art = compile_model(d / "m.onnx", d / "art", target="cpu", progress=False, tactics="onednn")
    return model, art


@pytest.fixture(scope="module")
def bundle(onednn_artifact, tmp_path_factory):
    from tvm_layerfuse.deploy.bundle import make_bundle

    return make_bundle(onednn_artifact[1], tmp_path_factory.mktemp("bundle") / "b")


def _no_onednn_env(tmp_path: Path) -> tuple[str, dict[str, str]]:
    """A Python whose prefix has no oneDNN (the base interpreter, not this environment's) and an
    environment with no oneDNN on any library path; numpy is reachable, nothing else."""
    base = getattr(sys, "_base_executable", sys.executable)
    numpy_only = tmp_path / "numpy_only"
    numpy_only.mkdir()
    site = Path(np.__file__).resolve().parents[1]
    for name in ("numpy", "numpy.libs"):
        if (site / name).exists():
            (numpy_only / name).symlink_to(site / name)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "TVM", "LD_LIBRARY_PATH", "VIRTUAL_ENV"))}
    env["PYTHONPATH"] = str(numpy_only)
    return base, env


def test_the_pip_route_is_the_default():
    """On Linux x86_64 the package depends on PyPI's oneDNN 2.6, and compile finds it in this
    Python environment without root or LD_LIBRARY_PATH."""
    text = (Path(__file__).resolve().parents[1] / "pyproject.toml").read_text()
    assert '"onednn-cpu-gomp==2022.2.1; sys_platform' in text and '"onednn-devel-cpu-gomp==2022.2.1; sys_platform' in text
    if MISSING is not None or os.environ.get(onednn.ROOT_VARIABLE):
        pytest.skip("oneDNN comes from elsewhere here")
    found = onednn.find()
    assert found.version[0] == 2 and found.source in ("python environment", "system")


def test_an_explicit_root_is_the_only_place_looked_at(tmp_path, monkeypatch):
    monkeypatch.setenv(onednn.ROOT_VARIABLE, str(tmp_path / "nothing"))
    reason = onednn.availability()
    assert reason is not None and "\n" not in reason and onednn.ROOT_VARIABLE in reason and str(tmp_path / "nothing") in reason


@needs_onednn
def test_manifest_records_the_onednn_it_was_built_against(onednn_artifact):
    _, art = onednn_artifact
    m = json.loads((art / "manifest.json").read_text())
    (entry,) = m["tactics"]["libraries"]
    built = entry["built_against"]
    found = onednn.installation()
    assert built == {"version": ".".join(map(str, found.version)), "source": found.source, "library": str(found.library)}
    assert entry["install"] == onednn.INSTALL and "pip install onednn-cpu-gomp==2022.2.1" in onednn.INSTALL
    # the tactic library carries no absolute run path: only $ORIGIN
    dynamic = subprocess.run(["readelf", "-d", str(art / onednn.LIBRARY_FILE)], capture_output=True, text=True).stdout
    paths = [line for line in dynamic.splitlines() if "RUNPATH" in line or "RPATH" in line]
    assert paths and all("[$ORIGIN]" in line for line in paths), paths


@needs_onednn
def test_deploy_of_a_onednn_artifact_equals_the_local_run(onednn_artifact):
    """A plain ``tvm.exec.rpc_server`` that loads this environment's libdnnl.so.2 (as
    ``python -m tvm_layerfuse.board server`` has it do): the tactic library is uploaded and
    loaded before the model, and the outputs equal the local run's."""
    from tvm_layerfuse import rpc
    from tvm_layerfuse.cli.board import environment_vendor_libraries

    model, art = onednn_artifact
    feeds = random_inputs(model, 4)
    local = load(art).run(feeds)["output"]
    (expected,) = run_onnxruntime(model, feeds)
    preload = environment_vendor_libraries()
    if not preload:
        pytest.skip("oneDNN is not pip-installed in this environment")
    with board.start_server(port=0, load_library=":".join(preload)) as server:
        steps: list[str] = []
        result = rpc.deploy(art, rpc=("127.0.0.1", server.port), inputs=feeds, repeat=2, progress=steps.append)
    assert any("loading the tactic library" in s for s in steps), steps
    assert rel_err(local, result.outputs["output"]) <= 1e-6 and rel_err(expected, result.outputs["output"]) <= RTOL


@needs_onednn
def test_a_board_that_cannot_load_the_tactic_library_is_refused_in_one_line(onednn_artifact, tmp_path):
    """A plain server that has no libdnnl.so.2 on its loader path and loaded none: refused
    before the model is uploaded; the same board with --upload-onednn runs it."""
    if system_library(onednn.SONAME) is not None:
        pytest.skip("libdnnl.so.2 is on this machine's system loader path: every server here can load it")
    from tvm_layerfuse import rpc

    model, art = onednn_artifact
    feeds = random_inputs(model, 5)
    env = {k: v for k, v in os.environ.items() if k != "LD_LIBRARY_PATH"}
    with board.start_server(port=0, env=env) as server:
        steps: list[str] = []
        with pytest.raises(DeployError) as e:
            rpc.deploy(art, rpc=("127.0.0.1", server.port), inputs=feeds, progress=steps.append)
        msg = str(e.value)
        assert "\n" not in msg and onednn.SONAME in msg and "nothing was run" in msg and onednn.INSTALL in msg, msg
        assert not any("uploading model.so" in s for s in steps), steps
        result = rpc.deploy(art, rpc=("127.0.0.1", server.port), inputs=feeds, upload_onednn=True)
    assert rel_err(load(art).run(feeds)["output"], result.outputs["output"]) <= 1e-6


@needs_onednn
def test_bundle_of_a_onednn_artifact_runs_where_no_onednn_is_installed(onednn_artifact, bundle, tmp_path):
    model, art = onednn_artifact
    assert (bundle / "artifact" / onednn.SONAME).is_file() and (bundle / "artifact" / onednn.LIBRARY_FILE).is_file()
    python, env = _no_onednn_env(tmp_path)
    feeds = random_inputs(model, 6)
    np.save(tmp_path / "x.npy", feeds["input"])
    proc = subprocess.run(
        [python, str(bundle / "run.py"), "--input", str(tmp_path / "x.npy"), "--output", str(tmp_path / "y.npz")],
        capture_output=True, text=True, env=env, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    with np.load(tmp_path / "y.npz") as y:
        got = y["output"]
    assert rel_err(load(art).run(feeds)["output"], got) <= 1e-6
    # and the library it ran with was the bundle's own copy
    probe = (
        "import os, sys; os.environ['TVM_USE_RUNTIME_LIB'] = '1'; sys.path.insert(0, sys.argv[1])\n"
        "from tvm_layerfuse.runtime import load\n"
        "load(sys.argv[2])\n"
        "print([l.split()[-1] for l in open('/proc/self/maps') if 'libdnnl' in l][0])\n"
    )
    where = subprocess.run(
        [python, "-c", probe, str(bundle / "site"), str(bundle / "artifact")], capture_output=True, text=True, env=env, timeout=300
    )
    assert where.returncode == 0, where.stderr[-2000:]
    assert where.stdout.strip().startswith(str(bundle / "artifact")), where.stdout


@needs_onednn
def test_a_missing_libdnnl_at_load_names_the_pip_package(onednn_artifact, tmp_path):
    """A runtime-only process with no oneDNN anywhere: one line naming the library and the pip
    command (the artifact itself carries no libdnnl.so.2)."""
    if system_library(onednn.SONAME) is not None:
        pytest.skip("libdnnl.so.2 is on this machine's system loader path")
    _, art = onednn_artifact
    python, env = _no_onednn_env(tmp_path)
    tvm_site = Path(__import__("tvm").__file__).resolve().parents[1]
    for name in ("tvm", "tvm_ffi", "ml_dtypes"):
        (tmp_path / "numpy_only" / name).symlink_to(tvm_site / name)
    (tmp_path / "numpy_only" / "typing_extensions.py").symlink_to(tvm_site / "typing_extensions.py")
    env["PYTHONPATH"] = f"{Path(__file__).resolve().parents[1]}:{env['PYTHONPATH']}"
    env["TVM_USE_RUNTIME_LIB"] = "1"
    script = (
        "import sys\n"
        "from tvm_layerfuse.errors import ArtifactError\n"
        "from tvm_layerfuse.runtime import load\n"
        "try:\n    load(sys.argv[1])\nexcept ArtifactError as e:\n    print(e)\n"
    )
    proc = subprocess.run([python, "-c", script, str(art)], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = proc.stdout.strip().splitlines()
    assert len(lines) == 1 and onednn.SONAME in lines[0] and onednn.INSTALL in lines[0] and "is not installed" in lines[0], lines
