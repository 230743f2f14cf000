"""A plan never costs more kernels than TVM's default pipeline.

For every network of the test zoo (torchvision architectures as torch exports them, BatchNorm
kept and folded), of the ONNX model-zoo networks the onnx package ships, and of the
exporter-style models, ``inspect --compile``'s counter
(:func:`tvm_layerfuse.compile.report.compare`: both sides lowered through TVM's pipeline,
layerfuse with its lowering passes) finds no more kernel launches per inference with
layerfuse than with TVM's default. Where the plan cannot express a chain, TVM's fusion must
still apply to it (``relax/absorb_elementwise.py``).

One network runs in the default suite (one whose plan stopped FuseOps before:
MobileNetV3-small exported with BatchNorm folded: 91 kernels against 64); the sweep is slow.
"""

from __future__ import annotations

import onnx
import pytest

from tvm_layerfuse.compile.report import compare
from tvm_layerfuse.testing import exporters, zoo

IMAGE = 32
FAST = {"mobilenet_v3_small_op"}


def _zoo(name: str, bn: str):
    kwargs = {"seed": 1, "bn": bn}
    if name != "inception_v3":
        kwargs["image"] = IMAGE
    return zoo.BUILDERS[name](**kwargs)


MODELS = {f"{n}_bn_{bn}": (lambda n=n, bn=bn: _zoo(n, bn)) for n in zoo.BUILDERS for bn in ("separate", "folded")}
MODELS.update({n: (lambda n=n: exporters.BUILDERS[n](seed=1)) for n in exporters.BUILDERS})
# the ONNX model-zoo networks the onnx package ships (224x224; constant weights count the same)
MODELS.update({f"light_{n}": (lambda p=p: onnx.load(str(p))) for n, p in zoo.light_models().items()})


@pytest.mark.parametrize("name", [n if n in FAST else pytest.param(n, marks=pytest.mark.slow) for n in sorted(MODELS)])
def test_layerfuse_never_launches_more_kernels_than_tvm_default(name):
    model = MODELS[name]()
    inits = {t.name for t in model.graph.initializer}
    first = next(vi for vi in model.graph.input if vi.name not in inits)  # IR 3 lists weights as inputs too
    shape = [1] + [d.dim_value for d in first.type.tensor_type.shape.dim][1:]
    report = compare(model, input_shapes={first.name: shape})
    default, ours = report["default"], report["layerfuse"]
    assert ours["kernels"] <= default["kernels"], (name, default["kernels"], ours["kernels"])
    assert ours["bytes_written"] <= default["bytes_written"], (name, default["bytes_written"], ours["bytes_written"])


# ---------------------------------------------------------------------- copies, tactic on and off
def _compiled_counts(tmp_path, model, shape, *, fuse: bool, tactics: str) -> dict:
    """The kernel report ``compile`` writes into the manifest (read from the executable)."""
    import json

    from tvm_layerfuse.compile.build import compile_model

    name = f"{'fused' if fuse else 'default'}-{tactics}"
    path = tmp_path / "m.onnx"
    onnx.save(model, str(path))
    compile_model(path, tmp_path / name, input_shapes={"input": list(shape)}, fuse=fuse, tactics=tactics, progress=False)
    return json.loads((tmp_path / name / "manifest.json").read_text())["fusion"]["kernels"]


COPY_MODELS = {
    # YOLO-style: C2f split/concat, SPPF, upsample + concat, a DFL head (three levels)
    "yolov8_like": (lambda: exporters.yolov8_like(image=64, width=8, seed=1), (1, 3, 64, 64)),
    # Paddle2ONNX DB detector: FPN upsample + concat, RSE layers
    "p2o_db_detector": (lambda: exporters.p2o_db_detector(image=32, seed=1), (1, 3, 32, 32)),
    # YOLOv8n's size: 640x640, channels 16-32-64-128-256
    "yolov8n_640": (lambda: exporters.yolov8_like(image=640, width=16, seed=1), (1, 3, 640, 640)),
}
SLOW_COPY_MODELS = {"yolov8n_640", "p2o_db_detector"}


@pytest.mark.parametrize("tactics", ["onednn", "tvm"])
@pytest.mark.parametrize(
    "name", [pytest.param(n, marks=pytest.mark.slow) if n in SLOW_COPY_MODELS else n for n in sorted(COPY_MODELS)]
)
def test_concat_and_split_copies_never_exceed_tvm_default(tmp_path, name, tactics):
    """Concatenate and split kernels that only copy: never more with layerfuse than with
    TVM's default pipeline, with the oneDNN tactic and without; kernels likewise."""
    from tvm_layerfuse.compile.tactics import onednn

    if tactics == "onednn" and onednn.availability() is not None:
        pytest.skip(f"oneDNN tactic unavailable: {onednn.availability()}")
    make, shape = COPY_MODELS[name]
    model = make()
    default = _compiled_counts(tmp_path, model, shape, fuse=False, tactics="tvm")
    ours = _compiled_counts(tmp_path, model, shape, fuse=True, tactics=tactics)
    assert default["concat_kernels"] + default["concat_fused"] > 0  # the model has concats
    for key in ("concat_kernels", "split_kernels", "kernels"):
        assert ours[key] <= default[key], (name, tactics, key, default[key], ours[key])
    assert ours["concat_bytes_copied"] <= default["concat_bytes_copied"]
