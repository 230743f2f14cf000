"""Latency of one model three ways, measured in one run: layerfuse, TVM's default pipeline
(`compile --no-fuse`), and onnxruntime (all optimisations on, the honest yardstick).

Usage: python scripts/bench_fused.py [MODEL.onnx | zoo:NAME[:IMAGE]] [--repeat 20] [--threads 2]

Both TVM builds are untuned (no MetaSchedule database): TVM's CPU code is then naive loops,
so the ratio that matters here is layerfuse / TVM default on the same schedules.
Prints medians (ms) and ratios; TVM sides use time_evaluator, onnxruntime perf_counter.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort

from tvm_layerfuse.compile.build import compile_model
from tvm_layerfuse.models import default_model
from tvm_layerfuse.runtime import load


def _model(spec: str) -> Path:
    if not spec.startswith("zoo:"):
        return Path(spec)
    from tvm_layerfuse.testing import zoo

    _, name, *rest = spec.split(":")
    kwargs = {"image": int(rest[0])} if rest else {}
    path = Path(tempfile.mkdtemp()) / f"{name}.onnx"
    onnx.save(getattr(zoo, name)(**kwargs), str(path))
    return path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", nargs="?", default=str(default_model()))
    ap.add_argument("--repeat", type=int, default=20)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    path = _model(args.model)
    work = Path(tempfile.mkdtemp())
    rts = {
        "layerfuse": load(compile_model(path, work / "fused", progress=False)),
        "tvm-default": load(compile_model(path, work / "plain", fuse=False, progress=False)),
    }
    spec = rts["layerfuse"].inputs[0]
    x = np.random.default_rng(0).standard_normal(spec["shape"]).astype(spec["dtype"])
    feeds = {spec["name"]: x}
    times = {name: rt.benchmark(feeds, repeat=args.repeat)["median_ms"] for name, rt in rts.items()}
    so = ort.SessionOptions()
    so.intra_op_num_threads = args.threads
    sess = ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])
    sess.run(None, feeds)
    samples = []
    for _ in range(args.repeat):
        t = time.perf_counter()
        sess.run(None, feeds)
        samples.append((time.perf_counter() - t) * 1e3)
    times["onnxruntime"] = statistics.median(samples)
    print(f"model {path.name}, input {spec['shape']}, median of {args.repeat} runs")
    for name, ms in times.items():
        print(f"  {name:<12} {ms:10.3f} ms   x{ms / times['onnxruntime']:.2f} of onnxruntime")
    print(f"  layerfuse / tvm-default = {times['layerfuse'] / times['tvm-default']:.3f}")


if __name__ == "__main__":
    main()
