"""The tactic library's own Winograd kernels (conv algorithms 2 and 3, for kernel shapes or
CPUs where oneDNN has none): each form (F(2x2, 3x3), F(4x4, 3x3), F(2x2, 5x5), the 1-d F(2, 7)
and F(2, 3) of 1x7 / 7x1 / 1x3 / 3x1 kernels), in both of its ISAs (AVX2 on nChw8c, AVX-512
on nChw16c, where this CPU has them), every output tile, tail and panel against a NumPy
convolution, with the bias, the residual sum and each activation it takes, in either layout,
with plain and packed weights (merged pieces included); the layers they do not fit run
oneDNN's direct kernel and say so; and a model compiled with them runs in a runtime-only
process with onnxruntime's answer."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import tvm

from graphs import Net, rel_err, run_runtime_only
from tvm_layerfuse.compile.tactics import abi, onednn
from tvm_layerfuse.compile.tactics.abi import ConvAttrs
from tvm_layerfuse.testing import random_inputs, run_onnxruntime

MISSING = onednn.availability()
pytestmark = pytest.mark.skipif(MISSING is not None, reason=f"oneDNN is not installed here: {MISSING}")
OWN, OWN_4x4 = abi.CONV_ALGORITHMS["own_winograd"], abi.CONV_ALGORITHMS["own_winograd_4x4"]
RTOL = 1e-5


def _blocked(a: np.ndarray, block: int) -> np.ndarray:
    """NCHW ``a`` as nChwBc bytes ([N, C/B, H, W, B], typed back to [N, C, H, W]); 0: as is."""
    if not block:
        return a
    n, c, h, w = a.shape
    return np.ascontiguousarray(a.reshape(n, c // block, block, h, w).transpose(0, 1, 3, 4, 2)).reshape(n, c, h, w)


def _conv(x, w, b, pads, act, alpha, beta, r):
    """act(conv(x, w) + b [+ r]) in float64, as NumPy computes it."""
    pt, pl, pb, pr = pads
    xp = np.pad(x.astype(np.float64), ((0, 0), (0, 0), (pt, pb), (pl, pr)))
    win = np.lib.stride_tricks.sliding_window_view(xp, w.shape[2:], axis=(2, 3))
    y = np.einsum("ncijkl,ockl->noij", win, w.astype(np.float64), optimize=True) + b[None, :, None, None]
    if r is not None:
        y = y + r
    if act == "relu":
        y = np.where(y > 0, y, alpha * y)
    elif act == "clip":
        y = np.clip(y, alpha, beta)
    return y


def _attrs(pads, act, alpha, beta, src_block, dst_block, algorithm=OWN):
    return ConvAttrs.make(strides=(1, 1), padding=pads, dilation=(1, 1), groups=1, act=act, alpha=alpha, beta=beta).replace(
        src_block=src_block, dst_block=dst_block, algorithm=algorithm, layer=11
    )


def _own_kernel_here(block: int = 8) -> None:
    attrs = _attrs((1, 1, 1, 1), "none", 0, 0, block, block)
    kernel = onednn.implementation([1, 16, 6, 6], [16, 16, 3, 3], attrs, residual=False)
    if not abi.is_own_winograd(kernel):
        isa = {8: "AVX2 and FMA", 16: "AVX-512F"}[block]
        pytest.skip(f"the library's Winograd kernel on nChw{block}c needs {isa}; this CPU runs {kernel}")


def _in_blocks(case: tuple, block: int) -> tuple:
    """A case in blocks of ``block`` channels: C and K rounded up to whole blocks, the blocked
    sides (8 in CASES) of that width."""
    algorithm, kernel, n, c, k, h, w, pads, act, alpha, beta, residual, sb, db = case
    up = lambda v: -(-v // block) * block  # noqa: E731
    return algorithm, kernel, n, up(c), up(k), h, w, pads, act, alpha, beta, residual, sb and block, db and block


CASES = {
    # algorithm, kernel (kh, kw), n, c, k, h, w, pads, act, alpha, beta, residual, src_block, dst_block
    "2x2_3x3-one-tile-row": (OWN, (3, 3), 1, 16, 32, 7, 7, (1, 1, 1, 1), "relu", 0.0, 0.0, False, 8, 8),  # half tiles
    "2x2_3x3-batch2-leaky-residual": (OWN, (3, 3), 2, 8, 24, 9, 6, (1, 1, 1, 1), "relu", 0.1, 0.0, True, 8, 8),  # K 24: half a panel
    "2x2_3x3-many-tasks": (OWN, (3, 3), 1, 64, 64, 30, 30, (1, 1, 1, 1), "none", 0.0, 0.0, True, 8, 8),  # 225 tiles: 5 tasks
    "2x2_3x3-many-chunks": (OWN, (3, 3), 1, 16, 24, 44, 44, (1, 1, 1, 1), "relu", 0.0, 0.0, False, 8, 8),  # 484 tiles: 11-12 tasks
    "2x2_3x3-more-channels-than-tiles": (OWN, (3, 3), 1, 16, 112, 14, 14, (1, 1, 1, 1), "relu", 0.0, 0.0, True, 8, 8),  # U larger than V
    "2x2_3x3-clip-unpadded-plain": (OWN, (3, 3), 1, 32, 40, 5, 11, (0, 0, 0, 0), "clip", -0.5, 0.75, False, 0, 0),
    "2x2_3x3-asymmetric-pads": (OWN, (3, 3), 2, 24, 16, 10, 10, (2, 1, 0, 2), "none", 0.0, 0.0, False, 8, 0),
    "2x2_3x3-plain-in-residual": (OWN, (3, 3), 1, 48, 32, 8, 8, (1, 1, 1, 1), "relu", 0.0, 0.0, True, 0, 8),
    "4x4_3x3-tails": (OWN_4x4, (3, 3), 2, 16, 24, 11, 9, (1, 1, 1, 1), "relu", 0.0, 0.0, True, 8, 8),  # 4x4 tiles, 3 and 1 left
    "4x4_3x3-many-tasks": (OWN_4x4, (3, 3), 1, 32, 48, 43, 38, (0, 1, 1, 0), "none", 0.0, 0.0, False, 8, 8),
    "2x2_5x5": (OWN, (5, 5), 1, 16, 16, 13, 12, (2, 2, 2, 2), "relu", 0.0, 0.0, True, 8, 8),
    "1x2_1x7": (OWN, (1, 7), 1, 24, 32, 9, 17, (0, 3, 0, 3), "relu", 0.0, 0.0, False, 8, 8),
    "2x1_7x1-batch2": (OWN, (7, 1), 2, 16, 16, 17, 5, (3, 0, 3, 0), "none", 0.0, 0.0, True, 8, 8),
    "1x2_1x3": (OWN, (1, 3), 1, 32, 24, 8, 8, (0, 1, 0, 1), "clip", 0.0, 6.0, False, 8, 8),
    "2x1_3x1-plain": (OWN, (3, 1), 1, 16, 32, 8, 7, (1, 0, 1, 0), "relu", 0.0, 0.0, False, 0, 0),
}


@pytest.mark.parametrize("block", [8, 16])
@pytest.mark.parametrize("case", list(CASES))
def test_the_library_winograd_matches_a_numpy_convolution(case, block):
    onednn.load()
    _own_kernel_here(block)
    algorithm, (kh, kw), n, c, k, h, w, pads, act, alpha, beta, residual, sb, db = _in_blocks(CASES[case], block)
    if not sb and not db and block != onednn.block_width():  # both plain: the kernel of the widest block here runs
        pytest.skip(f"a plain-layout conv runs the nChw{onednn.block_width()}c kernel here")
    rng = np.random.default_rng(sorted(CASES).index(case))
    x = rng.standard_normal((n, c, h, w)).astype(np.float32)
    wt = (rng.standard_normal((k, c, kh, kw)) / np.sqrt(kh * kw * c)).astype(np.float32)
    b = rng.standard_normal(k).astype(np.float32)
    oh, ow = h + pads[0] + pads[2] - kh + 1, w + pads[1] + pads[3] - kw + 1
    r = rng.standard_normal((n, k, oh, ow)).astype(np.float32) if residual else None
    want = _conv(x, wt, b, pads, act, alpha, beta, r)
    assert (want > 0).mean() > 0.2 and np.unique(want).size > want.size // 5  # alive: not clipped flat
    attrs = _attrs(pads, act, alpha, beta, sb, db, algorithm)
    tile = case.split("-")[0]
    suffix = abi.OWN_WINOGRAD_SUFFIXES[block]
    assert onednn.implementation([n, c, h, w], [k, c, kh, kw], attrs, residual=residual) == f"winograd_{tile}" + suffix

    def run(weights, a):
        out = tvm.runtime.empty((n, k, oh, ow), "float32")
        args = [tvm.runtime.tensor(_blocked(x, sb)), tvm.runtime.tensor(weights), tvm.runtime.tensor(b)]
        if residual:
            tvm.get_global_func(abi.CONV2D_ADD.name)(*args, tvm.runtime.tensor(_blocked(r, db)), tvm.runtime.ShapeTuple(a.values()), out)
        else:
            tvm.get_global_func(abi.CONV2D.name)(*args, tvm.runtime.ShapeTuple(a.values()), out)
        return out.numpy()

    assert rel_err(run(wt, attrs), _blocked(want, db).astype(np.float32)) <= RTOL
    # the compiler's path: the weights packed once (U = Gh g Gw^T), the call reading them in place
    identity, packed = onednn.pack_weights([n, c, h, w], wt, attrs, prologue=False, residual=residual, out_channels=[k])
    positions = {"2x2_3x3": 16, "4x4_3x3": 36, "2x2_5x5": 36, "1x2_1x7": 8, "2x1_7x1": 8, "1x2_1x3": 4, "2x1_3x1": 4}[tile]
    panel = 2 * block  # output channels per panel: two vectors
    assert packed.size == positions * c * -(-k // panel) * panel  # the positions x C x K rounded up to a panel
    direct_id, _ = onednn.pack_weights(
        [n, c, h, w], wt, attrs.replace(algorithm=0), prologue=False, residual=residual, out_channels=[k]
    )
    assert identity != direct_id
    packed_attrs = attrs.replace(packed=identity, weight_o=k, weight_i=c, weight_kh=kh, weight_kw=kw, layer=12)
    assert rel_err(run(packed, packed_attrs), _blocked(want, db).astype(np.float32)) <= RTOL
    with pytest.raises(Exception, match="packed at compile time"):  # the direct layout's identity: refused
        run(packed, packed_attrs.replace(packed=direct_id, layer=13))


def test_the_library_winograd_splits_its_work_over_threads_alike():
    """The cases above in a process with 3 OpenMP threads (the team size is fixed when a process
    starts): tiles split into a multiple of the thread count, and (panel, tiles) tasks, give
    the same answers."""
    onednn.load()
    _own_kernel_here()
    test = f"{Path(__file__).resolve()}::test_the_library_winograd_matches_a_numpy_convolution"
    env = {**os.environ, "OMP_NUM_THREADS": "3"}
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", test],
        env=env, capture_output=True, text=True, timeout=600, cwd=Path(__file__).resolve().parents[1],
    )
    assert proc.returncode == 0, proc.stdout[-3000:]
    passed = int(proc.stdout.split(" passed")[0].split()[-1])
    assert passed >= len(CASES), proc.stdout[-500:]  # one ISA's cases at least (both where the CPU has both)


def test_a_merged_conv_runs_each_piece_on_the_library_winograd():
    """A horizontally merged conv (two outputs: rows 0..15 and 16..39) packed piece by piece."""
    onednn.load()
    _own_kernel_here()
    rng = np.random.default_rng(5)
    x = rng.standard_normal((1, 16, 9, 9)).astype(np.float32)
    wt = (rng.standard_normal((40, 16, 3, 3)) / 12).astype(np.float32)
    b = rng.standard_normal(40).astype(np.float32)
    attrs = _attrs((1, 1, 1, 1), "relu", 0.0, 0.0, 8, abi.dst_block([8, 8]))
    want = _conv(x, wt, b, (1, 1, 1, 1), "relu", 0.0, 0.0, None)
    identity, packed = onednn.pack_weights([1, 16, 9, 9], wt, attrs, prologue=False, residual=False, out_channels=[16, 24])
    assert packed.size == 16 * 16 * 16 + 16 * 16 * 32  # each piece: its own panels
    outs = [tvm.runtime.empty((1, 16, 9, 9), "float32"), tvm.runtime.empty((1, 24, 9, 9), "float32")]
    a = attrs.replace(packed=identity, weight_o=40, weight_i=16, weight_kh=3, weight_kw=3)
    tvm.get_global_func(abi.CONV2D.name)(
        tvm.runtime.tensor(_blocked(x, 8)), tvm.runtime.tensor(packed), tvm.runtime.tensor(b), tvm.runtime.ShapeTuple(a.values()), *outs
    )
    assert rel_err(outs[0].numpy(), _blocked(want[:, :16], 8)) <= RTOL
    assert rel_err(outs[1].numpy(), _blocked(want[:, 16:], 8)) <= RTOL


@pytest.mark.parametrize(
    "x, w, change",
    [
        ([1, 12, 8, 8], [16, 12, 3, 3], {}),  # channels not in 8s
        ([1, 16, 8, 8], [16, 16, 3, 3], {"stride_h": 2, "stride_w": 2}),
        ([1, 16, 8, 8], [16, 8, 3, 3], {"groups": 2}),
        ([1, 16, 8, 8], [16, 16, 3, 3], {"act": abi.ACTIVATIONS["silu"]}),
        ([1, 16, 8, 8], [16, 16, 3, 3], {"src_block": 16, "dst_block": 8}),
        ([1, 16, 8, 8], [16, 16, 5, 5], {"algorithm": OWN_4x4, "pad_top": 2, "pad_left": 2, "pad_bottom": 2, "pad_right": 2}),
        ([1, 16, 8, 8], [16, 16, 1, 5], {"pad_top": 0, "pad_bottom": 0, "pad_left": 2, "pad_right": 2}),
        ([1, 16, 8, 8], [16, 16, 3, 3], {"dilation_h": 2, "dilation_w": 2, "pad_top": 2, "pad_left": 2, "pad_bottom": 2, "pad_right": 2}),
    ],
    ids=["channels", "stride", "groups", "silu", "two-blocks", "5x5-tiles-of-4", "1x5", "dilated"],
)
def test_layers_the_library_winograd_does_not_fit_run_direct(x, w, change):
    """Algorithm 2 on a layer it does not fit: oneDNN's direct conv runs, and
    ``implementation`` names that kernel (so the compiler's choice sees it)."""
    onednn.load()
    _own_kernel_here()
    attrs = _attrs((1, 1, 1, 1), "none", 0.0, 0.0, 0, 0).replace(**change)
    own = onednn.implementation(x, w, attrs, residual=False)
    direct = onednn.implementation(x, w, attrs.replace(algorithm=0), residual=False)
    assert own == direct and "winograd" not in own


def _conv_kh_kw(net: Net, x: str, cout: int, kh: int, kw: int, name: str) -> str:
    """A stride-1 'same' conv with a kh x kw kernel (Net.conv makes square ones)."""
    n, cin, h, w = net.shape[x]
    wv = (net.rng.standard_normal((cout, cin, kh, kw)) * np.sqrt(2.0 / (cin * kh * kw))).astype(np.float32)
    b = (net.rng.standard_normal(cout) * 0.1).astype(np.float32)
    pads = [kh // 2, kw // 2, kh // 2, kw // 2]
    ins = [x, net.const(wv, f"{name}_w"), net.const(b, f"{name}_b")]
    return net.node("Conv", ins, shape=(n, cout, h, w), name=name, kernel_shape=[kh, kw], pads=pads)


def test_a_model_compiled_with_the_library_winograd_runs_runtime_only(tmp_path):
    """compile (``--winograd always``) -> artifact -> a process with only the runtime: the 5x5,
    1x7 and 7x1 convs (the last with a residual), which oneDNN has no Winograd kernel for, run
    the library's Winograd kernel in this CPU's layout (nChw8c with AVX2, nChw16c with
    AVX-512), with onnxruntime's answer."""
    from tvm_layerfuse.cli import main

    onednn.load()
    _own_kernel_here(onednn.block_width())
    net = Net(seed=41)
    x = net.input("x", (1, 16, 17, 17))
    a = net.relu(net.conv(x, 32, k=5, name="c5"))
    b = net.relu(_conv_kh_kw(net, a, 32, 1, 7, "c17"))
    y = net.relu(net.node("Add", [_conv_kh_kw(net, b, 32, 7, 1, "c71"), a]))
    model = net.build([net.conv(y, 24, k=1, name="head")])
    path = tmp_path / "m.onnx"
    import onnx

    onnx.save(model, str(path))
    out = tmp_path / "art"
    assert main(["compile", str(path), "-o", str(out), "--winograd", "always", "-q"]) == 0
    layers = json.loads((out / "manifest.json").read_text())["tactics"]["layers"]
    suffix = abi.OWN_WINOGRAD_SUFFIXES[onednn.block_width()]
    kernels = sorted(c["kernel"] for c in layers if c.get("shape", "").endswith((", 5, 5]", ", 1, 7]", ", 7, 1]")))
    assert kernels == sorted(f"winograd_{t}{suffix}" for t in ("2x2_5x5", "1x2_1x7", "2x1_7x1")), layers
    feeds = random_inputs(model, 2)
    (expected,) = run_onnxruntime(model, feeds)
    assert np.abs(expected).max() > 1e-2
    got = run_runtime_only(out, feeds, tmp_path)
    assert rel_err(next(iter(got.values())), expected) <= 1e-4
