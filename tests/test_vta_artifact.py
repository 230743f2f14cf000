"""The VTA artifact: compile to a directory, load it with the runtime only, run it, refuse bad ones."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from tvm_layerfuse.compile.vta import pipeline
from tvm_layerfuse.compile.vta.quantize import random_samples, reference
from tvm_layerfuse.errors import ArtifactError, DeviceError, InputError
from tvm_layerfuse.runtime.vta.runtime import load_vta
from tvm_layerfuse.testing import zoo


@pytest.fixture(scope="module")
def artifact(tmp_path_factory):
    d = tmp_path_factory.mktemp("vta")
    model = zoo.googlenet(blocks=1, width=0.25, image=32, seed=3)
    path = d / "net.onnx"
    path.write_bytes(model.SerializeToString())
    calib = [{"input": np.random.default_rng(k).standard_normal((1, 3, 32, 32)).astype(np.float32)} for k in range(2)]
    rep = pipeline.compile_vta(str(path), d / "art", calibration=calib)
    b = pipeline.build(str(path), calibration=calib)
    return d / "art", rep, b


def test_loaded_artifact_matches_the_int8_reference(artifact):
    art, rep, b = artifact
    mod = load_vta(art)
    assert mod.host_steps is not None  # the host ops run in host.so
    feeds = random_samples(b.graph, 1, seed=5)[0]
    run, trace = mod.run(feeds, trace=True), {}
    ref = reference(b.graph, b.quantization, feeds, trace=trace)["output"]
    shared = sorted(set(run.ints) & set(trace))
    assert len(shared) >= 10
    for name in shared:  # every int8 tensor VTA exchanged with the host: bit-exact
        np.testing.assert_array_equal(run.ints[name], trace[name], err_msg=name)
    # the classifier is a host op computing in float64: equal up to float64 rounding
    np.testing.assert_allclose(run.outputs["output"], ref, rtol=1e-12, atol=1e-12 * np.abs(ref).max())
    manifest = json.loads((art / "vta.json").read_text())
    assert {op["kind"] for op in manifest["ops"]} == {"vta", "host"}
    assert rep["counters"]["fused"]["dram_nbytes"] < rep["counters"]["unfused"]["dram_nbytes"]
    assert sum(rep["instructions"].values()) == sum(manifest["instructions"].values())
    text = pipeline.format_report(rep)
    assert "host  conv" in text and "3 input channels" in text and "in place" in text and "dram_nbytes" in text


def test_runtime_side_runs_the_host_library_with_tvms_runtime_only(artifact):
    """The host ops run in host.so through TVM's runtime library alone: no onnx, no tvm.relax,
    no compiler library in the process."""
    art, _, b = artifact
    feeds = random_samples(b.graph, 1, seed=6)[0]
    np.save(art.parent / "x.npy", feeds["input"])
    code = (
        "import json, sys, numpy as np\n"
        "from tvm_layerfuse.runtime.vta.runtime import load_vta\n"
        f"m = load_vta({str(art)!r})\n"
        f"y = m.run({{'input': np.load({str(art.parent / 'x.npy')!r})}}).outputs['output']\n"
        f"np.save({str(art.parent / 'y.npy')!r}, y)\n"
        "bad = sorted(k for k in sys.modules if k.split('.')[0] in ('onnx', 'onnxruntime') or k.startswith('tvm.relax'))\n"
        "print(json.dumps({'bad': bad, 'host_steps': m.host_steps is not None, 'tvm_runtime': 'tvm.runtime' in sys.modules,\n"
        "                  'compiler': 'libtvm_compiler' in open('/proc/self/maps').read()}))\n"
    )
    env = dict(os.environ, TVM_USE_RUNTIME_LIB="1")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env)
    assert json.loads(out.stdout) == {"bad": [], "host_steps": True, "tvm_runtime": True, "compiler": False}, out.stdout + out.stderr
    ref = reference(b.graph, b.quantization, feeds)["output"]
    np.testing.assert_allclose(np.load(art.parent / "y.npy"), ref, rtol=1e-12, atol=1e-12 * np.abs(ref).max())


def test_artifact_lists_and_needs_its_host_library(artifact, tmp_path):
    """vta.json names host.so (one function per host op) with its checksum; without it the
    artifact does not load, in one line, whichever loader is used."""
    import shutil

    from tvm_layerfuse import runtime

    art, _, _ = artifact
    vta = json.loads((art / "vta.json").read_text())
    host_ops = [op for op in vta["ops"] if op["kind"] == "host"]
    assert vta["host_library"]["file"] == "host.so" and vta["host_library"]["functions"] == [op["function"] for op in host_ops]
    assert "host.so" in vta["sha256"] and "host.so" in json.loads((art / "manifest.json").read_text())["files"]
    bad = tmp_path / "nolib"
    shutil.copytree(art, bad)
    (bad / "host.so").unlink()
    with pytest.raises(ArtifactError, match=r"host.so' is missing or does not match its checksum in vta.json") as e:
        load_vta(bad)
    assert "\n" not in str(e.value)
    with pytest.raises(ArtifactError, match=r"lacks 'host.so'; expected it beside manifest.json") as e:
        runtime.load(bad)
    assert "\n" not in str(e.value)


def test_no_board_is_a_clear_error(artifact):
    art, _, _ = artifact
    with pytest.raises(DeviceError, match="no VTA device found .*pass device='sim'"):
        load_vta(art, device="board")


def test_tampered_or_foreign_artifacts_are_refused(artifact, tmp_path):
    art, _, _ = artifact
    import shutil

    bad = tmp_path / "bad"
    shutil.copytree(art, bad)
    raw = bytearray((bad / "dram.bin").read_bytes())
    raw[-1] ^= 1
    (bad / "dram.bin").write_bytes(bytes(raw))
    with pytest.raises(ArtifactError, match="does not match its checksum"):
        load_vta(bad)
    with pytest.raises(ArtifactError, match="has no vta.json"):
        load_vta(tmp_path)


def test_wrong_input_shape_is_an_input_error(artifact):
    art, _, _ = artifact
    with pytest.raises(InputError, match="input 'input' has shape \\[1, 3, 16, 16\\]; expected \\[1, 3, 32, 32\\]"):
        load_vta(art).run({"input": np.zeros((1, 3, 16, 16), np.float32)})


@pytest.mark.parametrize(
    "name",
    [
        "efficientnet_like",  # SiLU/Sigmoid/Mul epilogues and squeeze-excite, depthwise convs: host layers
        pytest.param("mobilenet_v2", marks=pytest.mark.slow),  # depthwise convs between VTA convs
        pytest.param("densenet121", marks=pytest.mark.slow),  # pre-activation BN + ReLU prologues
    ],
)
def test_host_heavy_networks_run_their_host_layers_in_the_library(name, tmp_path):
    """Networks whose epilogues VTA's ALU has no form for: their host ops compiled into host.so
    keep every int8 tensor bit-exact with the numpy interpretation of the same host steps
    (the reference's host part)."""
    model = zoo.BUILDERS[name](seed=1)
    pipeline.compile_vta(model, tmp_path / "art", n_calibration=2)
    mod = load_vta(tmp_path / "art")
    kinds = {step["op_type"] for op in mod.manifest["ops"] if op["kind"] == "host" for step in op["steps"] if step["op"] == "layer"}
    assert len(mod.manifest["host_library"]["functions"]) >= 3
    feeds = {"input": np.random.default_rng(4).standard_normal(mod.inputs["input"]).astype(np.float32)}
    compiled = mod.run(feeds, trace=True)
    mod.host_steps = None  # the same artifact with its host steps in numpy
    numpy_steps = mod.run(feeds, trace=True)
    assert len(compiled.ints) >= 10 and sorted(compiled.ints) == sorted(numpy_steps.ints)
    for tensor, value in compiled.ints.items():
        np.testing.assert_array_equal(value, numpy_steps.ints[tensor], err_msg=tensor)
    ref = numpy_steps.outputs["output"]
    np.testing.assert_allclose(compiled.outputs["output"], ref, rtol=1e-12, atol=1e-12 * np.abs(ref).max())
    if name == "efficientnet_like":
        assert {"Sigmoid", "Mul", "Conv"} <= kinds, kinds
