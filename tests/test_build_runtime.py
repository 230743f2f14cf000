"""compile -> artifact -> runtime, for CPU (run here), aarch64 and CUDA (built here)."""

import json
import os
import shutil
import signal
import struct
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import onnx
import pytest

from graphs import rel_err, run_ort
from tvm_layerfuse.compile.build import compile_model
from tvm_layerfuse.errors import ArtifactError, DeviceError, InputError
from tvm_layerfuse.runtime import artifact, load
from tvm_layerfuse.testing import zoo
from tvm_layerfuse.testing.checks import gpu_present
from tvm_layerfuse.testing.weights import assert_live

RTOL = 1e-4


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("model") / "squeezenet.onnx"
    onnx.save(zoo.squeezenet1_1(image=32, seed=3), str(path))
    return path


@pytest.fixture(scope="module")
def cpu_artifacts(model_path, tmp_path_factory):
    root = tmp_path_factory.mktemp("art")
    fused = compile_model(model_path, root / "fused", target="cpu", progress=False)
    plain = compile_model(model_path, root / "plain", target="cpu", fuse=False, progress=False)
    return fused, plain


def _feeds(model_path, seed=0):
    m = onnx.load(str(model_path))
    x = np.random.default_rng(seed).standard_normal([d.dim_value for d in m.graph.input[0].type.tensor_type.shape.dim])
    return {m.graph.input[0].name: x.astype(np.float32)}


def test_manifest_describes_the_artifact(cpu_artifacts):
    import tvm

    fused, plain = cpu_artifacts
    m = json.loads((fused / "manifest.json").read_text())
    assert m["format"] == "tvm_layerfuse.artifact" and m["format_version"] == 1
    assert m["tvm_version"] == tvm.__version__
    assert m["target"]["preset"] == "cpu" and m["target"]["machine"] == "x86_64"
    assert m["inputs"] == [{"name": "input", "shape": [1, 3, 32, 32], "dtype": "float32"}]
    assert m["outputs"][0]["name"] == "output"
    carried = {lib["file"] for lib in m["tactics"]["libraries"]}  # the oneDNN tactic library, where used
    assert set(m["files"]) == {"model.so", "params.npz"} | carried
    for name, digest in m["files"].items():
        assert artifact.sha256_file(fused / name) == digest
    assert m["fusion"]["plan"]["concat_in_place"] == 8 and m["fused"] is True
    plain_m = json.loads((plain / "manifest.json").read_text())
    assert plain_m["fused"] is False and plain_m["fusion"]["plan"] is None
    # weights live beside the library, not inside it
    assert (fused / "params.npz").stat().st_size > (fused / "model.so").stat().st_size / 4


def test_fused_and_unfused_match_onnxruntime(cpu_artifacts, model_path):
    assert_live(onnx.load(str(model_path)))  # else the comparison could not fail
    feeds = _feeds(model_path)
    (expected,) = run_ort(onnx.load(str(model_path)), feeds)
    fused, plain = cpu_artifacts
    a = load(fused).run(feeds)["output"]
    b = load(plain).run(feeds)["output"]
    assert rel_err(expected, a) <= RTOL and rel_err(expected, b) <= RTOL
    assert rel_err(b, a) <= RTOL


def test_runtime_only_in_a_bundle(cpu_artifacts, model_path, tmp_path):
    """The bundle carries TVM without its compiler library; run it in a fresh process."""
    from tvm_layerfuse.deploy.bundle import make_bundle, size_of

    bundle = make_bundle(cpu_artifacts[0], tmp_path / "bundle")
    assert not (bundle / "site" / "tvm" / "lib" / "libtvm_compiler.so").exists()
    sizes = size_of(bundle)
    assert sizes["runtime_bytes"] <= 20 * 2**20  # TVM's runtime and the loader; oneDNN (~40 MiB) counts apart
    carries_onednn = bool(json.loads((cpu_artifacts[0] / "manifest.json").read_text())["tactics"]["libraries"])
    assert (sizes["vendor_bytes"] > 0) == carries_onednn
    feeds = _feeds(model_path, seed=5)
    np.save(tmp_path / "x.npy", feeds["input"])
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "TVM"))}
    proc = subprocess.run(
        [sys.executable, "-I", str(bundle / "run.py"), "--input", str(tmp_path / "x.npy"), "--output", str(tmp_path / "y.npz")],
        capture_output=True, text=True, env=env, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    check = subprocess.run(
        [sys.executable, "-I", "-c",
         "import sys, os; sys.path.insert(0, sys.argv[1]); os.environ['TVM_USE_RUNTIME_LIB'] = '1'; import tvm;"
         "print(tvm.__file__);\ntry:\n import tvm.relax\n print('relax')\nexcept Exception:\n print('no relax')",
         str(bundle / "site")],
        capture_output=True, text=True, env=env, timeout=120,
    )  # fmt: skip
    assert str(bundle) in check.stdout and "no relax" in check.stdout, check.stdout + check.stderr
    with np.load(tmp_path / "y.npz") as y:
        got = y["output"]
    (expected,) = run_ort(onnx.load(str(model_path)), feeds)
    assert rel_err(expected, got) <= RTOL


def test_runs_refill_their_inputs_and_return_copies(cpu_artifacts, model_path, tmp_path):
    """A run copies its inputs into the thread's input tensors (any strides) and returns
    copies: one run's outputs stay as they were after the next run, also where an output is
    the input tensor itself."""
    fused, _ = cpu_artifacts
    rt = load(fused)
    a_in, b_in = _feeds(model_path, 1), _feeds(model_path, 2)
    a = rt.run(a_in)["output"]
    kept = a.copy()
    b = rt.run(b_in)["output"]
    assert np.array_equal(a, kept) and rel_err(a, b) > 1e-2
    ((name, x),) = a_in.items()
    assert rel_err(rt.run({name: np.asfortranarray(x)})["output"], kept) <= 1e-6  # read by value, not by layout

    from onnx import TensorProto, helper

    g = helper.make_graph(
        [helper.make_node("Identity", ["x"], ["y"])],
        "identity",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4])],
    )
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]), str(tmp_path / "identity.onnx"))
    identity = load(compile_model(tmp_path / "identity.onnx", tmp_path / "identity", target="cpu", progress=False))
    first = identity.run({"x": np.arange(4, dtype=np.float32).reshape(1, 4)})["y"]
    second = identity.run({"x": np.ones((1, 4), np.float32)})["y"]
    assert first.tolist() == [[0, 1, 2, 3]] and second.tolist() == [[1, 1, 1, 1]]


def test_aarch64_artifact_is_an_arm_elf(model_path, tmp_path):
    if shutil.which("aarch64-linux-gnu-gcc") is None:
        pytest.skip("the aarch64 cross compiler is not installed (apt-get install gcc-aarch64-linux-gnu)")
    out = compile_model(model_path, tmp_path / "arm", target="aarch64", progress=False)
    head = (out / "model.so").read_bytes()[:20]
    assert head[:4] == b"\x7fELF" and struct.unpack_from("<H", head, 18)[0] == 183  # EM_AARCH64
    with pytest.raises(ArtifactError, match="compiled for aarch64 hosts, but this machine is x86_64"):
        load(out)


def test_cuda_artifact_embeds_sm90_device_code(model_path, tmp_path):
    from tvm_layerfuse.compile.cuda import device_code, extract_fatbins

    out = compile_model(model_path, tmp_path / "cuda", target="cuda", arch="sm_90", progress=False)
    images = device_code(out / "model.so")
    assert {"kind": "elf", "arch": "sm_90"} in [{k: d[k] for k in ("kind", "arch")} for d in images]
    cuobjdump = shutil.which("cuobjdump")
    if cuobjdump is None:
        try:
            import nvidia.cu13  # the nvidia-cuda-cuobjdump wheel (test extra)

            cuobjdump = str(Path(list(nvidia.cu13.__path__)[0]) / "bin" / "cuobjdump")
        except ImportError:
            cuobjdump = None
    if cuobjdump and Path(cuobjdump).exists():
        (fatbin,) = extract_fatbins(out / "model.so", tmp_path)
        listing = subprocess.run([cuobjdump, "--list-elf", str(fatbin)], capture_output=True, text=True).stdout
        assert "sm_90" in listing, listing
    m = json.loads((out / "manifest.json").read_text())
    assert m["target"]["arch"] == "sm_90" and m["target"]["device"] == "cuda"
    with pytest.raises(ArtifactError, match="compiled for cuda"):
        load(out, device="cpu")
    if gpu_present():  # the artifact runs, and computes what onnxruntime does
        feeds = _feeds(model_path, seed=4)
        (expected,) = run_ort(onnx.load(str(model_path)), feeds)
        assert rel_err(expected, load(out, device="cuda").run(feeds)["output"]) <= RTOL
    else:
        with pytest.raises(DeviceError):
            load(out, device="cuda")  # no GPU (or no driver) on this machine: a one-line error


def test_tampered_files_are_refused(cpu_artifacts, tmp_path):
    for name in ("model.so", "params.npz"):
        copy = tmp_path / name.replace(".", "_")
        shutil.copytree(cpu_artifacts[0], copy)
        data = bytearray((copy / name).read_bytes())
        data[len(data) // 2] ^= 0xFF
        (copy / name).write_bytes(bytes(data))
        with pytest.raises(ArtifactError, match=f"'{name}' in artifact .* has sha256"):
            load(copy)
    missing = tmp_path / "missing"
    shutil.copytree(cpu_artifacts[0], missing)
    (missing / "params.npz").unlink()
    with pytest.raises(ArtifactError, match="lacks 'params.npz'"):
        load(missing)


def test_bad_inputs_are_refused(cpu_artifacts, model_path):
    rt = load(cpu_artifacts[0])
    x = _feeds(model_path)["input"]
    with pytest.raises(InputError, match="'nope' is not an input"):
        rt.run({"nope": x})
    with pytest.raises(InputError, match=r"has shape \[1, 3, 16, 16\]; expected \[1, 3, 32, 32\]"):
        rt.run({"input": x[:, :, :16, :16]})
    with pytest.raises(InputError, match="has dtype float64; expected float32"):
        rt.run({"input": x.astype(np.float64)})


def cli(*args, **kw):
    return subprocess.run([sys.executable, "-m", "tvm_layerfuse", *args], capture_output=True, text=True, timeout=600, **kw)


def test_cli_compile_run_and_errors(model_path, tmp_path):
    out = tmp_path / "a"
    p = cli("compile", str(model_path), "-o", str(out), "-q")
    assert p.returncode == 0, p.stderr
    feeds = _feeds(model_path, seed=9)
    np.save(tmp_path / "x.npy", feeds["input"])
    p = cli("run", str(out), "--input", str(tmp_path / "x.npy"), "--output", str(tmp_path / "y.npz"))
    assert p.returncode == 0, p.stderr
    assert "top-5" in p.stdout
    with np.load(tmp_path / "y.npz") as y:
        (expected,) = run_ort(onnx.load(str(model_path)), feeds)
        assert rel_err(expected, y["output"]) <= RTOL
    # compile refuses to overwrite; bad inputs give one line and exit 2
    for args, fragment in [
        (("compile", str(model_path), "-o", str(out)), "already exists"),
        (("compile", str(model_path), "--target", "riscv"), "target 'riscv' is unknown"),
        (("compile", str(model_path), "--target", "cuda", "--arch", "sm_1"), "--arch sm_1 is not offered"),
        (("run", str(tmp_path / "nowhere")), "does not exist"),
        (("run", str(out), "--input", str(tmp_path / "missing.npy")), "does not exist"),
        (("run", str(out), "--device", "cuda"), "compiled for cpu"),
    ]:
        p = cli(*args)
        assert p.returncode == 2, (args, p.stderr)
        lines = p.stderr.strip().splitlines()
        assert len(lines) == 1 and fragment in lines[0] and "Traceback" not in p.stderr, (args, p.stderr)
    (tmp_path / "bad.npy").write_bytes(b"not numpy")
    p = cli("run", str(out), "--input", str(tmp_path / "bad.npy"))
    assert p.returncode == 2 and "not a readable .npy" in p.stderr


def test_run_output_of_a_model_whose_output_is_named_file(tmp_path):
    """``np.savez(path, **outputs)`` breaks on an output called ``file`` (its own argument);
    ``run --output`` writes every output under its own name."""
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(5)
    w = numpy_helper.from_array(rng.standard_normal((4, 3, 3, 3)).astype(np.float32), "w")
    graph = helper.make_graph(
        [helper.make_node("Conv", ["x", "w"], ["c"], pads=[1, 1, 1, 1]), helper.make_node("Relu", ["c"], ["file"])],
        "file_output",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 8, 8])],
        [helper.make_tensor_value_info("file", TensorProto.FLOAT, [1, 4, 8, 8])],
        [w],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    path = tmp_path / "file_output.onnx"
    onnx.save(model, str(path))
    out = tmp_path / "a"
    assert cli("compile", str(path), "-o", str(out), "-q").returncode == 0
    x = rng.standard_normal((1, 3, 8, 8)).astype(np.float32)
    np.save(tmp_path / "x.npy", x)
    p = cli("run", str(out), "--input", str(tmp_path / "x.npy"), "--output", str(tmp_path / "y.npz"))
    assert p.returncode == 0, p.stderr
    with np.load(tmp_path / "y.npz", allow_pickle=False) as y:
        assert y.files == ["file"]
        (expected,) = run_ort(model, {"x": x})
        assert expected.max() > 0 and (expected == 0).any()  # live weights: the Relu cuts
        assert rel_err(expected, y["file"]) <= RTOL


def test_failed_or_interrupted_compile_leaves_nothing(model_path, tmp_path):
    # a failure: an unwritable destination parent
    p = cli("compile", str(model_path), "-o", str(tmp_path / "no" / "such" / "dir"))
    assert p.returncode == 2 and "does not exist" in p.stderr
    # an interrupt (SIGINT = Ctrl-C) while the compile writes the library: whichever wins,
    # OUT is either a complete artifact or absent, and no staging directory is left
    tmpdir = tmp_path / "tmp"
    tmpdir.mkdir()
    out = tmp_path / "interrupted"
    env = dict(os.environ, TMPDIR=str(tmpdir))
    proc = subprocess.Popen([sys.executable, "-m", "tvm_layerfuse", "compile", str(model_path), "-o", str(out)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)  # fmt: skip
    while proc.poll() is None and not any(tmpdir.glob("tvm_layerfuse_export_*")):
        time.sleep(0.01)  # waiting for the event: the library is being exported
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=600)
    assert proc.returncode in (0, 130, -signal.SIGINT), (proc.returncode, err)
    if proc.returncode == 0 or out.exists():
        rt = load(out)  # complete: every file present with its recorded sha256
        feeds = _feeds(model_path, seed=6)
        (expected,) = run_ort(onnx.load(str(model_path)), feeds)
        assert rel_err(expected, rt.run(feeds)["output"]) <= RTOL
    else:  # interrupted before the commit: exit 130, one line, nothing written
        assert proc.returncode == 130 and len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".interrupted")]


def test_atomic_directory_commits_whole_or_leaves_nothing(tmp_path):
    """The one home of "write beside, then rename" (artifacts and bundles): a block that fails
    leaves no trace, one that ends commits; an existing output is replaced only with
    ``overwrite``, and no staging or old directory stays behind."""
    from tvm_layerfuse.errors import UsageError

    out = tmp_path / "out"
    with pytest.raises(RuntimeError, match="half way"):
        with artifact.atomic_directory(out) as tmp:
            (tmp / "a").write_text("1")
            raise RuntimeError("half way")
    assert list(tmp_path.iterdir()) == []
    with artifact.atomic_directory(out, mode=0o750) as tmp:
        (tmp / "a").write_text("1")
        assert not out.exists()
    assert (out / "a").read_text() == "1" and out.stat().st_mode & 0o777 == 0o750
    with pytest.raises(UsageError, match="already exists; remove it or pass --force"):
        with artifact.atomic_directory(out):
            pass
    committed = []
    with artifact.atomic_directory(out, overwrite=True, on_commit=lambda: committed.append(out.exists())) as tmp:
        (tmp / "b").write_text("2")
    assert committed == [True] and sorted(p.name for p in out.iterdir()) == ["b"]
    assert [p.name for p in tmp_path.iterdir()] == ["out"]


def test_aligned_inputs_are_read_in_place_and_never_written(tmp_path):
    """An input that is C-contiguous, writable and 64-byte aligned is passed to the library
    where it lies (no copy per inference); any other is copied first. Either way no kernel
    writes into an input, on a net where one input is a conv's residual (the library's sum
    post-op, which writes where the residual lies when the residual is a tensor of its own)
    and a concat's piece (written into the block in place), and the answers are onnxruntime's."""
    from onnx import TensorProto, helper, numpy_helper

    from tvm_layerfuse.runtime import aligned

    rng = np.random.default_rng(11)
    c, shape = 16, [1, 16, 12, 12]
    inits = [
        numpy_helper.from_array((rng.standard_normal((c, c, 3, 3)) * 0.15).astype(np.float32), "w1"),
        numpy_helper.from_array((rng.standard_normal(c) * 0.1).astype(np.float32), "b1"),
        numpy_helper.from_array((rng.standard_normal((8, c, 1, 1)) * 0.3).astype(np.float32), "w2"),
    ]
    nodes = [
        helper.make_node("Conv", ["x", "w1", "b1"], ["c1"], pads=[1, 1, 1, 1]),
        helper.make_node("Add", ["c1", "r"], ["s"]),
        helper.make_node("Relu", ["s"], ["y1"]),
        helper.make_node("Conv", ["x", "w2"], ["c2"]),
        helper.make_node("Concat", ["r", "c2"], ["y2"], axis=1),
    ]
    g = helper.make_graph(
        nodes,
        "inputs_read_in_place",
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, shape) for n in ("x", "r")],
        [
            helper.make_tensor_value_info("y1", TensorProto.FLOAT, shape),
            helper.make_tensor_value_info("y2", TensorProto.FLOAT, [1, c + 8, 12, 12]),
        ],
        inits,
    )
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    onnx.save(model, str(tmp_path / "m.onnx"))
    rt = load(compile_model(tmp_path / "m.onnx", tmp_path / "art", target="cpu", progress=False))

    feeds = {n: aligned(rng.standard_normal(shape).astype(np.float32)) for n in ("x", "r")}
    assert all(v.ctypes.data % 64 == 0 and v.flags.c_contiguous for v in feeds.values())

    def shifted(a):  # the same values 16 bytes past a 64-byte boundary
        raw = np.empty(a.nbytes + 64, np.uint8)
        start = (-raw.ctypes.data % 64) + 16
        out = raw[start : start + a.nbytes].view(a.dtype).reshape(a.shape)
        out[...] = a
        return out

    def read_only(a):
        out = aligned(a.copy())
        out.flags.writeable = False
        return out

    def argument_data(values):
        return [np.from_dlpack(t).ctypes.data for t in rt._arguments(values)[:2]]

    assert argument_data(feeds) == [feeds["x"].ctypes.data, feeds["r"].ctypes.data]  # read where they lie
    for make in (shifted, read_only):  # copied: not 64-byte aligned; DLPack exports no read-only array
        values = {n: make(v) for n, v in feeds.items()}
        assert not set(argument_data(values)) & {v.ctypes.data for v in values.values()}

    kept = {n: v.copy() for n, v in feeds.items()}
    expected = run_ort(model, kept)
    assert all(np.abs(e).max() > 1e-2 for e in expected) and (expected[0] > 0).mean() > 0.2  # live outputs
    for values in (feeds, {n: shifted(v) for n, v in feeds.items()}, {n: read_only(v) for n, v in feeds.items()}, feeds):
        got = rt.run(values)
        assert all(np.array_equal(values[n], kept[n]) for n in kept), "a kernel wrote into an input"
        for name, e in zip(("y1", "y2"), expected):
            assert rel_err(got[name], e) <= RTOL, name
