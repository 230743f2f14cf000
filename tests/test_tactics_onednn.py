"""The oneDNN conv tactic: same answers as onnxruntime (zoo networks, random graphs), every
post-op kind, the artifact carries the library and loads it in a runtime-only process, and
the fallbacks where oneDNN is missing (compile: TVM kernels + one warning line; load: one
line naming the library and its install command)."""

import functools
import json
import logging
import re
import sys
from collections import Counter

import numpy as np
import onnx
import pytest
import tvm
from hypothesis import HealthCheck, given, settings
from tvm import relax

from graphs import Net, rel_err, run_runtime_only
from tvm_layerfuse.compile.build import compile_model
from tvm_layerfuse.compile.presets import resolve
from tvm_layerfuse.compile.tactics import abi, apply_tactics, format_tactics, onednn
from tvm_layerfuse.compile.tactics.abi import ABI_VERSION, ACTIVATIONS, ConvAttrs
from tvm_layerfuse.compile.tactics.use_onednn import NO_WINOGRAD, WINOGRAD_GAIN, UseOneDNNConv
from tvm_layerfuse.errors import ArtifactError, BuildError
from tvm_layerfuse.lowering import layerfuse_pipeline
from tvm_layerfuse.relax.pipeline import fuse_with_report, unfused
from tvm_layerfuse.runtime import load
from tvm_layerfuse.testing import cnn_graphs, random_cnn, random_inputs, run_onnxruntime, zoo

RTOL = 1e-4
MISSING = onednn.availability()
needs_onednn = pytest.mark.skipif(MISSING is not None, reason=f"oneDNN is not installed here: {MISSING}")


@functools.cache
def _winograd_here() -> int:
    """The conv algorithm with a Winograd kernel on this CPU, asked for a probe layer (3x3,
    stride 1, 32 -> 32 channels): 1 oneDNN's (oneDNN 2.6 has them for AVX-512 only), 2 the
    library's own (AVX2), 0 none."""
    if MISSING is not None:
        return 0
    width = onednn.block_width()
    attrs = ConvAttrs.make(strides=(1, 1), padding=(1, 1, 1, 1), dilation=(1, 1), groups=1)
    for algorithm in (1, 2):
        probe = attrs.replace(algorithm=algorithm, src_block=width, dst_block=width)
        kernel = onednn.implementation([1, 32, 14, 14], [32, 32, 3, 3], probe, residual=False)
        if "wino" in kernel and not kernel.startswith(("ref", "unsupported")):
            return algorithm
    return 0


def _run_with_tactic(model, *, fuse=True, winograd="timed"):
    """(max rel. error against onnxruntime over the outputs, the pass's layer choices)."""
    feeds = random_inputs(model, 0)
    expected = run_onnxruntime(model, feeds)
    mod = fuse_with_report(model, bind=True).mod if fuse else unfused(model)
    chooser = UseOneDNNConv(winograd=winograd)
    mod = chooser(mod)
    tgt = resolve("cpu").tvm_target()
    ex = tvm.compile(mod, target=tgt, relax_pipeline=layerfuse_pipeline(tgt) if fuse else relax.get_default_pipeline(tgt))
    vm = relax.VirtualMachine(ex, tvm.cpu())
    out = vm["main"](*[tvm.runtime.tensor(v) for v in feeds.values()])
    got = [out] if hasattr(out, "numpy") else list(out)
    assert len(got) == len(expected)
    errs = []
    for e, g in zip(expected, got):
        assert np.abs(e).max() > 1e-3, "dead output: the comparison would prove nothing"
        errs.append(rel_err(g.numpy(), e))
    return max(errs), chooser.layers


@needs_onednn
def test_extension_gives_optimised_kernels():
    assert onednn.version().startswith("2.")
    attrs = ConvAttrs.make(strides=(1, 1), padding=(1, 1, 1, 1), dilation=(1, 1), groups=1, act="relu")
    k = onednn.implementation([1, 64, 28, 28], [96, 64, 3, 3], attrs, residual=True)
    assert k and not k.startswith("ref"), k


@needs_onednn
@pytest.mark.parametrize("winograd", ["always", "never", "timed"])
def test_winograd_algorithm_matches_onnxruntime(winograd):
    """The conv algorithm choice: Winograd where oneDNN (AVX-512) or the library (AVX2) has a
    kernel for the layer (3x3, stride 1), direct otherwise; every choice gives onnxruntime's
    answer, and timed choices show both times. Where this CPU has no Winograd kernel, every
    layer stays direct, nothing is timed, and ``always`` records why for every 3x3 layer."""
    err, layers = _run_with_tactic(zoo.googlenet(seed=3, blocks=2), winograd=winograd)
    assert err <= RTOL
    convs = [c for c in layers if c.tactic == "onednn"]
    wino = [c for c in convs if "wino" in c.kernel]
    three = [c for c in convs if c.shape.endswith(", 3, 3]")]
    assert three, "the net has 3x3 convs"
    if winograd == "never":
        assert not wino and not any(c.timing for c in convs)
    elif not _winograd_here():
        assert not wino, [c.kernel for c in wino]
        other = [c for c in convs if c.timing and not c.timing.startswith(NO_WINOGRAD)]
        assert not other, [c.timing for c in other]
        if winograd == "always":  # the 3x3 layers say why they stay direct
            assert {c.layer for c in convs if c.timing} and {c.layer for c in convs if c.timing} <= {c.layer for c in three}
        else:
            assert not any(c.timing for c in convs)
    elif winograd == "always":
        assert wino and all(c.timing == "winograd (always)" for c in wino)
    else:
        timed = [c for c in convs if c.timing]
        assert timed, "layers are timed where a Winograd kernel exists"
        assert all(c.timing.startswith("direct ") and " ms, winograd " in c.timing for c in timed)
        assert {c.layer for c in timed} <= {c.layer for c in three}
        assert all("wino" in c.kernel for c in timed if _winograd_won(c.timing))


def _winograd_won(timing: str) -> bool:
    """The choice rule on a layer's timing text: "direct A ms, winograd B ms[; direct C ms,
    winograd D ms at N threads]", the geometric mean of B / A (and D / C) within the gain."""
    pairs = [re.match(r"direct ([0-9.]+) ms, winograd ([0-9.]+) ms", part).groups() for part in timing.split("; ")]
    mean = float(np.prod([float(b) / float(a) for a, b in pairs])) ** (1.0 / len(pairs))
    return mean <= 1.0 / WINOGRAD_GAIN


@needs_onednn
def test_compile_records_the_winograd_mode_and_every_choice(tmp_path, capsys):
    """`compile --winograd never|always`: the manifest says which mode and what each layer got."""
    from tvm_layerfuse.cli import main

    model = zoo.googlenet(seed=6, blocks=1, image=64)
    path = tmp_path / "m.onnx"
    onnx.save(model, str(path))
    feeds = random_inputs(model, 1)
    (expected,) = run_onnxruntime(model, feeds)
    kernels = {}
    for mode in ("never", "always"):
        out = tmp_path / mode
        assert main(["compile", str(path), "-o", str(out), "--winograd", mode, "-q"]) == 0
        t = json.loads((out / "manifest.json").read_text())["tactics"]
        assert t["winograd"] == mode
        assert t["block_width"] == onednn.block_width() in (8, 16)  # the layout between oneDNN calls
        kernels[mode] = [c["kernel"] for c in t["layers"] if c["tactic"] == "onednn"]
        assert rel_err(load(out).run(feeds)["output"], expected) <= RTOL
    assert not any("wino" in k for k in kernels["never"])
    if _winograd_here():
        assert any("wino" in k for k in kernels["always"])
    else:  # no Winograd kernel on this CPU: direct, and the 3x3 layers say why
        assert not any("wino" in k for k in kernels["always"]) and kernels["always"] == kernels["never"]
        t = json.loads((tmp_path / "always" / "manifest.json").read_text())["tactics"]
        assert any(c["timing"].startswith(NO_WINOGRAD) for c in t["layers"])
    capsys.readouterr()
    assert main(["inspect", str(tmp_path / "always")]) == 0
    shown = capsys.readouterr().out
    assert "Winograd: always" in shown and f"layout {onednn.layout_name(onednn.block_width())} between" in shown
    with pytest.raises(SystemExit) as e:
        main(["compile", str(path), "-o", str(tmp_path / "bad"), "--winograd", "sometimes"])
    assert e.value.code == 2
    assert not (tmp_path / "bad").exists()


@needs_onednn
@pytest.mark.parametrize("op", ["Add", "Mul"])
def test_a_conv_result_combined_with_itself_stays_correct(op):
    """conv + conv and conv * conv (found by the fuzzer: the epilogue parser had no other
    operand to look at): oneDNN gets the conv, the element-wise op stays with TVM."""
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(11)
    w = numpy_helper.from_array((rng.standard_normal((16, 16, 3, 3)) * 0.2).astype("float32"), "w")
    b = numpy_helper.from_array((rng.standard_normal(16) * 0.1).astype("float32"), "b")
    nodes = [
        helper.make_node("Conv", ["x", "w", "b"], ["c"], pads=[1, 1, 1, 1]),
        helper.make_node(op, ["c", "c"], ["y"]),
    ]
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 16, 8, 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 16, 8, 8])],
        [w, b],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    err, layers = _run_with_tactic(model)
    assert err <= RTOL
    assert any(c.tactic == "onednn" for c in layers) or any("twice" in c.reason for c in layers), layers


@needs_onednn
def test_time_conv_times_both_algorithms_and_refuses_attrs_of_the_wrong_length():
    width = onednn.block_width()
    direct = ConvAttrs.make(strides=(1, 1), padding=(1, 1, 1, 1), dilation=(1, 1), groups=1, act="relu").replace(
        src_block=width, dst_block=width
    )
    if _winograd_here():
        times = onednn.time_conv([1, 32, 14, 14], [32, 32, 3, 3], direct, direct.replace(algorithm=_winograd_here()), residual=False)
        assert len(times) == 2 and all(t > 0 for t in times), times
    if _winograd_here() != 1:  # no oneDNN Winograd kernel on this CPU: timing one is refused with oneDNN's reason
        with pytest.raises(Exception, match="oneDNN failed"):
            onednn.time_conv([1, 32, 14, 14], [32, 32, 3, 3], direct, direct.replace(algorithm=1), residual=False)
    plain = direct.replace(src_block=0, dst_block=0, act=ACTIVATIONS["silu"])  # every CPU has it
    times = onednn.time_conv([1, 32, 14, 14], [32, 32, 3, 3], direct, plain, residual=False)
    assert len(times) == 2 and all(t > 0 for t in times), times
    times = onednn.time_conv([1, 32, 14, 14], [32, 32, 3, 3], direct, plain, residual=False, threads=3)  # its own team
    assert len(times) == 2 and all(t > 0 for t in times), times
    with pytest.raises(Exception, match="threads >= 1, got 0"):
        onednn.time_conv([1, 32, 14, 14], [32, 32, 3, 3], direct, plain, residual=False, threads=0)
    n = len(ConvAttrs.names())
    with pytest.raises(Exception, match=f"attrs must have {n} entries"):
        onednn.time_conv([1, 16, 8, 8], [16, 16, 3, 3], [1] * (n - 1), [1] * (n - 1), residual=False)


def _blocked(a: np.ndarray, block: int) -> np.ndarray:
    """NCHW ``a`` as nChwBc bytes ([N, C/B, H, W, B], typed back to [N, C, H, W]); 0: as is."""
    if not block:
        return a
    n, c, h, w = a.shape
    return np.ascontiguousarray(a.reshape(n, c // block, block, h, w).transpose(0, 1, 3, 4, 2)).reshape(n, c, h, w)


@needs_onednn
@pytest.mark.parametrize("block", [0, 8, 16])
def test_scale_channels_gates_each_channel_in_either_layout_and_refuses_misfits(block):
    """``scale_channels(x, g)`` = ``x * g`` with ``g`` [N, C, 1, 1], on NCHW or nChwBc bytes
    (g's bytes are the same in both), batch 2; a gate of another shape, channels that are no
    whole blocks and attrs of the wrong length are refused in one line."""
    onednn.load()
    scale = tvm.get_global_func(abi.SCALE_CHANNELS.name)
    rng = np.random.default_rng(block)
    x = rng.standard_normal((2, 32, 5, 3)).astype(np.float32)
    g = rng.uniform(0.5, 2.0, (2, 32, 1, 1)).astype(np.float32)
    out = tvm.runtime.empty(x.shape, "float32")
    scale(tvm.runtime.tensor(_blocked(x, block)), tvm.runtime.tensor(g), tvm.runtime.ShapeTuple([block]), out)
    np.testing.assert_array_equal(out.numpy(), _blocked(x * g, block))
    with pytest.raises(Exception, match="gate must be"):
        scale(tvm.runtime.tensor(x), tvm.runtime.tensor(g[:1]), tvm.runtime.ShapeTuple([block]), out)
    odd = tvm.runtime.tensor(x[:, :20].copy())
    if block:
        with pytest.raises(Exception, match="multiple of"):
            scale(odd, tvm.runtime.tensor(g[:, :20].copy()), tvm.runtime.ShapeTuple([block]), tvm.runtime.empty(odd.shape, "float32"))
    with pytest.raises(Exception, match="attrs must have 1 entry"):
        scale(tvm.runtime.tensor(x), tvm.runtime.tensor(g), tvm.runtime.ShapeTuple([block, 0]), out)


@needs_onednn
@pytest.mark.parametrize("src_blocked, residual", [(True, False), (False, False), (True, True)])
def test_a_one_pixel_conv_between_layouts_matches_numpy(src_blocked, residual):
    """The 1x1 convs of a squeeze-and-excitation block on ``[N, C, 1, 1]``, one side blocked and
    the other plain, with channels that are no whole blocks (24 -> 40: padded in the blocked
    layout, which the kernel then takes for the plain side too, copied into and out of it by
    the library), batch 2, called twice with new inputs: ``relu(x @ W^T + b [+ r])`` per image."""
    import tvm_ffi

    onednn.load()
    block = onednn.block_width()
    conv = tvm.get_global_func("layerfuse.onednn.conv2d_add" if residual else "layerfuse.onednn.conv2d")
    rng = np.random.default_rng(24)
    w = rng.standard_normal((40, 24, 1, 1)).astype(np.float32)
    b = rng.standard_normal(40).astype(np.float32)
    attrs = ConvAttrs.make(strides=(1, 1), padding=(0, 0, 0, 0), dilation=(1, 1), groups=1, act="relu").replace(
        src_block=block if src_blocked else 0, dst_block=0 if src_blocked else block
    )
    for layer in (5, 6):  # each a new layer, its buffers made where NaN-filled memory was just freed
        dirty = [tvm.runtime.tensor(np.full((2, n, 1, 1), np.nan, np.float32)) for n in (24, 32, 40, 48) for _ in range(8)]
        del dirty
        attrs = attrs.replace(layer=layer)
        x = rng.standard_normal((2, 24, 1, 1)).astype(np.float32)
        r = rng.standard_normal((2, 40, 1, 1)).astype(np.float32)
        want = np.maximum(x[:, :, 0, 0] @ w[:, :, 0, 0].T + b + (r[:, :, 0, 0] if residual else 0), 0)[:, :, None, None]
        assert (want > 0).mean() > 0.3, "dead output"
        xs = _padded_blocked(x, block) if src_blocked else x
        out = tvm.runtime.empty(want.shape if src_blocked else _padded_blocked(want, block).shape, "float32")
        args = [tvm.runtime.tensor(xs), tvm.runtime.tensor(w), tvm.runtime.tensor(b)]
        args += [tvm.runtime.tensor(r)] if residual else []
        conv(*args, tvm_ffi.Shape(attrs.values()), out)
        got = out.numpy() if src_blocked else out.numpy()[:, :40]  # padded nChwBc, one pixel: channel c at n * ceilB(O) + c
        assert rel_err(got, want) <= RTOL


def _activated(act: str, v: np.ndarray, alpha: float = 0.0, beta: float = 0.0) -> np.ndarray:
    return {
        "relu": lambda: np.where(v > 0, v, alpha * v),
        "silu": lambda: v / (1 + np.exp(-v)),
        "sigmoid": lambda: 1 / (1 + np.exp(-v)),
        "hardsigmoid": lambda: np.clip(alpha * v + beta, 0, 1),
    }[act]()


@needs_onednn
@pytest.mark.parametrize(
    "block, dst_block, acts",
    [(0, 0, ("relu", "hardsigmoid")), ("width", 0, ("silu", "sigmoid")), ("width", "width", ("relu", "hardsigmoid"))],
)
def test_se_gate_is_the_pool_and_two_one_pixel_convs_in_either_layout(block, dst_block, acts):
    """``se_gate(x, W1, b1, W2, b2)`` = ``act2(W2 act1(W1 mean_hw(x) + b1) + b2)`` per image,
    batch 2, 24 channels (no whole blocks: x and the gate in padded ``nChwBc`` where their
    widths say so, the gate's pad channels 0), against numpy; misfit shapes refused in one line."""
    import tvm_ffi

    onednn.load()
    width = onednn.block_width()
    block, dst_block = (width if b == "width" else b for b in (block, dst_block))
    gate = tvm.get_global_func(abi.SE_GATE.name)
    rng = np.random.default_rng(31)
    x = rng.standard_normal((2, 24, 5, 7)).astype(np.float32) + rng.standard_normal((2, 24, 1, 1)).astype(np.float32)
    w1 = (rng.standard_normal((6, 24, 1, 1)) * 0.5).astype(np.float32)
    b1 = rng.standard_normal(6).astype(np.float32) * 0.1
    w2 = rng.standard_normal((24, 6, 1, 1)).astype(np.float32)
    b2 = rng.standard_normal(24).astype(np.float32) * 0.1
    (a1, a2), hs = acts, (1 / 6, 0.5)
    h = _activated(a1, x.mean(axis=(2, 3)) @ w1[:, :, 0, 0].T + b1)
    alpha, beta = hs if a2 == "hardsigmoid" else (0.0, 0.0)
    want = _activated(a2, h @ w2[:, :, 0, 0].T + b2, alpha, beta)
    assert want.std() > 0.05 and (h > 0).mean() > 0.2, "dead gate"
    attrs = abi.SeGateAttrs(
        block=block, dst_block=dst_block, squeeze_act=ACTIVATIONS[a1], gate_act=ACTIVATIONS[a2],
        gate_alpha_bits=abi.float_bits(alpha), gate_beta_bits=abi.float_bits(beta),
    )
    xs = _padded_blocked(x, block)
    out = tvm.runtime.empty((2, -(-24 // dst_block) * dst_block if dst_block else 24, 1, 1), "float32")
    args = [tvm.runtime.tensor(a) for a in (xs, w1, b1, w2, b2)]
    gate(*args, tvm_ffi.Shape(attrs.values()), out)
    got = out.numpy()[:, :, 0, 0]
    assert rel_err(got[:, :24], want) <= RTOL
    assert not got[:, 24:].any(), "pad channels of the gate not 0"
    with pytest.raises(Exception, match="se_gate: input"):
        gate(tvm.runtime.tensor(x[:, :16].copy()), *args[1:], tvm_ffi.Shape(attrs.values()), out)


def _padded_blocked(a: np.ndarray, block: int) -> np.ndarray:
    """``a`` [N, C, H, W] as padded nChwBc bytes, typed [N, ceilB(C), H, W] (pad channels 0)."""
    if not block:
        return a
    pad = -a.shape[1] % block
    return _blocked(np.pad(a, [(0, 0), (0, pad), (0, 0), (0, 0)]), block)


@needs_onednn
@pytest.mark.parametrize("left, right, dst", [(0, 0, 0), (0, 16, 16), (16, 16, 0), (8, 8, 8), (16, 0, 16)])
@pytest.mark.parametrize("first, length", [(0, 116), (0, 58), (58, 58), (3, 40)])
def test_shuffle_gathers_its_channel_range_in_every_layout(left, right, dst, first, length):
    """``shuffle(a, b)`` = channels [first, first + length) of ``reshape(transpose(reshape(concat(a,
    b), [N, 2, C, H, W]), [0, 2, 1, 3, 4]), [N, 2C, H, W])``, batch 2, each of a, b and the result
    plain or (padded) nChwBc; a result's pad channels are 0; channel counts that do not match
    the attrs are refused in one line."""
    onednn.load()
    shuffle = tvm.get_global_func(abi.SHUFFLE.name)
    rng = np.random.default_rng(first + length + left + right + dst)
    a, b = (rng.standard_normal((2, 58, 5, 3)).astype(np.float32) for _ in range(2))
    y = np.concatenate([a, b], 1).reshape(2, 2, 58, 5, 3).transpose(0, 2, 1, 3, 4).reshape(2, 116, 5, 3)
    want = _padded_blocked(y[:, first : first + length], dst)
    attrs = abi.ShuffleAttrs(channels=58, first=first, length=length, left_block=left, right_block=right, dst_block=dst)
    out = tvm.runtime.empty(want.shape, "float32")
    args = [tvm.runtime.tensor(_padded_blocked(a, left)), tvm.runtime.tensor(_padded_blocked(b, right))]
    shuffle(*args, tvm.runtime.ShapeTuple(attrs.values()), out)
    np.testing.assert_array_equal(out.numpy(), want)
    wider = tvm.runtime.empty((2, want.shape[1] + (dst or 1), 5, 3), "float32")  # one channel (block) too many
    with pytest.raises(Exception, match="channel dims do not match"):
        shuffle(*args, tvm.runtime.ShapeTuple(attrs.values()), wider)


@needs_onednn
@pytest.mark.parametrize(
    "builder, kind",
    [
        (lambda: zoo.resnet50(seed=4), "_add_relu"),  # the residual as oneDNN's sum post-op
        (lambda: zoo.mobilenet_v2(seed=5), "_clip"),  # ReLU6; depthwise convs
    ],
    ids=["resnet50", "mobilenet_v2"],
)
def test_zoo_nets_match_onnxruntime(builder, kind):
    err, layers = _run_with_tactic(builder())
    assert err <= RTOL
    assert sum(c.tactic == "onednn" for c in layers) >= 10
    assert any(kind in c.layer for c in layers if c.tactic == "onednn")
    assert not any(c.kernel.startswith("ref") for c in layers)


@needs_onednn
def test_tensors_between_onednn_layers_stay_blocked():
    """ResNet bottlenecks: conv -> conv edges (and residuals) in the blocked layout of this
    CPU's kernels (nChw16c with AVX-512, nChw8c with AVX2), no reorder between."""
    width = onednn.block_width()
    assert width in (8, 16), "oneDNN has blocked kernels on every x86-64 CPU with SSE4.1"
    blocked = onednn.layout_name(width)
    err, layers = _run_with_tactic(zoo.resnet50(seed=8, width=0.25))
    assert err <= RTOL
    layouts = Counter(c.layout for c in layers if c.tactic == "onednn")
    assert layouts[f"{blocked}>{blocked}"] >= 8, layouts
    assert all(
        c.kernel.startswith(("jit", "brg")) or abi.is_own_winograd(c.kernel) for c in layers if c.tactic == "onednn" and blocked in c.layout
    )
    assert not any("nChw" in c.layout and blocked not in c.layout for c in layers), layouts


@needs_onednn
@pytest.mark.parametrize(
    "build",
    [
        lambda: zoo.resnet18(seed=21, width=0.25),  # basic blocks, residuals: 16..128 channels
        lambda: zoo.mobilenet_v2(seed=22),  # depthwise convs, 8/16/24... channels, ReLU6
        lambda: zoo.densenet121(seed=23, width=0.5, block_config=(2, 2)),  # prologues, concats, pools
    ],
    ids=["resnet18", "mobilenet_v2", "densenet121"],
)
def test_no_layer_gets_a_reference_kernel_and_blocked_layouts_use_the_block_width(build):
    """On any CPU (AVX2 here: oneDNN's kernels take nChw8c, and nChw16c only its reference
    kernel ``ref:any``, a hundred times slower): every oneDNN layer's blocked layout is the
    library's block width, and no layer records a ``ref:`` kernel as taken."""
    width = onednn.block_width()
    assert width in (8, 16), "oneDNN has blocked kernels on every x86-64 CPU with SSE4.1"
    blocked = onednn.layout_name(width)
    err, layers = _run_with_tactic(build())
    assert err <= RTOL
    taken = [c for c in layers if c.tactic == "onednn"]
    assert len(taken) >= 8, layers
    refs = [(c.layer, c.layout, c.kernel) for c in layers if c.kernel.startswith(("ref", "unsupported"))]
    assert not refs, refs
    layouts = {part for c in taken if c.layout for part in c.layout.replace(">", ",").split(",")}
    assert blocked in layouts and layouts <= {blocked, "nchw"}, layouts
    assert all(c.kernel.startswith(("jit", "brg")) or abi.is_own_winograd(c.kernel) for c in taken if blocked in c.layout), taken


@needs_onednn
def test_attrs_with_an_unknown_block_width_are_refused():
    attrs = ConvAttrs().replace(src_block=1)  # the old 0/1 flag, not a width (replace() does not check)
    with pytest.raises(Exception, match="block width must be 0, 8 or 16, got 1"):
        onednn.implementation([1, 16, 8, 8], [16, 16, 3, 3], attrs, residual=False)


@needs_onednn
@pytest.mark.parametrize("seed", [1, 4, 7, 12])
def test_random_graphs_match_onnxruntime(seed):
    err, layers = _run_with_tactic(random_cnn(seed, max_layers=8))
    assert err <= RTOL
    assert all(c.tactic in ("onednn", "tvm", "loop") for c in layers)
    assert all(c.reason for c in layers if c.tactic == "tvm")  # every refusal says why


def _activation_chain() -> onnx.ModelProto:
    """One conv per activation form the library takes as a post-op (Relu, Clip, LeakyRelu,
    SiLU written x * Sigmoid(x), and a residual sum then Relu), in one chain."""
    n = Net(seed=21)
    x = n.input("x", (1, 8, 10, 10))
    a = n.relu(n.conv(x, 16, name="relu"))
    b = n.node("Clip", [n.conv(a, 16, name="clip"), n.const(np.float32(0.0)), n.const(np.float32(6.0))])
    c = n.node("LeakyRelu", [n.conv(b, 16, name="leaky")], alpha=0.1)
    d = n.conv(c, 16, name="silu")
    e = n.node("Mul", [d, n.node("Sigmoid", [d])])
    return n.build([n.relu(n.node("Add", [n.conv(e, 16, name="res"), e]))])


@needs_onednn
def test_every_activation_post_op():
    """Relu, Clip, LeakyRelu, SiLU and the residual sum, each run by oneDNN."""
    err, layers = _run_with_tactic(_activation_chain())
    assert err <= RTOL
    seen = Counter(c.layer.split("layerfuse_conv2d_")[-1].rstrip("_0123456789") for c in layers if c.tactic == "onednn")
    assert {"bias_relu", "bias_clip", "bias_leakyrelu", "bias_silu", "bias_add_relu"} <= set(seen), seen
    assert all(c.tactic == "onednn" for c in layers), [(c.layer, c.reason) for c in layers]


@needs_onednn
@pytest.mark.parametrize("padded", [False, True])
def test_a_silu_conv_is_the_library_pass_right_over_the_float_range(padded):
    """A conv whose activation is SiLU runs oneDNN's kernel without the swish post-op, then the
    library's vectorised pass (``implementation`` says so; relu stays a post-op): every element
    right to float precision from -150 to 150 (e^-y clamped where it would overflow) and a NaN
    kept a NaN, batch 2, plain or padded nChwBc output (pad channels stay 0 but for the NaN pixel), a tensor large
    enough for the threaded pass and a tail of two floats past the vector steps."""
    onednn.load()
    width = onednn.block_width()
    dst = width if padded else 0
    n, c, o, h, w = 2, 4, 17, 45, 45
    attrs = ConvAttrs.make(strides=(1, 1), padding=(0, 0, 0, 0), dilation=(1, 1), groups=1, act="silu").replace(dst_block=dst)
    kernel = onednn.implementation([n, c, h, w], [o, c, 1, 1], attrs, residual=False)
    assert kernel.endswith(abi.OWN_SILU_SUFFIX), kernel
    relu = onednn.implementation([n, c, h, w], [o, c, 1, 1], attrs.replace(act=ACTIVATIONS["relu"]), residual=False)
    assert not relu.endswith(abi.OWN_SILU_SUFFIX), relu
    rng = np.random.default_rng(3)
    x = rng.uniform(-1.0, 1.0, (n, c, h, w)).astype(np.float32)
    x[1, :, 7, 9] = np.nan
    wt = rng.uniform(-40.0, 40.0, (o, c, 1, 1)).astype(np.float32)
    b = rng.uniform(-5.0, 5.0, o).astype(np.float32)
    shape = (n, -(-o // width) * width, h, w) if padded else (n, o, h, w)

    def conv(a) -> np.ndarray:  # NCHW, the pad channels checked to be 0 and dropped
        out = tvm.runtime.empty(shape, "float32")
        args = [tvm.runtime.tensor(x), tvm.runtime.tensor(wt), tvm.runtime.tensor(b), tvm.runtime.ShapeTuple(a.values())]
        tvm.get_global_func(abi.CONV2D.name)(*args, out)
        got = out.numpy()
        if not padded:
            return got
        full = got.reshape(n, shape[1] // width, h, w, width).transpose(0, 1, 4, 2, 3).reshape(shape)
        pad = full[:, o:].copy()
        pad[1, :, 7, 9] = 0  # oneDNN's zero pad weights times the NaN pixel
        assert np.array_equal(pad, np.zeros_like(pad)), "pad channels written"
        return full[:, :o]

    y = conv(attrs.replace(act=ACTIVATIONS["none"])).astype(np.float64)  # the same kernel's sums
    with np.errstate(over="ignore", invalid="ignore"):
        want = y / (1.0 + np.exp(-y))
    finite = np.isfinite(y)
    assert (y[finite] < -90).any() and (y[finite] > 90).any() and (np.abs(want[finite]) > 1e-3).mean() > 0.5
    got = conv(attrs)
    assert np.isnan(got[1, :, 7, 9]).all() and np.array_equal(np.isnan(got), ~finite)
    np.testing.assert_allclose(got, want.astype(np.float32), rtol=5e-7, atol=1e-30)


@needs_onednn
def test_fusion_off_with_the_same_tactic():
    err, layers = _run_with_tactic(zoo.googlenet(seed=2, blocks=2), fuse=False)
    assert err <= RTOL and all(c.tactic == "onednn" for c in layers) and layers


@needs_onednn
def test_artifact_carries_the_library_and_runs_runtime_only(tmp_path, capsys):
    model = zoo.squeezenet1_1(image=32, seed=3)
    path = tmp_path / "m.onnx"
    onnx.save(model, str(path))
    out = compile_model(path, tmp_path / "art", target="cpu", progress=False)
    m = json.loads((out / "manifest.json").read_text())
    t = m["tactics"]
    assert t["used"] == "onednn" and t["counts"]["onednn"] == 26  # 26 conv layers
    assert t["counts"]["tvm"] == 4  # 3 max-pools and the global average: TVM's kernels, in the library's layout
    (entry,) = t["libraries"]
    expected = {"file": onednn.LIBRARY_FILE, "needs": [onednn.SONAME], "install": onednn.INSTALL, "abi_version": ABI_VERSION}
    assert {k: entry[k] for k in expected} == expected and entry["built_against"]["version"].startswith("2.")
    assert onednn.LIBRARY_FILE in m["files"] and (out / onednn.LIBRARY_FILE).is_file()
    text = format_tactics(t)
    assert "onednn: 26 layers" in text and "ref:" not in text and "avx" in text
    from tvm_layerfuse.cli import main

    assert main(["inspect", str(out)]) == 0  # inspect of an artifact shows every layer's tactic
    shown = capsys.readouterr().out
    assert "target cpu" in shown and "onednn: 26 layers" in shown and shown.count("onednn ") >= 26 and shown.count("blocked pool") == 3
    feeds = random_inputs(model, 9)
    (expected,) = run_onnxruntime(model, feeds)
    assert rel_err(run_runtime_only(out, feeds, tmp_path)["output"], expected) <= RTOL


@needs_onednn
def test_squeeze_excitation_gates_run_on_the_library_in_an_artifact(tmp_path):
    """EfficientNet's blocks (SiLU depthwise convs, squeeze-and-excitation gates) through
    compile -> artifact -> a runtime-only process, against onnxruntime: every gate is the
    library's ``scale_channels``, in the blocked layout where its channels are whole blocks
    (plain otherwise), and the depthwise conv that makes a blocked gated tensor keeps that
    layout (no reorder between them)."""
    model = zoo.efficientnet_like(seed=5)
    path = tmp_path / "m.onnx"
    onnx.save(model, str(path))
    out = compile_model(path, tmp_path / "art", target="cpu", progress=False)
    layers = json.loads((out / "manifest.json").read_text())["tactics"]["layers"]
    width = onednn.block_width()
    blocked = onednn.layout_name(width)

    def channels(c) -> int:  # C of the gate's x[1, C, H, W]
        return int(c["shape"].split(",")[1])

    scales = [c for c in layers if c["layer"].startswith("scale:")]
    blocks = sum(n for *_, n in zoo.EFFICIENTNET_SMALL)
    assert len(scales) == blocks and all(c["tactic"] == "loop" for c in scales), scales
    assert all(c["layout"] == (blocked if channels(c) % width == 0 else "nchw") for c in scales), scales
    assert sum(c["layout"] == blocked for c in scales) >= blocks - 1, scales  # all but the first block's 8 or 16 channels
    gated = {c["shape"].split(" g")[0] for c in scales if c["layout"] == blocked}  # x[1, C, H, W] of each blocked gate
    depthwise = [c for c in layers if c["tactic"] == "onednn" and c["layer"].startswith("layerfuse_conv2d_bias_silu")]
    assert all(c["layout"].endswith(">" + blocked) for c in depthwise if c["shape"].split(" w")[0] in gated)
    feeds = random_inputs(model, 4)
    (expected,) = run_onnxruntime(model, feeds)
    assert np.abs(expected).max() > 1e-3, "dead output"
    assert rel_err(run_runtime_only(out, feeds, tmp_path)["output"], expected) <= RTOL


@needs_onednn
def test_missing_onednn_at_load_is_one_line(tmp_path):
    model = random_cnn(4, max_layers=4)
    path = tmp_path / "m.onnx"
    onnx.save(model, str(path))
    out = compile_model(path, tmp_path / "art", target="cpu", progress=False)
    mpath = out / "manifest.json"
    m = json.loads(mpath.read_text())
    m["tactics"]["libraries"][0]["needs"] = ["libdnnl_absent.so.2"]  # a machine without it
    mpath.write_text(json.dumps(m))
    with pytest.raises(ArtifactError) as e:
        load(out)
    msg = str(e.value)
    assert "\n" not in msg and "libdnnl_absent.so.2" in msg and onednn.INSTALL in msg


def test_without_onednn_compile_uses_tvm_with_one_warning(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("TVM_LAYERFUSE_ONEDNN_ROOT", str(tmp_path / "no-onednn"))
    assert onednn.availability() is not None
    model = random_cnn(7, max_layers=5)
    path = tmp_path / "m.onnx"
    onnx.save(model, str(path))
    with caplog.at_level(logging.WARNING):
        out = compile_model(path, tmp_path / "art", target="cpu", progress=False)
    warnings = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1 and "\n" not in warnings[0].getMessage() and onednn.INSTALL_DEV in warnings[0].getMessage()
    m = json.loads((out / "manifest.json").read_text())
    assert m["tactics"]["used"] == "tvm" and m["tactics"]["libraries"] == []
    assert set(m["files"]) == {"model.so", "params.npz"}
    feeds = random_inputs(model, 2)
    for e, g in zip(run_onnxruntime(model, feeds), load(out).run(feeds).values()):
        assert rel_err(g, e) <= RTOL
    with pytest.raises(BuildError) as err:
        apply_tactics(None, {}, resolve("cpu"), tactics="onednn")
    assert "\n" not in str(err.value) and onednn.INSTALL_DEV in str(err.value)


def test_other_targets_keep_tvm_tactics():
    mod = unfused(random_cnn(3, max_layers=3))
    out, plan = apply_tactics(mod, {}, resolve("aarch64"), tactics="auto")
    assert plan.used == "tvm" and "cross-compiled" in plan.note
    assert "layerfuse.onednn" not in out.script()


@pytest.mark.slow
@needs_onednn
def test_layers_timed_at_one_thread_answer_right_at_the_process_thread_count():
    """The Winograd choice times each 3x3 layer on one thread (``time_conv``); the model then
    runs at the process's thread count. oneDNN 2.6's primitive cache does not tell a kernel
    made for one thread from one made for two: without emptying it after the timings, a layer
    made at two threads got the one-thread kernel back (small-channel brgconv kernels on AVX-512
    Zen 5: wrong answers or std::bad_alloc at two threads), so every layer below must answer
    right after being timed."""
    n = Net(seed=31)
    x = n.input("x", (1, 28, 1, 1))  # 3x3 convs on a 1x1 map (Inception-v3's last blocks, scaled down)
    y = n.relu(n.conv(x, 24, name="a"))
    y = n.relu(n.conv(y, 24, name="b"))
    y = n.relu(n.conv(y, 24, name="c"))
    model = n.build([n.conv(y, 4, k=1, pad=0, name="head")])
    for _ in range(2):  # the second compile reuses what the first left in the caches
        err, layers = _run_with_tactic(model, winograd="timed")
        assert err <= RTOL, err
        assert sum(c.tactic == "onednn" for c in layers) == 4 and all(c.timing for c in layers if "x[1, 28" in c.shape), layers


@needs_onednn
@pytest.mark.parametrize(
    "name", ["googlenet", "inception_v3", "resnet50", "squeezenet1_1", "densenet121", "mobilenet_v2", "efficientnet_like"]
)
def test_all_zoo_nets_match_onnxruntime(name):
    err, layers = _run_with_tactic(getattr(zoo, name)(seed=6))
    assert err <= RTOL and any(c.tactic == "onednn" for c in layers)


@pytest.mark.slow
@needs_onednn
@pytest.mark.parametrize("seed", range(100, 130))
def test_many_random_graphs_match_onnxruntime(seed):
    err, _ = _run_with_tactic(random_cnn(seed))
    assert err <= RTOL


# ---------------------------------------------------------------------- differential fuzzing
def _differential(case):
    from tvm_layerfuse.testing.differential import check_case

    res = check_case(case.model, case.feeds, stages=("unfused", "tactics"))
    assert res.findings == [], "\n".join(f"{f.kind}: {f.detail}" for f in res.findings)
    assert "tactics" in res.timings  # the tactic stage ran


_PROPERTY = dict(deadline=None, derandomize=True, database=None)


@needs_onednn
@settings(max_examples=6, suppress_health_check=list(HealthCheck), **_PROPERTY)
@given(cnn_graphs(max_layers=6))
def test_differential_fuzzing_covers_the_tactic_choice(case):
    _differential(case)


@pytest.mark.slow
@needs_onednn
@settings(max_examples=120, suppress_health_check=list(HealthCheck), **_PROPERTY)
@given(cnn_graphs(max_layers=10, max_channels=40))
def test_differential_fuzzing_covers_the_tactic_choice_widely(case):
    _differential(case)


def test_deploy_checks_the_tactic_library_entries_before_uploading(tmp_path):
    """Deploy uploads an artifact's tactic library (tests/test_onednn_shipping.py); an entry
    that names no file of the artifact is refused in one line before anything is sent."""
    import shutil

    from tvm_layerfuse.deploy.inputs import check_library, tactic_entries

    shutil.copyfile(sys.executable, tmp_path / "model.so")  # any x86_64 ELF
    manifest = {"library": "model.so", "target": {"machine": "x86_64"}, "tactics": {"libraries": []}, "files": {}}
    check_library(tmp_path, manifest)
    manifest["tactics"]["libraries"] = [{"file": onednn.LIBRARY_FILE, "needs": [onednn.SONAME]}]
    with pytest.raises(ArtifactError) as e:
        check_library(tmp_path, manifest)
    msg = str(e.value)
    assert "\n" not in msg and onednn.LIBRARY_FILE in msg and "re-run `compile`" in msg
    manifest["files"][onednn.LIBRARY_FILE] = "0" * 64
    check_library(tmp_path, manifest)  # shipped with the artifact: uploaded with it
    assert [e["file"] for e in tactic_entries(tmp_path, manifest)] == [onednn.LIBRARY_FILE]
