"""DenseNet as torchvision writes it: every dense layer concatenates all earlier features
afresh (``Concat(x0, ..., x_{i-1})``), and the block ends with ``Concat(x0, ..., x_n)``.

One block per dense block: each producer writes once at its channel offset, every concat
is a prefix view of the block (planner and lowering), and each dense layer's BatchNorm +
Relu runs inside its conv's kernel (a prologue that reads the view), so the concatenated
features are never copied or rewritten. Numbers are checked against onnxruntime.
"""

import re

import numpy as np
import pytest
import tvm
from tvm import relax

from graphs import RTOL, rel_err
from tvm_layerfuse.compile import report as compile_report
from tvm_layerfuse.lowering import InlinePrologue, concat_report, layerfuse_pipeline
from tvm_layerfuse.planner import plan
from tvm_layerfuse.relax.fuse_prologue import PROLOGUE_PREFIX, FuseConv2DPrologue
from tvm_layerfuse.relax.pipeline import fuse_with_report, run, unfused
from tvm_layerfuse.testing import zoo
from tvm_layerfuse.testing.checks import run_onnxruntime

TARGET = tvm.target.Target({"kind": "llvm", "num-cores": 2})
FULL = zoo.DENSENET121_FULL  # torchvision densenet121
SMALL = {"width": 0.25, "block_config": (2, 3), "image": 32}


@pytest.mark.parametrize("concat", ["torch", "nested"])
def test_full_densenet121_every_concat_in_place(concat):
    """Planning is cheap: the real densenet121 sizes. torch form: 58 dense-layer concats + 4
    block outputs; nested form (ONNX zoo): 58 concats."""
    model = zoo.densenet121(concat=concat, calibrate=False, **FULL)
    p = plan(model)
    concats = [n for n in model.graph.node if n.op_type == "Concat"]
    assert len(concats) == (58 + 4 if concat == "torch" else 58)
    assert p.counts()["concat_in_place"] == len(concats)
    assert p.refusals_of("concat") == []
    if concat == "torch":
        views = [l for l in p.second if l.fused.in_place and l.fused.concat.view_of]
        blocks = {l.fused.concat.view_of for l in views}
        assert len(views) == 58 and len(blocks) == 4
        # each producer writes once, into its dense block's one buffer
        writes = [t for l in p.second for t in l.fused.writes_into]
        assert len(writes) == len(set(writes)) == 58 + 4
        # and every dense layer's norm1 + relu1 is its conv1's prologue
        assert len(p.groups_of("vertical.preactivation")) == 58 + 3


def _build(mod, *, layerfuse: bool):
    pipe = layerfuse_pipeline(TARGET) if layerfuse else relax.get_default_pipeline(TARGET)
    return tvm.compile(mod, target=TARGET, relax_pipeline=pipe), pipe


@pytest.mark.parametrize("batch", [1, 2])
def test_reduced_densenet_lowering_matches_onnxruntime(batch):
    model = zoo.densenet121(concat="torch", batch=batch, seed=batch, **SMALL)
    rng = np.random.default_rng(batch)
    feeds = [{"input": rng.standard_normal((batch, 3, 32, 32)).astype(np.float32)} for _ in range(2)]
    result = fuse_with_report(model)
    fused, pipe = _build(result.mod, layerfuse=True)
    plain, _ = _build(unfused(model), layerfuse=False)
    outs = []
    for f in feeds:
        (ref,) = run_onnxruntime(model, f)
        (got,) = run(fused, [f["input"]])
        (base,) = run(plain, [f["input"]])
        assert rel_err(ref, got) <= RTOL and rel_err(ref, base) <= RTOL and rel_err(base, got) <= RTOL
        outs.append(ref)
    assert rel_err(outs[0], outs[1]) > 0.05  # live weights: two inputs, clearly different outputs
    # every concat kernel is gone: the largest of each chain plans the block, the rest are
    # prefix views (the final block's last concat is fused with norm5 by FuseOps)
    rep = pipe.inplace_report.to_dict()
    assert rep["fallback"] == 0 and rep["in_place"] == 2 and rep["prefix_views"] == 4
    # a prologue group per dense layer and transition; its normalisation is inlined
    assert len(result.report["prologues"]) == 2 + 3 + 1
    counts = concat_report(fused)
    assert counts["concat_kernels"] == 0 and counts["concat_bytes_copied"] == 0


def test_prologue_kernel_writes_no_normalised_copy():
    model = zoo.densenet121(concat="torch", batch=2, **SMALL)
    mod = fuse_with_report(model).mod
    inline = InlinePrologue()
    lowered = layerfuse_pipeline(TARGET, stop_after="StaticPlanBlockMemory")(mod)
    prologues = {gv.name_hint: f for gv, f in lowered.functions_items() if gv.name_hint.startswith(PROLOGUE_PREFIX)}
    assert len(prologues) >= 5
    for name, func in prologues.items():
        root = func.body.block
        # only the conv's own padding stage and epilogue stages: no T_multiply / T_add / relu copy
        assert all(b.name.startswith(("pad_temp", "conv2d_nchw", "T_add_intermediate")) for b in root.alloc_buffers), name
    # the pass alone reports what it inlined, three blocks (x * s, + t, relu) per kernel
    from tvm_layerfuse.relax.pipeline import lower

    before = lower(mod, target=TARGET)
    inline(before)
    assert inline.report.inlined and all(len(v) == 3 for v in inline.report.inlined.values())


def test_prologue_refused_when_the_activation_has_another_reader():
    from graphs import Net

    n = Net(seed=3)
    x = n.input("x", (1, 4, 6, 6))
    a = n.relu(n.bn(n.conv(x, 4, name="c0")))
    r = n.relu(n.bn(a, name="pre"))
    model = n.build([n.conv(r, 3, name="c1"), r])
    result = fuse_with_report(model, bind=False)
    assert result.report["prologues"] == []
    p = FuseConv2DPrologue()
    p(result.mod)
    assert p.groups == [] and len(p.refused) == 1
    assert p.refused[0]["reason"].startswith("the activation ") and p.refused[0]["reason"].endswith(" is read elsewhere too")


def test_reduced_densenet_inspect_compile_numbers():
    """``inspect --compile`` numbers: fewer kernels, no concat copy, fewer bytes written and
    less peak activation memory than TVM's default pipeline."""
    model = zoo.densenet121(concat="torch", **SMALL)
    r = compile_report.compare(model, target=TARGET)
    d, o = r["default"], r["layerfuse"]
    assert o["kernels"] <= d["kernels"] - 5  # one concat+BN+Relu kernel per dense layer gone
    assert o["conv_kernels"] == d["conv_kernels"]
    assert o["concat_bytes_copied"] == 0 and o["concat_kernels"] == 0
    assert o["bytes_written"] < d["bytes_written"] and o["activation_bytes"] < d["activation_bytes"]
    # TVM's default hides each concat inside a BatchNorm+ReLU kernel that writes the joined
    # features again; layerfuse keeps only the head's (norm5 + relu before the pooling)
    assert d["concat_fused"] == 2 + 3 + 2 and o["concat_fused"] == 1
    text = compile_report.text(r)
    assert "bytes copied by concatenates" in text and "concatenates fused into a computing kernel" in text


def test_lowering_keeps_a_prefix_concat_that_is_a_graph_output():
    from graphs import Net, feeds_for

    n = Net(seed=8)
    x = n.input("x", (2, 4, 4, 4))
    x0 = n.relu(n.conv(x, 4, name="stem"))
    d1 = n.conv(n.relu(n.bn(n.concat([x0], name="cat1"))), 2, name="d1", bias=False)
    cat2 = n.concat([x0, d1], name="cat2")
    d2 = n.conv(n.relu(n.bn(cat2)), 2, name="d2", bias=False)
    model = n.build([n.concat([x0, d1, d2], name="cat3"), cat2])
    feeds = feeds_for(model, seed=2)
    fused, pipe = _build(fuse_with_report(model).mod, layerfuse=True)
    got = run(fused, list(feeds.values()))
    for ref, out in zip(run_onnxruntime(model, feeds), got):
        assert rel_err(ref, out) <= RTOL
    concats = pipe.inplace_report.concats
    assert [c["status"] for c in concats] == ["view", "fallback", "in_place"]
    assert concats[0]["view"] == "prefix" and concats[0]["block"] == concats[2]["concat"]
    block = concats[2]["concat"]
    assert concats[1]["reason"].startswith(f"a prefix of concat {block} (whose block its inputs write into), but its output ")
    assert re.search(r"is a graph output \(binding \d+\) and needs storage of its own$", concats[1]["reason"])


@pytest.mark.slow
def test_cuda_build_of_prologue_kernels_and_prefix_views():
    """dlight schedules the prologue kernels and the retargeted views (no GPU needed to build)."""
    from tvm_layerfuse.compile.cuda import nvcc_fatbin

    tgt = tvm.target.Target({"kind": "cuda", "arch": "sm_90"}, host={"kind": "llvm"})
    mod = fuse_with_report(zoo.densenet121(concat="torch", batch=2, **SMALL)).mod
    pipe = layerfuse_pipeline(tgt)
    with nvcc_fatbin("sm_90"), tgt:
        ex = tvm.compile(mod, target=tgt, relax_pipeline=pipe)
    kinds, stack = [], [ex.mod]
    while stack:
        m = stack.pop()
        kinds.append(m.kind)
        stack.extend(m.imports)
    assert "cuda" in kinds  # device code was generated: dlight scheduled the new kernels
    assert pipe.inplace_report.to_dict()["prefix_views"] == 4
    assert concat_report(ex)["concat_bytes_copied"] == 0


def test_prologue_before_a_padded_3x3_conv_matches_onnxruntime():
    """Pre-activation ResNet style: the normalisation is inlined into the padding stage,
    where the border stays 0 (relu of the shifted read happens only inside the image)."""
    from graphs import Net, feeds_for

    n = Net(seed=12)
    x = n.input("x", (2, 3, 6, 6))
    a = n.maxpool(x)  # not a conv: the BatchNorm cannot fold backwards, it is a prologue
    y = n.relu(n.conv(n.relu(n.bn(a, name="pre")), 5, k=3, name="c1"))  # pads 1
    model = n.build([y])
    result = fuse_with_report(model)
    (group,) = result.report["prologues"]
    assert group["function"].startswith(PROLOGUE_PREFIX) and group["absorbs"]
    from tvm_layerfuse.relax.pipeline import lower

    inline = InlinePrologue()
    inline(lower(result.mod, target=TARGET))
    assert [len(v) for v in inline.report.inlined.values()] == [3] and not inline.report.kept
    fused, pipe = _build(result.mod, layerfuse=True)
    feeds = feeds_for(model, seed=3)
    (ref,) = run_onnxruntime(model, feeds)
    (got,) = run(fused, list(feeds.values()))
    assert rel_err(ref, got) <= RTOL


@pytest.mark.slow
def test_cli_compiles_and_runs_a_torchvision_densenet(tmp_path):
    """``compile --input-shape`` (batch 2 for a model exported with a dynamic batch), then
    ``run`` (TVM runtime only): fused and ``--no-fuse`` both equal onnxruntime."""
    import subprocess
    import sys

    import onnx

    model = zoo.densenet121(concat="torch", seed=5, **SMALL)
    model.graph.input[0].type.tensor_type.shape.dim[0].dim_param = "N"  # as torch's dynamic_axes writes it
    path = tmp_path / "densenet_tv.onnx"
    onnx.save(model, str(path))
    x = np.random.default_rng(5).standard_normal((2, 3, 32, 32)).astype(np.float32)
    np.save(tmp_path / "x.npy", x)
    (expected,) = run_onnxruntime(model, {"input": x})

    def cli(*args):
        p = subprocess.run([sys.executable, "-m", "tvm_layerfuse", *args], capture_output=True, text=True, timeout=600)
        assert p.returncode == 0, p.stderr
        return p

    outs = {}
    # TVM kernels: the prefix views of the lowering are what this tests (with oneDNN convs making
    # the pieces, the library copies them into the concats instead)
    for name, extra in (("fused", ("--tactics", "tvm")), ("plain", ("--no-fuse", "--tactics", "tvm"))):
        art = tmp_path / name
        p = cli("compile", str(path), "--input-shape", "input=2,3,32,32", "-o", str(art), *extra)
        if name == "fused":
            assert "7 in-place concat" in p.stdout and "concatenate copies left: 0 (0 bytes)" in p.stdout
        cli("run", str(art), "--input", str(tmp_path / "x.npy"), "--output", str(tmp_path / f"{name}.npz"))
        with np.load(tmp_path / f"{name}.npz") as y:
            outs[name] = y["output"]
        assert rel_err(expected, outs[name]) <= RTOL
    assert rel_err(outs["plain"], outs["fused"]) <= RTOL
