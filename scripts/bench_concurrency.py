"""Throughput of one loaded model called from several Python threads at once, against
onnxruntime's ``InferenceSession`` called the same way.

Usage: python scripts/bench_concurrency.py MODEL.onnx ARTIFACT [--runs 40] [--callers 1 2]

Every engine runs with one intra-op thread (``OMP_NUM_THREADS=1`` for layerfuse's library
layers and TVM kernels; ``intra_op_num_threads=1`` for onnxruntime), in a process of its own;
``K`` caller threads share one ``Runtime`` (one ``InferenceSession``) and each makes ``--runs``
inferences. The figure is inferences per second, and its ratio to one caller: 2.0 is perfect
scaling on two cores. The load average is printed; run it on a quiet machine.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time


def worker(engine: str, model: str, artifact: str, callers: int, runs: int) -> float:
    import onnx

    from tvm_layerfuse.testing import random_inputs

    feeds = random_inputs(onnx.load(model, load_external_data=False), 0)
    if engine == "layerfuse":
        from tvm_layerfuse.runtime import load

        rt = load(artifact)
        run = lambda: rt.run(feeds)  # noqa: E731
    else:
        import onnxruntime as ort

        so = ort.SessionOptions()
        so.intra_op_num_threads = 1
        so.inter_op_num_threads = 1
        sess = ort.InferenceSession(model, so, providers=["CPUExecutionProvider"])
        run = lambda: sess.run(None, feeds)  # noqa: E731
    for _ in range(3):
        run()
    start = threading.Barrier(callers + 1)

    def loop() -> None:
        run()  # this thread's warm-up (a VM per thread)
        start.wait()
        for _ in range(runs):
            run()

    threads = [threading.Thread(target=loop) for _ in range(callers)]
    for t in threads:
        t.start()
    start.wait()
    t0 = time.perf_counter()
    for t in threads:
        t.join()
    return callers * runs / (time.perf_counter() - t0)


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        engine, model, artifact, callers, runs = sys.argv[2:7]
        print(json.dumps({"per_s": worker(engine, model, artifact, int(callers), int(runs))}))
        return
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("artifact")
    ap.add_argument("--runs", type=int, default=40)
    ap.add_argument("--callers", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    env = dict(os.environ, OMP_NUM_THREADS="1", TVM_NUM_THREADS="1")
    print(f"load average before: {os.getloadavg()}")
    results: dict = {}
    for _ in range(args.rounds):
        for engine in ("layerfuse", "onnxruntime"):
            for k in args.callers:
                cmd = [sys.executable, __file__, "--worker", engine, args.model, args.artifact, str(k), str(args.runs)]
                out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True).stdout
                results.setdefault((engine, k), []).append(json.loads(out.strip().splitlines()[-1])["per_s"])
    print(f"load average after: {os.getloadavg()}")
    for engine in ("layerfuse", "onnxruntime"):
        base = sorted(results[(engine, args.callers[0])])[len(results[(engine, args.callers[0])]) // 2]
        for k in args.callers:
            med = sorted(results[(engine, k)])[len(results[(engine, k)]) // 2]
            print(f"{engine:12s} {k} caller(s): {med:8.1f} inferences/s  ({med / base:.2f}x one caller)")


if __name__ == "__main__":
    main()
