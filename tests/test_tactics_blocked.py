"""The oneDNN tactic keeps activations blocked (nChw16c with AVX-512, nChw8c with AVX2: the
block width of oneDNN's kernels on this CPU) across whole networks: pools,
concats and the split pieces of horizontally merged convs are oneDNN calls too, so the
compiled model launches no more kernels than TVM's default pipeline and reorders only where
a TVM kernel reads a tensor. Through the path users run (``compile`` -> artifact ->
``runtime.load``), compared with onnxruntime (optimisations off, rel. error <= 1e-4)."""

import json
from collections import Counter

import pytest
from hypothesis import HealthCheck, given, settings
from test_compile_e2e import compile_run_compare

from tvm_layerfuse.compile.report import compare
from tvm_layerfuse.compile.tactics import onednn
from tvm_layerfuse.testing import cnn_graphs, zoo

MISSING = onednn.availability()
needs_onednn = pytest.mark.skipif(MISSING is not None, reason=f"oneDNN is not installed here: {MISSING}")


def _blocked() -> str:
    """The blocked layout of this CPU's oneDNN kernels: nChw16c (AVX-512) or nChw8c (AVX2)."""
    width = onednn.block_width()
    assert width in (8, 16), width
    return onednn.layout_name(width)

MODELS = {  # full channel counts (C % 16 == 0 as in the real networks), small images
    "googlenet": lambda: zoo.googlenet(width=1.0, image=32, blocks=3, seed=11),
    "squeezenet1_1": lambda: zoo.squeezenet1_1(width=1.0, image=48, seed=12),
}


@needs_onednn
@pytest.mark.parametrize("name", sorted(MODELS))
def test_blocked_network_has_no_more_kernels_than_tvm_default(name, tmp_path):
    model = MODELS[name]()
    compile_run_compare(model, tmp_path, target="cpu", device="cpu")  # rel. error <= 1e-4
    manifest = json.loads(next(tmp_path.glob("*-cpu/manifest.json")).read_text())
    tactics = manifest["tactics"]
    assert tactics["used"] == "onednn"
    launches = manifest["fusion"]["kernels"]["kernels"]  # every oneDNN call, reorder and TVM kernel
    default = compare(model)["default"]["kernels"]
    assert launches <= default, f"{name}: {launches} kernel launches with oneDNN, {default} with TVM's default pipeline"
    layers = tactics["layers"]
    blocked = _blocked()
    pools = [c for c in layers if c["layer"].startswith("pool:")]
    # a pool between blocked tensors: TVM's blocked kernel on the library's bytes
    assert pools and all(c["tactic"] == "tvm" for c in pools), pools
    assert any(c["layout"] == blocked and "blocked pool" in c["reason"] for c in pools), pools
    layouts = Counter(c["layout"] for c in layers if c["tactic"] == "onednn")
    assert sum(n for k, n in layouts.items() if k.startswith(f"{blocked}>{blocked}")) >= 3, layouts


def _pools_net(batch: int, seed: int):
    """Inception-like: two 1x1 convs from one input (merged horizontally, split pieces),
    one piece -> 3x3 conv, Concat of both, then every pool kind between convs: max 3/2 ceil,
    average 3/1 pad 1 counting the padding, average 3/2 pad 1 ceil without it, average 2/2
    ceil counting the padding (on 9x9: ceil cells oneDNN would count, so TVM), global average."""
    from tvm_layerfuse.testing._builder import NetBuilder

    b = NetBuilder("pools", seed=seed)
    x = b.input("input", (batch, 8, 35, 35))
    with b.scope("b1"):
        p1 = b.relu(b.conv(x, 16, 1))
    with b.scope("b2"):
        p2 = b.relu(b.conv(x, 32, 1))
    with b.scope("b2b"):
        p2 = b.relu(b.conv(p2, 32, 3, pad=1))
    y = b.concat([p1, p2])  # 48 channels: offsets 0, 16
    pools = [
        lambda t: b.maxpool(t, 3, 2, ceil=True),
        lambda t: b.avgpool(t, 3, 1, 1, count_include_pad=True),
        lambda t: b.avgpool(t, 3, 2, 1, ceil=True, count_include_pad=False),
        lambda t: b.avgpool(t, 2, 2, 0, ceil=True, count_include_pad=True),
    ]
    for i, pool in enumerate(pools):
        y = pool(y)
        with b.scope(f"c{i}"):
            y = b.relu(b.conv(y, 32, 3, pad=1))
    y = b.global_avgpool(y)
    y = b.flatten(y)
    with b.scope("fc"):
        y = b.linear(y, 10)
    return b.build({"output": y})


@needs_onednn
@pytest.mark.parametrize("batch", [1, 2])
def test_every_pool_kind_and_split_pieces_in_the_blocked_layout(batch, tmp_path):
    model = _pools_net(batch, seed=20 + batch)
    compile_run_compare(model, tmp_path, target="cpu", device="cpu")  # rel. error <= 1e-4
    manifest = json.loads(next(tmp_path.glob("*-cpu/manifest.json")).read_text())
    layers = {c["layer"]: c for c in manifest["tactics"]["layers"]}
    pools = [c for name, c in layers.items() if name.startswith("pool:")]
    assert len(pools) == 4, pools  # max, two averages, global; the ceil+count_include_pad one stays TVM
    # each on TVM's NCHWBc pool kernel, reading and writing the library's nChwBc bytes
    assert all(c["layout"] == _blocked() and c["tactic"] == "tvm" for c in pools), pools
    assert any("," in c["layout"] for c in layers.values()), "the merged 1x1 convs write their pieces"
    (concat,) = [c for name, c in layers.items() if name.startswith("concat:")]
    if batch == 1:  # both pieces' convs write their channel ranges of the block: no copy
        assert concat["tactic"] == "in-place" and concat["kernel"].startswith("2 convs"), concat
    else:  # per image the ranges are not contiguous: one memcpy per piece and image
        assert concat["tactic"] == "copy", concat
    kernels = manifest["fusion"]["kernels"]
    assert kernels["split_kernels"] == 0
    if batch == 1:
        assert kernels["concat_kernels"] == 0 and kernels["concat_bytes_copied"] == 0, kernels
    else:  # the report counts the library's copies (the concat is 2 x 48 x 35 x 35 float32)
        assert kernels["concat_kernels"] == 1 and kernels["concat_bytes_copied"] == 2 * 48 * 35 * 35 * 4, kernels


@needs_onednn
@pytest.mark.parametrize(
    "name, build",
    [
        # ReLU6 bounds reach the layer as the importer's where(isnan(p), -inf, p) on weights
        ("mobilenet_v2", lambda: zoo.mobilenet_v2(width=0.5, image=32, seed=13)),
        # pre-activation BatchNorm + ReLU: the conv's prologue on oneDNN (conv2d_pre)
        ("densenet121", lambda: zoo.densenet121(width=1.0, image=32, seed=14, block_config=(2, 2))),
    ],
)
def test_every_conv_layer_of_the_compiled_model_runs_on_onednn(name, build, tmp_path):
    model = build()
    compile_run_compare(model, tmp_path, target="cpu", device="cpu")  # rel. error <= 1e-4
    manifest = json.loads(next(tmp_path.glob("*-cpu/manifest.json")).read_text())
    layers = manifest["tactics"]["layers"]
    refused = [(c["layer"], c["reason"]) for c in layers if c["tactic"] == "tvm" and not c["layer"].startswith("pool:")]
    assert not refused, refused
    (classifier,) = [c for c in layers if c["layer"].startswith("dense:")]  # Gemm: a oneDNN matmul
    assert classifier["tactic"] == "onednn" and not classifier["kernel"].startswith("ref"), classifier
    if name == "densenet121":
        pre = [c for c in layers if c["layer"].startswith("layerfuse_bn_relu_")]
        assert len(pre) == 5 and all(c["tactic"] == "onednn" for c in pre), pre  # 2 + 2 dense layers, 1 transition
        assert any(c["layout"].startswith(f"{_blocked()}>") for c in pre), pre  # the block's concat read blocked
    launches = manifest["fusion"]["kernels"]["kernels"]
    assert launches <= compare(model)["default"]["kernels"]


@needs_onednn
@settings(max_examples=8, deadline=None, derandomize=True, database=None, suppress_health_check=list(HealthCheck))
@given(cnn_graphs(max_layers=8, max_channels=64, batch=1, blocks=("parallel", "concat", "residual")))
def test_differential_fuzzing_of_branchy_graphs_with_the_tactic(case):
    """Merged convs, concats (in place at batch 1) and residuals, on oneDNN, against onnxruntime."""
    from tvm_layerfuse.testing.differential import check_case

    res = check_case(case.model, case.feeds, stages=("unfused", "tactics"))
    assert res.findings == [], "\n".join(f"{f.kind}: {f.detail}" for f in res.findings)


@needs_onednn
@pytest.mark.parametrize("blocked", [True, False])
def test_pools_get_optimised_kernels(blocked):
    """oneDNN's reference kernels are a hundred times slower: none for the library's own steps."""
    for alg in onednn.POOL_ALGORITHMS.values():
        block = onednn.block_width() if blocked else 0
        k = onednn.pool_implementation([1, 64, 56, 56], [1, 64, 28, 28], [alg, 3, 3, 2, 2, 1, 1, 1, 1, block])
        assert not k.startswith(("ref", "unsupported")), k
