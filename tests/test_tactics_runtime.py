"""The oneDNN tactic library at run time, in one process: two models of the same shapes and
different weights (their conv weights packed in the artifacts, used where each module holds
them), loaded together and one after the other, each give onnxruntime's answer;
one Runtime serves several threads at once; a tactic library of another calling-contract
version is refused in one line, never run with the wrong code."""

from __future__ import annotations

import json
import shutil
import threading
from pathlib import Path

import numpy as np
import onnx
import pytest

from graphs import Net, rel_err
from tvm_layerfuse.compile.build import compile_model
from tvm_layerfuse.compile.tactics import abi, onednn
from tvm_layerfuse.errors import ArtifactError
from tvm_layerfuse.runtime import artifact, load
from tvm_layerfuse.testing import random_inputs, run_onnxruntime

RTOL = 1e-4
MISSING = onednn.availability()
pytestmark = pytest.mark.skipif(MISSING is not None, reason=f"oneDNN is not installed here: {MISSING}")
SAMPLES = 16  # the library's weight fingerprint: this many sampled values (kFingerprint)


def _net(seed: int) -> onnx.ModelProto:
    """conv -> relu -> conv + residual -> relu -> pool -> conv (blocked layouts, a residual in
    place, a pool): every weight tensor of its own size."""
    n = Net(seed=seed)
    x = n.input("x", (1, 16, 12, 12))
    a = n.relu(n.conv(x, 32, name="c1"))
    b = n.relu(n.node("Add", [n.conv(a, 32, name="c2"), a]))
    p = n.maxpool(b, k=3, stride=2, pad=1)
    return n.build([n.conv(p, 48, k=1, name="c3")])


def _same_samples(a: onnx.ModelProto, seed: int) -> onnx.ModelProto:
    """``a`` with other conv weights that agree with ``a``'s at every position the library's
    fingerprint samples (so only its layer cache, not the fingerprint, can tell them apart)."""
    rng = np.random.default_rng(seed)
    b = onnx.ModelProto()
    b.CopyFrom(a)
    for init in b.graph.initializer:
        w = onnx.numpy_helper.to_array(init)
        if w.ndim != 4:
            continue
        flat = w.reshape(-1).copy()
        keep = {(flat.size - 1) * k // (SAMPLES - 1) for k in range(SAMPLES)}
        other = (rng.standard_normal(flat.size) * flat.std()).astype(np.float32)
        mask = np.ones(flat.size, bool)
        mask[list(keep)] = False
        flat[mask] = other[mask]
        init.CopyFrom(onnx.numpy_helper.from_array(flat.reshape(w.shape), init.name))
    return b


@pytest.fixture(scope="module", params=["never", "always"], ids=["direct", "winograd"])
def two_artifacts(tmp_path_factory, request):
    """The two models compiled alike: direct convs, or (``--winograd always``) the 3x3 convs on
    a Winograd kernel (the library's on AVX2)."""
    base = tmp_path_factory.mktemp("two")
    a = _net(seed=1)
    b = _same_samples(a, seed=2)
    out = []
    for name, model in (("a", a), ("b", b)):
        path = base / f"{name}.onnx"
        onnx.save(model, str(path))
        compile_model(path, base / name, tactics="onednn", winograd=request.param, progress=False)
        layers = json.loads((base / name / "manifest.json").read_text())["tactics"]["layers"]
        three = [c["kernel"] for c in layers if c.get("shape", "").endswith(", 3, 3]")]
        if request.param == "always" and not any("wino" in k for k in three):
            pytest.skip(f"no Winograd kernel on this CPU: {three}")
        assert len(three) == 2 and all(("wino" in k) is (request.param == "always") for k in three), three
        out.append((base / name, model))
    return out


def _expected(model, seed: int):
    feeds = random_inputs(model, seed)
    (y,) = run_onnxruntime(model, feeds)
    assert np.abs(y).max() > 1e-3, "dead output"
    return feeds, y


def test_two_models_at_once_and_one_after_the_other(two_artifacts):
    (pa, ma), (pb, mb) = two_artifacts
    fa, ya = _expected(ma, 0)
    fb, yb = _expected(mb, 0)
    assert rel_err(ya, yb) > 1e-2, "the two models must differ"
    manifest = json.loads((pa / "manifest.json").read_text())
    assert manifest["tactics"]["used"] == "onednn"
    assert manifest["tactics"]["libraries"][0]["abi_version"] == abi.ABI_VERSION
    # the packed path: every conv call reads its weights packed, the artifact holds no plain ones
    for path in (pa, pb):
        packing = json.loads((path / "manifest.json").read_text())["tactics"]["packed_weights"]
        assert packing["packed_calls"] == 3 and packing["kept_plain"] == [], packing
        with np.load(path / "params.npz") as params:
            assert not [k for k in params.files if params[k].ndim == 4], params.files
    # at the same time
    ra, rb = load(pa), load(pb)
    for _ in range(2):
        assert rel_err(ra.run(fa)["c3_out"], ya) <= RTOL
        assert rel_err(rb.run(fb)["c3_out"], yb) <= RTOL
    del ra, rb
    # one after the other: each load of the other model in turn (its weights where the last one's were)
    for path, feeds, want in ((pa, fa, ya), (pb, fb, yb), (pa, fa, ya), (pb, fb, yb)):
        rt = load(path)
        assert rel_err(rt.run(feeds)["c3_out"], want) <= RTOL
        del rt


def test_one_runtime_from_several_threads(two_artifacts):
    (pa, ma), _ = two_artifacts
    rt = load(pa)
    cases = [_expected(ma, seed) for seed in range(4)]
    errors: list = []
    results: dict = {}

    def work(k: int) -> None:
        try:
            for r in range(6):
                feeds, want = cases[(k + r) % len(cases)]
                results[(k, r)] = rel_err(rt.run(feeds)["c3_out"], want)
        except Exception as e:  # reported below, with the thread
            errors.append(f"thread {k}: {type(e).__name__}: {e}")

    threads = [threading.Thread(target=work, args=(k,)) for k in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert len(results) == 18 and max(results.values()) <= RTOL, results


def _other_version_library(tmp_path: Path, version: int) -> Path:
    """The tactic library built from the same source with another calling-contract version."""
    import tvm_ffi.cpp

    source = onednn.SOURCE.read_text().replace(f"kAbiVersion = {abi.ABI_VERSION};", f"kAbiVersion = {version};")
    src = tmp_path / "onednn_conv.cc"
    src.write_text(source)
    for include in onednn.SOURCE_INCLUDES:  # what it includes from beside it
        (tmp_path / include.name).write_bytes(include.read_bytes())
    found = onednn.installation()
    return Path(
        tvm_ffi.cpp.build(
            "layerfuse_onednn_other",
            sources=[str(src)],
            extra_cflags=["-O0", "-fopenmp", "-fvisibility=hidden"],
            extra_ldflags=[f"-L{found.lib_dir}", "-ldnnl", "-fopenmp"],
            extra_include_paths=[str(found.prefix / "include")],
            build_directory=str(tmp_path / "build"),
        )
    )


def test_a_tactic_library_of_another_version_is_refused_in_one_line(two_artifacts, tmp_path):
    (pa, ma), _ = two_artifacts
    feeds, want = _expected(ma, 0)
    assert rel_err(load(pa).run(feeds)["c3_out"], want) <= RTOL  # this version is loaded
    other = tmp_path / "other"
    shutil.copytree(pa, other)
    shutil.copy(_other_version_library(tmp_path, abi.ABI_VERSION + 1), other / onednn.LIBRARY_FILE)
    manifest = json.loads((other / "manifest.json").read_text())
    manifest["tactics"]["libraries"][0]["abi_version"] = abi.ABI_VERSION + 1
    (other / "manifest.json").write_text(json.dumps(manifest))
    manifest["files"] = {name: artifact.sha256_file(other / name) for name in manifest["files"]}
    (other / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ArtifactError) as e:
        load(other)
    message = str(e.value)
    assert "\n" not in message and f"ABI version {abi.ABI_VERSION + 1}" in message and f"version {abi.ABI_VERSION}" in message
    assert rel_err(load(pa).run(feeds)["c3_out"], want) <= RTOL  # the loaded one still serves its artifacts



def _shuffle_net() -> onnx.ModelProto:
    """conv -> relu -> channel shuffle (Reshape / Transpose / Reshape: TVM kernels with parallel
    loops) -> Softmax over the channels (a TVM reduction) -> conv: library layers and TVM kernels
    in turn."""
    n = Net(seed=5)
    x = n.input("x", (1, 16, 20, 20))
    a = n.relu(n.conv(x, 32, name="c1"))
    g = n.node("Reshape", [a, n.const(np.array([1, 4, 8, 20, 20], np.int64))], shape=(1, 4, 8, 20, 20))
    t = n.node("Transpose", [g], shape=(1, 8, 4, 20, 20), perm=[0, 2, 1, 3, 4])
    s = n.node("Reshape", [t, n.const(np.array([1, 32, 20, 20], np.int64))], shape=(1, 32, 20, 20))
    m = n.node("Softmax", [s], axis=1)
    return n.build([n.conv(m, 24, name="c2")])


@pytest.fixture(scope="module")
def shuffle_artifact(tmp_path_factory):
    base = tmp_path_factory.mktemp("pool")
    model = _shuffle_net()
    onnx.save(model, str(base / "m.onnx"))
    compile_model(base / "m.onnx", base / "art", tactics="onednn", winograd="never", progress=False)
    return base / "art", model


@pytest.mark.parametrize("pool", ["openmp", "tvm"])
def test_tvm_kernels_run_on_the_tactic_librarys_threads(shuffle_artifact, pool, monkeypatch):
    """The model's parallel TVM kernels run on the tactic library's OpenMP threads (one pool
    for the whole model), or on TVM's own pool where TVM_LAYERFUSE_THREAD_POOL=tvm; the
    answers are onnxruntime's either way, from one thread and from three at once."""
    path, model = shuffle_artifact
    kernels = artifact.read_manifest(path)["schedules"]["kernels"]
    assert any(k["parallel"] for k in kernels.values()), kernels  # there is a parallel TVM loop to share
    monkeypatch.setenv("TVM_LAYERFUSE_THREAD_POOL", pool)
    rt = load(path)
    assert rt.shared_pool is (pool == "openmp")
    cases = [_expected(model, seed) for seed in range(3)]
    for feeds, want in cases:
        assert rel_err(rt.run(feeds)["c2_out"], want) <= RTOL
    errs: list = []
    threads = [threading.Thread(target=lambda f=f, w=w: errs.append(rel_err(rt.run(f)["c2_out"], w))) for f, w in cases]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(errs) == 3 and max(errs) <= RTOL, errs


def test_an_unknown_thread_pool_is_refused_in_one_line(shuffle_artifact, monkeypatch):
    monkeypatch.setenv("TVM_LAYERFUSE_THREAD_POOL", "tbb")
    with pytest.raises(ArtifactError) as e:
        load(shuffle_artifact[0])
    assert "\n" not in str(e.value) and "TVM_LAYERFUSE_THREAD_POOL='tbb'" in str(e.value) and "openmp" in str(e.value)
