"""The oneDNN conv tactic's residual add (``conv2d_add``: the ``sum`` post-op on a destination
holding the residual r) writes into r's own buffer when nothing reads r after the conv, so
no copy of r is made per inference; memory planning must know that the result is r (a
storage it hands to a later tensor while the result is still read would corrupt it). Where
r is read later, the copy stays. Compared with onnxruntime (optimisations off, rel. error
<= 1e-4) on networks whose planned storage is reused along a deep residual chain."""

import json
import re

import numpy as np
import onnx
import pytest
import tvm
from tvm import relax

from graphs import rel_err, run_runtime_only
from tvm_layerfuse.compile.build import compile_model
from tvm_layerfuse.compile.presets import resolve
from tvm_layerfuse.compile.tactics import onednn
from tvm_layerfuse.compile.tactics.onednn_inplace import INPLACE_WRAPPER, LibraryWrites, library_writes
from tvm_layerfuse.compile.tactics.use_onednn import UseOneDNNConv
from tvm_layerfuse.lowering import layerfuse_pipeline
from tvm_layerfuse.relax.pipeline import fuse_with_report
from tvm_layerfuse.testing import random_inputs, run_onnxruntime, zoo
from tvm_layerfuse.testing._builder import NetBuilder

RTOL = 1e-4
MISSING = onednn.availability()
pytestmark = pytest.mark.skipif(MISSING is not None, reason=f"oneDNN is not installed here: {MISSING}")
WRAPPER = INPLACE_WRAPPER


def _compile_and_compare(model):
    """(module after the tactic pass, the pass, the VM code of main); outputs checked against onnxruntime."""
    feeds = random_inputs(model, 0)
    expected = run_onnxruntime(model, feeds)
    chooser = UseOneDNNConv()
    mod = chooser(fuse_with_report(model, bind=True).mod)
    tgt = resolve("cpu").tvm_target()
    ex = tvm.compile(mod, target=tgt, relax_pipeline=layerfuse_pipeline(tgt))
    out = relax.VirtualMachine(ex, tvm.cpu())["main"](*[tvm.runtime.tensor(v) for v in feeds.values()])
    got = [out] if hasattr(out, "numpy") else list(out)
    for e, g in zip(expected, got, strict=True):
        assert np.abs(e).max() > 1e-3, "dead output: the comparison would prove nothing"
        assert rel_err(g.numpy(), e) <= RTOL
    other = dict(feeds)
    name = next(iter(other))
    other[name] = other[name][..., ::-1].copy()
    assert rel_err(run_onnxruntime(model, other)[0], expected[0]) > 1e-2, "the output does not depend on the input"
    return mod, chooser, ex.as_text().split("\n\n", 1)[0]


def _inplace_calls(mod) -> list:
    """The residual convs of main that write into their residual (call_tir_inplace to the wrapper)."""
    calls = []

    def visit(e):
        if isinstance(e, relax.Call) and getattr(e.op, "name", "") == "relax.call_tir_inplace":
            calls.append(e)

    relax.analysis.post_order_visit(mod["main"], visit)
    return [c for c in calls if c.args[0].name_hint.startswith(WRAPPER)]


def test_residual_chain_writes_into_the_residual_and_matches_onnxruntime():
    """ResNet-50's bottlenecks (9 blocks): every residual is read by the block's first conv
    (and the projection) before the add, so all 9 adds run in place; the planner reuses
    storage across the chain (fewer storages than tensors) and the answer is unchanged."""
    model = zoo.resnet50(width=0.25, image=32, layers=(2, 3, 2, 2), seed=3)
    mod, chooser, code = _compile_and_compare(model)
    assert [c for _, c in chooser.residuals] == ["in-place"] * 9
    assert len(_inplace_calls(mod)) == 9
    assert code.count(f"call  {WRAPPER}") == 9
    assert "layerfuse.onednn.conv2d_add " not in code  # no call with a copy of r left
    storages = len(re.findall(r"vm\.builtin\.alloc_storage", code))
    tensors = len(re.findall(r"vm\.builtin\.alloc_tensor", code))
    assert storages < tensors, f"{storages} storages for {tensors} tensors: no reuse, the aliasing goes unchecked"


def _residual_read_later(case: str, *, seed: int = 5, channels: int = 24):
    """t = relu(conv1(x)) (24 channels, not a multiple of the block width 16 (12 with block
    width 8): plain, no shared blocked copy); y = relu(conv2(u) + t)
    with u = t (``case`` "operand": the conv reads its residual) or u = relu(conv1b(x));
    out = relu(conv3(t) + y): conv3 reads t after the first add, which keeps its copy of t;
    y's last reader is the second add (in place). "output": conv3 reads u, and t is a model
    output (its only later reader is the caller)."""
    b = NetBuilder(f"resid_{case}", seed=seed)
    x = b.input("input", (1, 16, 12, 12))
    with b.scope("c1"):
        t = b.relu(b.conv(x, channels, 3, pad=1))
    u = t
    if case != "operand":
        with b.scope("c1b"):
            u = b.relu(b.conv(x, channels, 1))
    with b.scope("c2"):
        y = b.relu(b.add(b.conv(u, channels, 3, pad=1), t))
    with b.scope("c3"):
        z = b.relu(b.add(b.conv(u if case == "output" else t, channels, 1), y))
    return b.build({"output": z, "t": t} if case == "output" else {"output": z})


KEPT = {
    "later": "read after the conv",
    "operand": "the conv reads the residual as an operand too",
    "output": "read after the conv",
}


@pytest.mark.parametrize("case", sorted(KEPT))
def test_residual_read_later_keeps_the_copy(case):
    channels = 24 if onednn.block_width() == 16 else 12  # not a multiple of the block width
    mod, chooser, code = _compile_and_compare(_residual_read_later(case, channels=channels))
    choices = [c for _, c in chooser.residuals]
    assert sorted(choices)[0] == "in-place" and len(choices) == 2, choices
    assert KEPT[case] in sorted(choices)[1], choices
    assert len(_inplace_calls(mod)) == 1
    assert code.count("call  layerfuse.onednn.conv2d_add ") == 1  # the copying call is still there
    # bytes written (compile report, bench_tactics --bytes): the copy of r counts, in place nothing extra
    tensor_bytes = 1 * channels * 12 * 12 * 4
    (inplace,) = _inplace_calls(mod)
    assert library_writes(inplace) == LibraryWrites(computed=tensor_bytes, copied=0, scratch=0, residual=0)
    residual_copies = [library_writes(b.value).residual for b in mod["main"].body.blocks[0].bindings if library_writes(b.value)]
    assert sorted(r for r in residual_copies if r) == [tensor_bytes]


def _odd_channels_net(seed: int = 9, block: int = 16):
    """MobileNet-V2-like, channels not multiples of the block width B (16; with B = 8 every
    count below halved): t = relu(conv(x)) 24 ch; an inverted residual on t (expand 24->48,
    depthwise, project 48->24 + t); sigmoid(conv) 40 ch; a 1x1 down to 8 ch (C < B: stays
    plain); relu(conv) 32 ch; global average; classifier."""
    b = NetBuilder("odd_channels", seed=seed)
    x = b.input("input", (1, 16, 14, 14))
    k = block // 8  # 24 * k // 2: 24 channels with B = 16, 12 with B = 8
    with b.scope("c1"):
        t = b.relu(b.conv(x, 12 * k, 3, pad=1))
    with b.scope("expand"):
        y = b.clip(b.conv(t, 24 * k, 1))
    with b.scope("dw"):
        y = b.clip(b.conv(y, 24 * k, 3, pad=1, groups=24 * k))
    with b.scope("project"):
        y = b.add(b.conv(y, 12 * k, 1), t)
    with b.scope("c3"):
        y = b.sigmoid(b.conv(y, 20 * k, 3, pad=1))
    with b.scope("c4"):
        y = b.conv(y, 4 * k, 1)
    with b.scope("c5"):
        y = b.relu(b.conv(y, 32, 3, pad=1))
    y = b.flatten(b.global_avgpool(y))
    with b.scope("fc"):
        y = b.linear(y, 10)
    return b.build({"output": y})


def test_channels_not_a_multiple_of_16_stay_blocked_padded():
    """Tensors of 24 and 40 channels (12 and 20 with the block width B = 8) between oneDNN
    convs keep padded nChwBc (no reorder in any call: every conv reads and writes blocked
    bytes); 8 channels (4) stay plain (padding would double the reading conv's work); the
    residual of 24 (12) channels is still in place."""
    block = onednn.block_width()
    assert block in (8, 16), block
    k = block // 8
    mod, chooser, code = _compile_and_compare(_odd_channels_net(block=block))
    convs = [c for c in chooser.layers if c.tactic == "onednn" and not c.layer.startswith(("pool:", "dense:"))]
    b = onednn.layout_name(block)
    assert [c.layout for c in convs] == [
        f"nchw>{b}",  # the model input is plain
        f"{b}>{b}",  # expand: 24 (padded to 32) -> 48
        f"{b}>{b}",  # depthwise
        f"{b}>{b}",  # project + residual: 48 -> 24 (padded)
        f"{b}>{b}",  # sigmoid conv -> 40 (padded to 48)
        f"{b}>nchw",  # -> 8 channels: plain
        f"nchw>{b}",
    ], [(c.layer, c.layout) for c in convs]
    assert all(c.kernel.startswith(("jit", "brg")) for c in convs), [(c.layer, c.kernel) for c in convs]
    assert [c for _, c in chooser.residuals] == ["in-place"] and len(_inplace_calls(mod)) == 1
    out_channels = {}  # weight rows -> the channels of the conv's result type
    for b in mod["main"].body.blocks[0].bindings:
        v = b.value
        if isinstance(v, relax.Call) and getattr(v.op, "name", "") in ("relax.call_dps_packed", "relax.call_tir_inplace"):
            args = list(v.args[1].fields)
            if len(args) >= 4 and len(b.var.ty.shape) == 4:
                out_channels[int(args[1].ty.shape[0])] = int(b.var.ty.shape[1])
    assert out_channels[12 * k] == 16 * k and out_channels[20 * k] == 24 * k and out_channels[4 * k] == 4 * k, out_channels
    assert "to_blocked" not in code


def test_in_place_residuals_run_from_an_artifact_in_a_runtime_only_process(tmp_path):
    """The TIR wrapper finds the library's function by name at run time: an artifact loaded
    with the TVM runtime alone (no compiler) runs the in-place residual convs."""
    model = _odd_channels_net(seed=4)
    path = tmp_path / "m.onnx"
    onnx.save(model, str(path))
    out = compile_model(path, tmp_path / "art", target="cpu", progress=False)
    assert json.loads((out / "manifest.json").read_text())["tactics"]["used"] == "onednn"
    feeds = random_inputs(model, 2)
    (expected,) = run_onnxruntime(model, feeds)
    assert rel_err(run_runtime_only(out, feeds, tmp_path)["output"], expected) <= RTOL


def test_a_max_pool_between_padded_convs_keeps_them_padded():
    """ShuffleNet's stem: relu(conv) of 24 channels (12 with B = 8), a 3x3 max pool, then a
    depthwise conv and a 1x1 conv reading the pooled tensor. The pool is TVM's blocked kernel
    on the padded nChwBc bytes, so the stem conv writes blocked, both readers read blocked,
    and no call reorders (before, all of it stayed plain: a reorder out of the stem conv and
    one into each reader)."""
    block = onednn.block_width()
    assert block in (8, 16), block
    c = 12 * (block // 8)
    b = NetBuilder("padded_pool", seed=12)
    x = b.input("input", (1, 3, 32, 32))
    with b.scope("stem"):
        t = b.relu(b.conv(x, c, 3, stride=2, pad=1))
    t = b.maxpool(t, 3, 2, 1)
    with b.scope("dw"):
        u = b.conv(t, c, 3, stride=2, pad=1, groups=c)
    with b.scope("pw"):
        v = b.relu(b.conv(t, 2 * c, 1))
    with b.scope("pw2"):
        u = b.relu(b.conv(u, 2 * c, 1))
    model = b.build({"a": u, "b": v})
    mod, chooser, code = _compile_and_compare(model)
    layout = onednn.layout_name(block)
    (pool,) = [l for l in chooser.layers if l.layer.startswith("pool:")]
    assert pool.tactic == "tvm" and pool.layout == layout, pool
    convs = {l.shape.split(" w")[0]: l.layout for l in chooser.layers if l.tactic == "onednn"}
    assert convs["x[1, 3, 32, 32]"] == f"nchw>{layout}", convs  # the stem conv writes padded blocks
    assert all(lo.startswith(f"{layout}>") for sh, lo in convs.items() if sh == f"x[1, {c}, 8, 8]"), convs
    assert "to_blocked" not in code
