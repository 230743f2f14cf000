"""DenseNet on the oneDNN tactic: a dense layer's input ``concat(x_0, y_1, ..., y_k)`` is never
materialised. The conv's prologue (pre-activation BatchNorm + ReLU) reads the pieces and writes
the normalised concatenation into its scratch, as TVM's FuseOps fuses concat + BN + ReLU into
one kernel, so the model writes fewer bytes and launches fewer kernels than with the concat
copied - and no more kernels than TVM's default pipeline. Compared with onnxruntime
(optimisations off, rel. error <= 1e-4)."""

import pytest
import tvm
from tvm import relax

from tvm_layerfuse.compile.report import activation_bytes_written, total_bytes_written
from tvm_layerfuse.compile.tactics import onednn
from tvm_layerfuse.lowering import concat_report, layerfuse_pipeline
from tvm_layerfuse.relax.pipeline import fuse_with_report, lower, unfused
from tvm_layerfuse.testing import zoo
from tvm_layerfuse.testing.checks import output_mismatches, run_onnxruntime
from tvm_layerfuse.testing.weights import assert_live

MISSING = onednn.availability()
pytestmark = pytest.mark.skipif(MISSING is not None, reason=f"oneDNN is not installed here: {MISSING}")

PRE = onednn.FUNCTIONS["conv2d_pre"]
TARGET = tvm.target.Target("llvm")


def _calls(mod: tvm.IRModule) -> list[tuple]:
    """(bound variable, library function, arguments) of every oneDNN call in ``main``, in order."""
    from tvm_layerfuse.compile.tactics.onednn_layout import onednn_call as _onednn_call

    bindings = [b for block in mod["main"].body.blocks for b in block.bindings]
    return [(b.var, *_onednn_call(b.value)) for b in bindings if _onednn_call(b.value) is not None]


def _build(model, *, pieces: bool):
    """(module after the tactic pass, executable, its concat report, bytes written, tactic choices)."""
    from tvm_layerfuse.compile.tactics.use_onednn import UseOneDNNConv

    chooser = UseOneDNNConv(pieces=pieces)
    mod = chooser(fuse_with_report(model, bind=True).mod)
    ex = tvm.compile(mod, target=TARGET, relax_pipeline=layerfuse_pipeline(TARGET))
    report = concat_report(ex)
    return mod, ex, report, total_bytes_written(activation_bytes_written(lower(mod, target=TARGET)), report), chooser.layers


@pytest.mark.parametrize(
    "batch, width",
    [
        (1, 1.0),  # growth 32: every piece a multiple of 16, the blocks in nChw16c
        (2, 0.5),  # growth 16: nChw16c pieces, two images (per image one range per piece)
        (2, 0.3),  # growth 9: plain NCHW pieces, two images
    ],
)
def test_dense_layers_read_the_pieces_of_their_input(batch, width):
    model = zoo.densenet121(width=width, image=40, seed=30 + batch, block_config=(3, 2), batch=batch)  # 10x10, 5x5
    assert_live(model)
    mod, ex, report, written, layers = _build(model, pieces=True)

    calls = _calls(mod)
    concats = {v for v, name, _ in calls if name in (onednn.CONCAT, onednn.CONCAT_CONVS)}
    pre_inputs = [args[:-5] for _, name, args in calls if name == PRE]
    assert not any(x in concats for xs in pre_inputs for x in xs), "a prologue reads a concat call's result"
    assert max(len(xs) for xs in pre_inputs) == 4, [len(xs) for xs in pre_inputs]  # the transition: x_0, y_1..y_3
    assert len(concats) == 1, calls  # the last block's: the head's BatchNorm (a TVM kernel) reads it too
    read = [c for c in layers if c.layer.startswith("concat:") and c.tactic == "read by prologues"]
    assert len(read) == 6 and all("no copy" in c.kernel for c in read), layers  # 4 + 2 dense layers' inputs

    feeds = zoo.random_inputs(model, seed=7)
    got = relax.VirtualMachine(ex, tvm.cpu())["main"](*[tvm.runtime.tensor(v) for v in feeds.values()])
    problems = output_mismatches(run_onnxruntime(model, feeds), [(got if hasattr(got, "numpy") else got[0]).numpy()])
    assert not problems, problems

    default = concat_report(unfused(model), target=TARGET, layerfuse=False)
    assert report["kernels"] <= default["kernels"], (report["kernels"], default["kernels"])
    if batch == 1:  # against the same tactics with the concats materialised
        _, _, copied, copied_written, _ = _build(model, pieces=False)
        assert report["kernels"] < copied["kernels"], (report["kernels"], copied["kernels"])
        assert written < copied_written and report["concat_bytes_copied"] < copied["concat_bytes_copied"]
        assert report["activation_bytes"] <= copied["activation_bytes"]


def _pieces_into_block(seed: int):
    """y = concat(a, c) read by a pre-activation conv p (c = conv(a): a has other readers, so
    y's pieces are read by p's prologue); p's output is a piece of z = concat(p, a), which a
    pool reads: p writes its channels of z in place (a member of kind 2 reading two pieces)."""
    from tvm_layerfuse.testing._builder import NetBuilder

    b = NetBuilder("pieces_into_block", seed=seed)
    x = b.input("input", (1, 16, 12, 12))
    with b.scope("a"):
        a = b.relu(b.conv(x, 16, 3, pad=1))
    with b.scope("c"):
        c = b.relu(b.conv(a, 32, 3, pad=1))
    with b.scope("n1"):
        y = b.relu(b.batchnorm(b.concat([a, c])))
    with b.scope("p"):
        p = b.relu(b.conv(y, 32, 1))
    z = b.concat([p, a])
    with b.scope("q"):
        q = b.flatten(b.global_avgpool(b.relu(b.conv(z, 16, 3, pad=1))))
    z = b.concat([b.flatten(b.global_avgpool(z)), q])
    with b.scope("fc"):
        out = b.linear(z, 10)
    return b.build({"output": out})


def test_a_prologue_reading_pieces_writes_its_channels_of_another_concat():
    from tvm_layerfuse.compile.tactics import abi
    from tvm_layerfuse.compile.tactics.onednn_inplace import library_writes

    model = _pieces_into_block(seed=41)
    assert_live(model)
    mod, ex, report, _, _ = _build(model, pieces=True)
    bindings = {b.var: b.value for block in mod["main"].body.blocks for b in block.bindings}
    (block,) = [v for v, name, _ in _calls(mod) if name == onednn.CONCAT_CONVS]
    spec = abi.ConcatSpec.from_shape(abi.parse_call(bindings[block]).args.attrs)
    # the prologue conv writes channels [0, 32) (reading a and c: 2 + 5 arguments), a is copied to [32, 48)
    assert [(m.kind, m.offset, m.nargs) for m in spec.members] == [(abi.CONV_PRE, 0, 7), (abi.COPY, 32, 1)], spec
    writes = library_writes(bindings[block])
    assert writes.scratch == 48 * 12 * 12 * 4 and writes.copied == 16 * 12 * 12 * 4, writes  # a and c, normalised
    # the executable's count agrees: a's copy and the head's concat of the pooled 48 + 16 features
    assert report["concat_bytes_copied"] == writes.copied + 64 * 4, report
    feeds = zoo.random_inputs(model, seed=7)
    got = relax.VirtualMachine(ex, tvm.cpu())["main"](*[tvm.runtime.tensor(v) for v in feeds.values()])
    problems = output_mismatches(run_onnxruntime(model, feeds), [(got if hasattr(got, "numpy") else got[0]).numpy()])
    assert not problems, problems
