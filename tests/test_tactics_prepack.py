"""Weights the module owns: an artifact's oneDNN conv calls read their weights packed at
compile time in their primitives' layouts (compile/tactics/prepack.py), used where they lie.

* the library: a call on packed weights gives what the same call on plain weights gives, for
  one conv, a merged conv's split pieces, a grouped conv and a residual; a call whose recorded
  layout identity is not the one its primitive picks is refused in one line;
* whole artifacts, loaded by the TVM runtime alone: every conv form (split pieces, the members
  of an in-place concat, a residual in place, a depthwise conv, a prologue reading pieces) and
  the classifier (dense) read packed weights, and the outputs equal onnxruntime's;
* an artifact whose recorded identity is not what this machine's oneDNN picks (as on a CPU of
  another ISA) refuses to run, in one line, and the original still runs.

(On this project's AVX2 machines the SSE4.1 and AVX2 kernels pick the same weight layouts, and
oneDNN 2.6 has Winograd only with AVX-512, so no ISA setting here gives another layout: the
mismatch is made by editing the identity recorded in a copy of an artifact.)
"""

from __future__ import annotations

import json
import shutil
import struct

import numpy as np
import onnx
import pytest

from graphs import rel_err, run_runtime_only
from tvm_layerfuse.compile.build import compile_model
from tvm_layerfuse.compile.tactics import abi, onednn
from tvm_layerfuse.errors import ArtifactError
from tvm_layerfuse.runtime import artifact, load
from tvm_layerfuse.testing import random_inputs, run_onnxruntime
from tvm_layerfuse.testing._builder import NetBuilder

RTOL = 1e-4
MISSING = onednn.availability()
pytestmark = pytest.mark.skipif(MISSING is not None, reason=f"oneDNN is not installed here: {MISSING}")


# ---------------------------------------------------------------------- the library
def _conv(name: str, args: list) -> None:
    import tvm_ffi

    onednn.load()
    tvm_ffi.get_global_func(abi.NAMESPACE + name)(*args)


def _tensor(a: np.ndarray):
    import tvm

    return tvm.runtime.tensor(np.ascontiguousarray(a, dtype=np.float32))


def _geometry(stride: int, pad: int, groups: int = 1) -> dict:
    return dict(strides=(stride, stride), padding=(pad,) * 4, dilation=(1, 1), groups=groups)


CASES = {
    # name: (x, w, geometry, outputs' channels, residual)
    "one conv": ((1, 16, 9, 9), (24, 16, 3, 3), _geometry(1, 1), [24], False),
    "split pieces": ((2, 8, 7, 7), (40, 8, 1, 1), _geometry(1, 0), [16, 8, 16], False),
    "grouped": ((1, 32, 8, 8), (32, 8, 3, 3), _geometry(2, 1, groups=4), [32], False),
    "residual": ((1, 16, 6, 6), (16, 16, 1, 1), _geometry(1, 0), [16], True),
}


def _outputs(x_shape, w_shape, geo, channels):
    n, _, h, w = x_shape
    kh, kw = w_shape[2:]
    (sh, sw), (pt, pl, pb, pr) = geo["strides"], geo["padding"]
    oh, ow = (h + pt + pb - kh) // sh + 1, (w + pl + pr - kw) // sw + 1
    return [(n, c, oh, ow) for c in channels]


def _run(case: str, *, packed: bool, identity_delta: int = 0, seed: int = 7) -> list[np.ndarray]:
    x_shape, w_shape, geo, channels, residual = CASES[case]
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(x_shape).astype(np.float32)
    w = rng.standard_normal(w_shape).astype(np.float32)
    b = rng.standard_normal(w_shape[0]).astype(np.float32)
    outs = [_tensor(np.zeros(s, np.float32)) for s in _outputs(x_shape, w_shape, geo, channels)]
    attrs = abi.ConvAttrs.make(**geo, act="relu").replace(layer=3)
    weight = _tensor(w)
    if packed:
        identity, data = onednn.pack_weights(x_shape, w, attrs, prologue=False, residual=residual, out_channels=channels)
        attrs = attrs.packed_as(identity + identity_delta, w.shape)
        weight = _tensor(data)
    import tvm_ffi

    shape = tvm_ffi.Shape(attrs.values())
    if residual:
        (out,) = _outputs(x_shape, w_shape, geo, channels)
        r = rng.standard_normal(out).astype(np.float32)
        _conv("conv2d_add", [_tensor(x), weight, _tensor(b), _tensor(r), shape, outs[0]])
    else:
        _conv("conv2d", [_tensor(x), weight, _tensor(b), shape, *outs])
    return [o.numpy() for o in outs]


@pytest.mark.parametrize("case", sorted(CASES))
def test_packed_weights_give_what_plain_weights_give(case):
    plain = _run(case, packed=False)
    packed = _run(case, packed=True)
    assert all(np.abs(p).max() > 1e-3 for p in plain), "dead output"
    for p, q in zip(plain, packed):
        assert rel_err(q, p) <= 1e-6


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_layer_called_again_reads_the_new_calls_tensors(case):
    # the second call finds the layer (same id, shapes, attrs) and this thread's memory objects
    # made by the first; it must read its own input, weights, bias and residual, write its own outputs
    first = _run(case, packed=True, seed=7)
    again = _run(case, packed=True, seed=8)
    plain = _run(case, packed=False, seed=8)
    for f, a, p in zip(first, again, plain):
        assert rel_err(a, p) <= 1e-6 and rel_err(a, f) > 1e-2


def _dense(*, packed: bool, identity_delta: int = 0) -> np.ndarray:
    import tvm_ffi

    rng = np.random.default_rng(8)
    x = rng.standard_normal((2, 48)).astype(np.float32)
    w = rng.standard_normal((48, 20)).astype(np.float32)
    b = rng.standard_normal(20).astype(np.float32)
    attrs, weight = abi.DenseAttrs(), _tensor(w)
    if packed:
        identity, data = onednn.pack_dense_weights(2, w)
        attrs, weight = abi.DenseAttrs(packed=identity + identity_delta, k=48, m=20), _tensor(data)
    out = _tensor(np.zeros((2, 20), np.float32))
    _conv("dense", [_tensor(x), weight, _tensor(b), tvm_ffi.Shape(attrs.values()), out])
    return out.numpy()


def test_packed_dense_weights_give_what_plain_weights_give_and_another_layout_is_refused():
    plain = _dense(packed=False)
    assert np.abs(plain).max() > 1e-3 and rel_err(_dense(packed=True), plain) <= 1e-6
    with pytest.raises(ValueError, match="the dense layer: its weights were packed at compile time"):
        _dense(packed=True, identity_delta=2)


def test_packed_weights_of_another_layout_are_refused_in_one_line():
    _run("split pieces", packed=True)  # the same call, right identity: runs
    with pytest.raises(ValueError) as e:
        _run("split pieces", packed=True, identity_delta=2)
    message = str(e.value).splitlines()[0]
    assert "layer 3: its weights were packed at compile time" in message and "compile it on this machine" in message


# ---------------------------------------------------------------------- artifacts
def _net(batch: int, seed: int = 3):
    """Two 1x1 convs from one input (merged: a conv with split pieces at batch 2; at batch 1 the
    Concat they feed is made in place by its member convs), a 3x3 conv, a depthwise conv, a
    residual 1x1 conv (in place), a BatchNorm + ReLU prologue reading a concat's pieces, a pool
    and the classifier."""
    b = NetBuilder("packed", seed=seed)
    x = b.input("input", (batch, 8, 13, 13))
    with b.scope("b1"):
        p1 = b.relu(b.conv(x, 16, 1))
    with b.scope("b2"):
        p2 = b.relu(b.conv(x, 24, 1))
    with b.scope("b2b"):
        p2 = b.relu(b.conv(p2, 24, 3, pad=1))
    y = b.concat([p1, p2])
    with b.scope("dw"):
        d = b.clip(b.conv(y, 40, 3, pad=1, groups=40))
    with b.scope("proj"):
        r = b.add(b.conv(d, 40, 1), y)
    with b.scope("n1"):
        n = b.relu(b.batchnorm(b.concat([r, d])))
    with b.scope("pre"):
        q = b.relu(b.conv(n, 32, 1))
    q = b.flatten(b.global_avgpool(q))
    with b.scope("fc"):
        out = b.linear(q, 10)
    return b.build({"output": out})


@pytest.fixture(scope="module")
def artifacts(tmp_path_factory):
    base = tmp_path_factory.mktemp("packed")
    out = {}
    for batch in (1, 2):
        model = _net(batch)
        path = base / f"net{batch}.onnx"
        onnx.save(model, str(path))
        out[batch] = (compile_model(path, base / f"art{batch}", tactics="onednn", winograd="never", progress=False), model)
    return out


@pytest.mark.parametrize("batch", [1, 2])
def test_every_conv_form_reads_packed_weights_and_matches_onnxruntime(artifacts, batch, tmp_path):
    path, model = artifacts[batch]
    tactics = json.loads((path / "manifest.json").read_text())["tactics"]
    packing = tactics["packed_weights"]
    kinds = {c["tactic"] for c in tactics["layers"]}
    layouts = [c.get("layout", "") for c in tactics["layers"]]
    if batch == 1:  # the concat made in place by its members; the residual in place
        assert "in-place" in kinds, tactics["layers"]
    else:
        assert any("," in s for s in layouts), layouts  # a merged conv writing split pieces
    assert "read by prologues" in kinds, kinds
    assert packing["packed_calls"] >= 5 and len(packing["layouts"]) == packing["packed_calls"], packing
    kept = packing["kept_plain"]  # only calls whose layout oneDNN picks by the thread count (AVX-512)
    assert all("by the thread count" in k["reason"] for k in kept), kept
    assert [c["layer"] for c in packing["layouts"]].count(-1) == 1, packing["layouts"]  # the classifier (dense)
    with np.load(path / "params.npz") as params:  # no plain conv or dense weights left but those
        assert len([k for k in params.files if params[k].ndim > 1]) == len(kept), ({k: params[k].shape for k in params.files}, kept)
    feeds = random_inputs(model, 5)
    (want,) = run_onnxruntime(model, feeds)
    assert np.abs(want).max() > 1e-3, "dead output"
    assert rel_err(run_runtime_only(path, feeds, tmp_path)["output"], want) <= RTOL


def test_a_prologue_conv_writing_its_channels_of_a_concat_reads_packed_weights(tmp_path):
    """A member of kind CONV_PRE in concat_convs (its channel count read from its packed attrs)."""
    from test_tactics_prologue_pieces import _pieces_into_block

    model = _pieces_into_block(seed=41)
    onnx.save(model, str(tmp_path / "m.onnx"))
    path = compile_model(tmp_path / "m.onnx", tmp_path / "art", tactics="onednn", winograd="never", progress=False)
    tactics = json.loads((path / "manifest.json").read_text())["tactics"]
    (block,) = [c for c in tactics["layers"] if c["layer"].startswith("concat:") and c["tactic"] == "in-place"]
    assert block["kernel"].startswith("1 convs write their channels"), block
    assert tactics["packed_weights"]["packed_calls"] == 5 and tactics["packed_weights"]["kept_plain"] == []
    feeds = random_inputs(model, 7)
    (want,) = run_onnxruntime(model, feeds)
    assert rel_err(load(path).run(feeds)["output"], want) <= RTOL


def test_an_artifact_packed_for_another_layout_refuses_to_run_in_one_line(artifacts, tmp_path):
    path, model = artifacts[2]
    manifest = json.loads((path / "manifest.json").read_text())
    other = tmp_path / "other"
    shutil.copytree(path, other)
    # the identity the compiled model passes one call (a 64-bit constant of the library file)
    first = manifest["tactics"]["packed_weights"]["layouts"][0]
    code = (other / manifest["library"]).read_bytes()
    recorded = struct.pack("<q", first["identity"])
    assert code.count(recorded) == 1
    (other / manifest["library"]).write_bytes(code.replace(recorded, struct.pack("<q", first["identity"] ^ 2)))
    manifest["files"] = {name: artifact.sha256_file(other / name) for name in manifest["files"]}
    (other / "manifest.json").write_text(json.dumps(manifest))
    feeds = random_inputs(model, 5)
    (want,) = run_onnxruntime(model, feeds)
    with pytest.raises(ArtifactError) as e:
        load(other).run(feeds)
    message = str(e.value)
    assert "\n" not in message, message
    assert f"layer {first['layer']}: its weights were packed at compile time" in message and "compile it on this machine" in message
    assert rel_err(load(path).run(feeds)["output"], want) <= RTOL  # the original still runs


# ---------------------------------------------------------------------- thread counts
def _thread_net(seed: int = 17):
    """Convs of which oneDNN 2.6 on AVX-512 lays out some weights by the thread count its
    kernels are made for (Winograd 3x3s at 28x28: another blocking at one thread than at two;
    a 1x1 conv with a residual), beside ones it does not, and the classifier."""
    b = NetBuilder("threads", seed=seed)
    x = b.input("input", (1, 96, 28, 28))
    with b.scope("w1"):
        y = b.relu(b.conv(x, 128, 3, pad=1))
    with b.scope("w2"):
        y = b.relu(b.conv(y, 96, 3, pad=1))
    with b.scope("p"):
        y = b.relu(b.add(b.conv(y, 96, 1), x))
    with b.scope("s"):
        y = b.relu(b.conv(y, 64, 3, stride=2, pad=1))
    y = b.flatten(b.global_avgpool(y))
    with b.scope("fc"):
        out = b.linear(y, 10)
    return b.build({"output": out})


def test_an_artifact_runs_at_any_thread_count(tmp_path):
    """oneDNN picks some weights layouts by the thread count a kernel is made for, so weights
    packed at the compile's count would be refused at another: such calls keep their weights
    plain (the reason names a thread count that lays them out otherwise), the rest are packed,
    and the artifact gives onnxruntime's answer at 1, 2, 3 and 65 threads (more than the 64 the
    compiler probes: the packed calls' kernels are made for 64)."""
    model = _thread_net()
    onnx.save(model, str(tmp_path / "m.onnx"))
    path = compile_model(tmp_path / "m.onnx", tmp_path / "art", tactics="onednn", winograd="always", progress=False)
    packing = json.loads((path / "manifest.json").read_text())["tactics"]["packed_weights"]
    assert packing["packed_calls"] >= 1, packing
    for kept in packing["kept_plain"]:
        assert "picks its weights layout by the thread count (another one at " in kept["reason"], kept
    feeds = random_inputs(model, 3)
    (want,) = run_onnxruntime(model, feeds)
    (other,) = run_onnxruntime(model, random_inputs(model, 4))
    assert rel_err(other, want) > 0.05, "the output hardly depends on the input"
    for threads in (1, 2, 3, 65):
        got = run_runtime_only(path, feeds, tmp_path, env={"OMP_NUM_THREADS": str(threads)})["output"]
        assert rel_err(got, want) <= RTOL, threads
