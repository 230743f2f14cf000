"""The oneDNN tactic keeps activations blocked (nChw16c) across whole networks: pools,
concats and the split pieces of horizontally merged convs are oneDNN calls too, so the
compiled model launches no more kernels than TVM's default pipeline and reorders only where
a TVM kernel reads a tensor. Through the path users run (``compile`` -> artifact ->
``runtime.load``), compared with onnxruntime (optimisations off, rel. error <= 1e-4)."""

import json
from collections import Counter

import pytest
from test_compile_e2e import compile_run_compare

from tvm_layerfuse.compile.report import compare
from tvm_layerfuse.compile.tactics import onednn
from tvm_layerfuse.testing import zoo

MISSING = onednn.availability()
needs_onednn = pytest.mark.skipif(MISSING is not None, reason=f"oneDNN is not installed here: {MISSING}")

MODELS = {  # full channel counts (C % 16 == 0 as in the real networks), small images
    "googlenet": lambda: zoo.googlenet(width=1.0, image=32, blocks=4, seed=11),
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
    pools = [c for c in layers if c["layer"].startswith("pool:")]
    assert pools and all(c["tactic"] == "onednn" and "ref" not in c["kernel"] for c in pools)
    layouts = Counter(c["layout"] for c in layers if c["tactic"] == "onednn")
    assert layouts["nChw16c"] >= 1, layouts  # a pool between blocked tensors
    assert sum(n for k, n in layouts.items() if k.startswith("nChw16c>nChw16c")) >= 3, layouts
