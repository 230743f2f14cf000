"""Latency of one model with and without in-place concat / split-output buffers, on this CPU.

Both sides are built from the same fused Relax module (``tvm_layerfuse.relax.fuse``):

* ``default``: TVM's default Relax pipeline (concat and split kernels copy);
* ``layerfuse``: :func:`tvm_layerfuse.lowering.layerfuse_pipeline` (producers write into
  the concat block, no split kernel).

They are checked to give the same outputs, then timed in one process with TVM's
``time_evaluator`` (``--number`` runs per measurement), alternating the two sides
``--repeat`` times so that both see the same machine state; the medians are printed with
their ratio, and the concat report (bytes copied, planned activation memory).

    python scripts/bench_concat.py --model googlenet --image 224 --width 0.5
    python scripts/bench_concat.py --model squeezenet --image 224 --width 1.0 --repeat 15
"""

from __future__ import annotations

import argparse
import logging
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import tvm
from tvm import relax

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tvm_layerfuse.lowering import (  # noqa: E402
    concat_report,
    format_concat_report,
    layerfuse_pipeline,
)
from tvm_layerfuse.relax.pipeline import fuse  # noqa: E402
from tvm_layerfuse.testing import zoo  # noqa: E402

MODELS = {
    "googlenet": lambda a: zoo.googlenet(batch=a.batch, image=a.image, width=a.width),
    "squeezenet": lambda a: zoo.squeezenet1_1(batch=a.batch, image=a.image, width=a.width),
    "inception_v3": lambda a: zoo.inception_v3(batch=a.batch, image=max(a.image, 75), width=a.width),
    "densenet": lambda a: zoo.densenet121(batch=a.batch, image=a.image, width=a.width, concat="nested"),
}


def _copy_kernel_ms(ex, dev, x, *, runs: int) -> float:
    """Median over ``runs`` inferences of the time spent in concat and split kernels, measured
    with a VM instrument around each kernel call (what in-place concat can save at most)."""
    vm = relax.VirtualMachine(ex, dev)
    spent: list[float] = []
    start: dict = {}

    def instrument(func, name, before, ret, *args):
        if "concatenate" in name or name.startswith(("split", "fused_split")):
            if before:
                start[name] = time.perf_counter()
            else:
                dev.sync()
                spent.append(time.perf_counter() - start.pop(name))
        return 0

    vm.set_instrument(instrument)
    totals = []
    for _ in range(runs):
        spent.clear()
        vm["main"](x)
        totals.append(sum(spent) * 1e3)
    return statistics.median(totals)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", choices=sorted(MODELS), default="googlenet")
    ap.add_argument("--image", type=int, default=224)
    ap.add_argument("--width", type=float, default=0.5, help="channel multiplier of the zoo builder")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--number", type=int, default=3, help="runs averaged in one measurement")
    ap.add_argument("--repeat", type=int, default=7, help="measurements per side (alternating)")
    ap.add_argument("--cores", type=int, default=None, help="llvm num-cores (default: all)")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")

    import os

    target = tvm.target.Target({"kind": "llvm", "num-cores": args.cores or os.cpu_count() or 1})
    model = MODELS[args.model](args)
    t0 = time.perf_counter()
    mod = fuse(model)
    t1 = time.perf_counter()
    sides = {}
    for name, pipe in (("default", relax.get_default_pipeline(target)), ("layerfuse", layerfuse_pipeline(target))):
        start = time.perf_counter()
        ex = tvm.compile(mod, target=target, relax_pipeline=pipe)
        sides[name] = (ex, time.perf_counter() - start)
    print(f"model {args.model} image {args.image} width {args.width} batch {args.batch}; fuse {t1 - t0:.1f}s; "
          + ", ".join(f"build {k} {v[1]:.1f}s" for k, v in sides.items()))  # fmt: skip

    dev = tvm.cpu()
    rng = np.random.default_rng(0)
    inp = model.graph.input[0]
    shape = [d.dim_value for d in inp.type.tensor_type.shape.dim]
    x = tvm.runtime.tensor(rng.standard_normal(shape).astype(np.float32), dev)
    vms = {k: relax.VirtualMachine(ex, dev) for k, (ex, _) in sides.items()}
    outs = {k: vm["main"](x).numpy() for k, vm in vms.items()}
    diff = float(np.abs(outs["layerfuse"] - outs["default"]).max() / max(np.abs(outs["default"]).max(), 1e-30))
    print(f"outputs agree: max relative difference {diff:.2e}")
    if diff > 1e-5:
        print("error: the two builds disagree; not timing them", file=sys.stderr)
        return 1

    timers = {k: vm.time_evaluator("main", dev, number=args.number, repeat=1) for k, vm in vms.items()}
    for t in timers.values():  # warm-up
        t(x)
    samples = {k: [] for k in timers}
    for _ in range(args.repeat):
        for k, t in timers.items():
            samples[k].append(t(x).median * 1e3)
    med = {k: statistics.median(v) for k, v in samples.items()}
    for k, v in samples.items():
        print(f"{k:>9}: median {med[k]:8.3f} ms  (min {min(v):.3f}, max {max(v):.3f}, {args.repeat}x{args.number} runs)")
    print(f"ratio default / layerfuse = {med['default'] / med['layerfuse']:.3f}")
    copy_ms = {k: _copy_kernel_ms(sides[k][0], dev, x, runs=max(3, args.repeat)) for k in sides}
    print(
        "time in concat/split copy kernels (instrumented, median of runs): "
        + ", ".join(f"{k} {v:.3f} ms" for k, v in copy_ms.items())
    )
    ours, base = concat_report(sides["layerfuse"][0]), concat_report(sides["default"][0])
    print(format_concat_report(ours, base))
    print(
        f"kernels per inference: {ours['kernels']} vs {base['kernels']} "
        f"(split kernels {ours['split_kernels']} vs {base['split_kernels']})"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
