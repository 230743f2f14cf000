"""Check the oneDNN conv tactic at large spatial sizes against onnxruntime.

oneDNN 2.6.1/2.6.2 fixed an fp32 convolution that went wrong on very large tensors (offsets
past 2**31, pytorch#84488); PyPI's oneDNN is 2.6.0. This compiles single conv layers (bias +
ReLU, as a detector's stem and neck have them) at 640x640 and 1280x1280, plus one whose input
is larger than 2**31 bytes, with ``--tactics onednn``, runs each artifact and compares with
onnxruntime (graph optimisations off)::

    python scripts/check_onednn_large.py [--cases NAME ...] [--keep DIR]

Prints one line per case (shape, oneDNN kernel, max relative error) and exits non-zero when
any error is above 1e-4.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

# name: (C_in, C_out, kernel, stride, H=W)
CASES = {
    "stem640": (3, 16, 3, 2, 640),
    "conv3x3_640": (16, 32, 3, 1, 640),
    "conv1x1_640": (32, 64, 1, 1, 640),
    "stem1280": (3, 16, 3, 2, 1280),
    "conv3x3_1280": (16, 16, 3, 1, 1280),
    "conv1x1_1280": (16, 32, 1, 1, 1280),
    "over2GiB_1x1_1280": (336, 16, 1, 1, 1280),  # input 336*1280*1280*4 bytes = 2.2e9 > 2**31
}


def conv_model(c_in: int, c_out: int, k: int, stride: int, size: int, seed: int) -> onnx.ModelProto:
    rng = np.random.default_rng(seed)
    w = (rng.standard_normal((c_out, c_in, k, k)) * np.sqrt(2.0 / (c_in * k * k))).astype(np.float32)  # [C_out, C_in, k, k]
    b = (rng.standard_normal(c_out) * 0.1).astype(np.float32)
    out = (size + 2 * (k // 2) - k) // stride + 1
    nodes = [
        helper.make_node("Conv", ["input", "w", "b"], ["c"], kernel_shape=[k, k], strides=[stride] * 2, pads=[k // 2] * 4),
        helper.make_node("Relu", ["c"], ["output"]),
    ]
    graph = helper.make_graph(
        nodes,
        "conv",
        [helper.make_tensor_value_info("input", TensorProto.FLOAT, [1, c_in, size, size])],
        [helper.make_tensor_value_info("output", TensorProto.FLOAT, [1, c_out, out, out])],
        [numpy_helper.from_array(w, "w"), numpy_helper.from_array(b, "b")],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", nargs="+", choices=sorted(CASES), default=list(CASES))
    parser.add_argument("--keep", type=Path, help="keep the models and artifacts here")
    args = parser.parse_args(argv)

    import onnxruntime as ort

    from tvm_layerfuse.compile import compile_model
    from tvm_layerfuse.compile.tactics import onednn
    from tvm_layerfuse.runtime import load

    found = onednn.installation()
    print(f"oneDNN {onednn.version()} ({found.source}: {found.library})")
    worst = 0.0
    with tempfile.TemporaryDirectory() as tmp:
        root = args.keep or Path(tmp)
        root.mkdir(parents=True, exist_ok=True)
        for name in args.cases:
            c_in, c_out, k, stride, size = CASES[name]
            model = conv_model(c_in, c_out, k, stride, size, seed=len(name))
            path = root / f"{name}.onnx"
            onnx.save(model, str(path))
            art = compile_model(path, root / name, target="cpu", progress=False, tactics="onednn", winograd="never", force=True)
            layers = json.loads((art / "manifest.json").read_text())["tactics"]["layers"]
            kernel = next((layer.get("kernel") for layer in layers if layer.get("tactic") == "onednn"), "not on oneDNN")
            x = np.random.default_rng(1).standard_normal((1, c_in, size, size)).astype(np.float32)
            t0 = time.perf_counter()
            got = load(art).run({"input": x})["output"]
            ours = time.perf_counter() - t0
            opts = ort.SessionOptions()
            opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
            (ref,) = ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"]).run(None, {"input": x})
            err = float(np.abs(ref.astype(np.float64) - got).max() / max(np.abs(ref).max(), 1e-30))
            worst = max(worst, err)
            print(
                f"{name:18s} [1,{c_in},{size},{size}] -> {list(got.shape)} k{k} s{stride}  {kernel}  "
                f"max rel. err {err:.2e}  ({ours * 1e3:.0f} ms, first run)",
                flush=True,
            )
            del x, got, ref
    print(f"worst {worst:.2e}: {'PASS' if worst <= 1e-4 else 'FAIL'} (bound 1e-4)")
    return 0 if worst <= 1e-4 else 1


if __name__ == "__main__":
    sys.exit(main())
