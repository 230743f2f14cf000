"""Four sides in one process, same input, interleaved rounds: where the time goes.

Usage: python scripts/bench_tactics.py [NAME ...] [--rounds 15] [--default-rounds 3]
                                       [--threads 2] [--breakdown] [--png FILE] [--tactics auto|tvm]
       python scripts/bench_tactics.py [NAME ...] --bytes

NAME: zoo builders (tvm_layerfuse.testing.zoo) at full width with seeded weights:
googlenet, inception_v3 (299x299), resnet50, squeezenet1_1, densenet121, mobilenet_v2
(default: all six). Sides:

  tvm-default   TVM's default pipeline, untuned (its CPU kernels are plain loops)
  layerfuse     fusion + the tactic choice (oneDNN where it takes the layer; ``--tactics tvm``:
                none, every layer on TVM's kernels), the CPU schedule rules for TVM's kernels
  fusion-off    the same tactic choice on the unfused model, TVM's default pipeline with the
                same schedule rules
  onnxruntime   CPU provider, all graph optimisations, ``--threads`` intra-op threads

Every round runs each side once on the same input (tvm-default only in the first
``--default-rounds`` rounds: it takes seconds). Prints medians, the spread (min-max), the
ratios, and with ``--breakdown`` the time of each side's calls grouped by kind (conv /
pool / concat / element-wise / layout / other), measured with the VM's instrument hook in
a separate, un-timed run (the hook adds Python overhead per call). ``--png FILE`` also writes
a bar chart of each side's median over onnxruntime's (needs matplotlib: ``pip install -e ".[bench]"``).

``--bytes`` (no timing) prints, per model, what one inference writes and launches: TVM's
default pipeline against layerfuse with the tactics, with and without conv prologues reading
a concat's pieces (``UseOneDNNConv(pieces=False)``: the concat materialised). Bytes written =
the outputs of TVM's compute kernels + what library calls compute into their outputs + the
prologues' scratch + every concatenate copy (:func:`tvm_layerfuse.compile.report.total_bytes_written`);
kernel launches and the planned peak activation memory are read from the executable.
"""

from __future__ import annotations

import argparse
import inspect
import os
import statistics
import sys
import time
from collections import defaultdict


def _threads_from_argv() -> str:
    """--threads N, read before TVM, OpenMP and oneDNN start their thread pools."""
    argv = sys.argv
    for k, a in enumerate(argv):
        if a == "--threads" and k + 1 < len(argv):
            return argv[k + 1]
        if a.startswith("--threads="):
            return a.split("=", 1)[1]
    return "2"


for _var in ("OMP_NUM_THREADS", "TVM_NUM_THREADS"):
    os.environ.setdefault(_var, _threads_from_argv())

import numpy as np  # noqa: E402 (after the thread settings)
import onnxruntime as ort  # noqa: E402 (after the thread settings)
import tvm  # noqa: E402 (after the thread settings)
from tvm import relax  # noqa: E402 (after the thread settings)

from tvm_layerfuse.compile.presets import resolve  # noqa: E402 (after the thread settings)
from tvm_layerfuse.compile.report import activation_bytes_written, total_bytes_written  # noqa: E402 (after the thread settings)
from tvm_layerfuse.compile.tactics.use_onednn import UseOneDNNConv  # noqa: E402 (after the thread settings)
from tvm_layerfuse.lowering import concat_report, layerfuse_pipeline  # noqa: E402 (after the thread settings)
from tvm_layerfuse.lowering.pipeline import default_passes  # noqa: E402 (after the thread settings)
from tvm_layerfuse.relax.pipeline import fuse_with_report, lower, unfused  # noqa: E402 (after the thread settings)
from tvm_layerfuse.testing import random_inputs, run_onnxruntime, zoo  # noqa: E402 (after the thread settings)

MODELS = {  # torchvision's full configurations
    "googlenet": dict(image=224),
    "inception_v3": dict(image=299),
    "resnet50": dict(image=224, layers=(3, 4, 6, 3)),
    "squeezenet1_1": dict(image=224),
    "densenet121": dict(image=224, block_config=(6, 12, 24, 16)),
    "mobilenet_v2": dict(image=224, setting=zoo._MOBILENET_V2_SETTING, last_channel=1280),
}
SIDES = ("tvm-default", "layerfuse", "fusion-off", "onnxruntime")
CLOCK = ["wall"]


def kind_of(symbol: str) -> str:
    s = symbol.lower()
    if "concat_convs" in s:  # convs writing their channels of a concat block (no copy)
        return "conv"
    if "concat" in s:  # TVM's concatenate kernels and layerfuse.onednn.concat
        return "concat"
    if "pool" in s:  # TVM's pools and layerfuse.onednn.pool2d
        return "pool"
    if any(k in s for k in ("transpose", "layout", "reshape", "permute", "to_blocked", "shuffle")):
        return "layout"
    if "onednn" in s or "conv" in s:
        return "conv"
    if any(k in s for k in ("transpose", "layout", "reshape", "permute")):
        return "layout"
    if s.startswith("vm.builtin") or "alloc" in s:
        return "other"
    if any(k in s for k in ("matmul", "dense", "linear")):
        return "other"
    return "element-wise"


def build(model, *, fuse: bool, tactics: bool, target, schedules: bool = True):
    mod = fuse_with_report(model, bind=True).mod if fuse else unfused(model)
    chooser = None
    if tactics:
        chooser = UseOneDNNConv()
        mod = chooser(mod)
    if fuse:
        pipeline = layerfuse_pipeline(target)
    elif schedules:  # the unfused model with the same CPU schedule rules (compile --no-fuse)
        pipeline = default_passes(target, schedules=True)
    else:  # TVM's own default pipeline: untuned, unscheduled loops
        pipeline = relax.get_default_pipeline(target)
    ex = tvm.compile(mod, target=target, relax_pipeline=pipeline)
    return relax.VirtualMachine(ex, tvm.cpu()), chooser


def breakdown(vm, args) -> dict[str, float]:
    """ms per kind for one run, by the VM's instrument hook."""
    spent: dict[str, float] = defaultdict(float)
    start: list[float] = []

    clock = time.process_time if CLOCK[0] == "cpu" else time.perf_counter

    def instrument(func, symbol, before, ret, *rest):
        if before:
            start.append(clock())
        else:
            spent[kind_of(str(symbol))] += (clock() - start.pop()) * 1e3
        return 0

    vm.set_instrument(instrument)
    vm["main"](*args)
    vm.set_instrument(lambda *a: 0)
    return dict(spent)


def bench(name: str, args) -> dict:
    model = getattr(zoo, name)(width=1.0, num_classes=1000, seed=0, **MODELS[name])
    feeds = random_inputs(model, 0)
    target = resolve("cpu").tvm_target()
    t = time.perf_counter()
    vms = {}
    onednn = args.tactics == "auto"
    vms["layerfuse"], chooser = build(model, fuse=True, tactics=onednn, target=target)
    vms["fusion-off"], _ = build(model, fuse=False, tactics=onednn, target=target)
    if args.default_rounds:
        vms["tvm-default"], _ = build(model, fuse=False, tactics=False, target=target, schedules=False)
    build_s = time.perf_counter() - t
    so = ort.SessionOptions()
    so.intra_op_num_threads = args.threads
    so.inter_op_num_threads = 1
    so.log_severity_level = 3
    sess = ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])
    tvm_args = [tvm.runtime.tensor(v) for v in feeds.values()]
    expected = run_onnxruntime(model, feeds)[0]
    check = {}
    for side, vm in vms.items():
        out = vm["main"](*tvm_args)
        out = out if hasattr(out, "numpy") else out[0]
        check[side] = float(np.abs(out.numpy() - expected).max() / np.abs(expected).max())

    clock = time.process_time if args.clock == "cpu" else time.perf_counter

    def run_side(side):
        if side == "onnxruntime":
            t0 = clock()
            sess.run(None, feeds)
            return (clock() - t0) * 1e3
        f = vms[side]["main"]
        t0 = clock()
        f(*tvm_args)
        return (clock() - t0) * 1e3

    for side in ("layerfuse", "fusion-off", "onnxruntime"):  # warm-up (primitives, weight reorders)
        for _ in range(3):
            run_side(side)
    samples = defaultdict(list)
    for r in range(args.rounds):
        for side in SIDES:
            if side == "tvm-default" and (r >= args.default_rounds or side not in vms):
                continue
            samples[side].append(run_side(side))
    res = {"name": name, "build_s": build_s, "check": check, "samples": samples, "tactics": chooser.layers if chooser else []}
    if args.breakdown:
        res["breakdown"] = {side: breakdown(vms[side], tvm_args) for side in ("layerfuse", "fusion-off")}
    return res


def bytes_table(name: str) -> list[dict]:
    """Per side: kernel launches, bytes written (and the parts), planned peak (see --bytes)."""
    builder = getattr(zoo, name)
    quick = {"calibrate": False} if "calibrate" in inspect.signature(builder).parameters else {}  # counting needs no statistics
    model = builder(width=1.0, num_classes=1000, seed=0, **quick, **MODELS[name])
    target = resolve("cpu").tvm_target()
    rows = []
    plain = unfused(model)
    rep = concat_report(plain, target=target, layerfuse=False)
    written = activation_bytes_written(lower(plain, target=target))
    rows.append(dict(side="tvm-default", report=rep, written=written))
    fused = fuse_with_report(model, bind=True).mod
    for side, pieces in (("layerfuse, concat copied", False), ("layerfuse", True)):
        mod = UseOneDNNConv(pieces=pieces)(fused)
        rep = concat_report(tvm.compile(mod, target=target, relax_pipeline=layerfuse_pipeline(target)))
        rows.append(dict(side=side, report=rep, written=activation_bytes_written(lower(mod, target=target))))
    for r in rows:
        r["total"] = total_bytes_written(r["written"], r["report"])
    return rows


def print_bytes(name: str, rows: list[dict]) -> None:
    mb = 1e-6
    print(f"## {name}: per inference, batch 1 (MB = 1e6 bytes)")
    print("| side | kernel launches | bytes written | kernels + library outputs | concat copies | prologue scratch "
          "| peak activation memory |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        w, rep = r["written"], r["report"]
        outputs = w["compute"] + (w["split"] if rep["split_kernels"] else 0) + w["library"]
        print(f"| {r['side']} | {rep['kernels']} | {r['total'] * mb:.1f} MB | {outputs * mb:.1f} MB "
              f"| {rep['concat_bytes_copied'] * mb:.1f} MB | {w['scratch'] * mb:.1f} MB | {rep['activation_bytes'] * mb:.2f} MB |")
    print()


def report(results, args) -> None:
    print(f"# bench_tactics: --tactics {args.tactics}, batch 1, fp32, {args.threads} threads, {args.clock} clock, "
          f"{args.rounds} interleaved rounds "
          f"(tvm-default: {args.default_rounds}); medians in ms, [min-max]")
    print()
    print(
        "| model | tvm-default | layerfuse | fusion-off | onnxruntime | layerfuse/ort | fusion-off/layerfuse "
        "| oneDNN layers | max rel err |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for r in results:
        med = {s: statistics.median(v) for s, v in r["samples"].items()}

        def cell(s):
            v = r["samples"].get(s)
            return f"{statistics.median(v):.1f} [{min(v):.1f}-{max(v):.1f}]" if v else "-"

        convs = [c for c in r["tactics"] if c.tactic in ("onednn", "tvm") and not c.layer.startswith("pool:")]
        used, convs = sum(c.tactic == "onednn" for c in convs), len(convs)
        print(
            f"| {r['name']} | {cell('tvm-default')} | {cell('layerfuse')} | {cell('fusion-off')} | {cell('onnxruntime')} "
            f"| {med['layerfuse'] / med['onnxruntime']:.3f} | {med['fusion-off'] / med['layerfuse']:.3f} "
            f"| {used}/{convs} | {max(r['check'].values()):.1e} |"
        )
    if args.breakdown:
        print()
        print("per-kernel time by kind (ms, one instrumented run each; the hook adds overhead per call)")
        for r in results:
            for side, kinds in r["breakdown"].items():
                parts = ", ".join(f"{k} {v:.2f}" for k, v in sorted(kinds.items(), key=lambda kv: -kv[1]))
                print(f"  {r['name']:<14} {side:<11} total {sum(kinds.values()):.2f}: {parts}")


def write_png(results, path: str, args) -> None:
    """A bar chart: each side's median per model, as a multiple of onnxruntime's (log scale)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    sides = [s for s in SIDES if s != "onnxruntime" and any(r["samples"].get(s) for r in results)]
    fig, ax = plt.subplots(figsize=(max(5.0, 1.6 + 1.4 * len(results)), 4.2))
    width = 0.8 / len(sides)
    for k, side in enumerate(sides):
        ratios = [
            statistics.median(r["samples"][side]) / statistics.median(r["samples"]["onnxruntime"]) if r["samples"].get(side) else 0
            for r in results
        ]
        bars = ax.bar([i + (k - (len(sides) - 1) / 2) * width for i in range(len(results))], ratios, width, label=side)
        ax.bar_label(bars, labels=[f"{v:.2f}" if v else "" for v in ratios], fontsize=7, rotation=90, padding=2)
    ax.axhline(1.0, color="black", linewidth=0.8, linestyle="--")
    ax.set_yscale("log")
    ax.yaxis.set_major_formatter(matplotlib.ticker.FormatStrFormatter("%g"))
    ax.yaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    ax.set_xticks(range(len(results)), [r["name"] for r in results], rotation=20)
    ax.set_ylabel("median time / onnxruntime")
    ax.set_title(f"batch 1, fp32, {args.threads} thread(s), {args.clock} clock, {args.rounds} rounds", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("names", nargs="*", default=list(MODELS))
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--default-rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--breakdown", action="store_true")
    ap.add_argument(
        "--tactics",
        choices=("auto", "tvm"),
        default="auto",
        help="auto: convs on oneDNN where it takes them; tvm: every layer on TVM's kernels with the CPU schedule "
        "rules (layerfuse and fusion-off), against TVM's untuned default (tvm-default) and onnxruntime",
    )
    ap.add_argument("--png", metavar="FILE", help="also write a bar chart of the ratios to onnxruntime (needs matplotlib)")
    ap.add_argument("--bytes", action="store_true", help="print bytes written, kernel launches and peak memory (no timing)")
    ap.add_argument(
        "--clock",
        choices=("wall", "cpu"),
        default="wall",
        help="wall: elapsed time; cpu: this process's CPU time (with --threads 1 it is the work of one inference, "
        "insensitive to other processes competing for the cores)",
    )
    args = ap.parse_args()
    CLOCK[0] = args.clock
    unknown = [n for n in args.names if n not in MODELS]
    if unknown:
        sys.exit(f"error: model {unknown[0]!r} is unknown; expected one of {', '.join(MODELS)}")
    if args.png:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            sys.exit(f'error: --png {args.png} needs matplotlib, which is not installed; install it with pip install -e ".[bench]"')
    if args.bytes:
        for name in args.names:
            print_bytes(name, bytes_table(name))
        return
    results = []
    for name in args.names:
        results.append(bench(name, args))
        print(f"[{name}: built in {results[-1]['build_s']:.0f} s]", file=sys.stderr, flush=True)
    report(results, args)
    if args.png:
        write_png(results, args.png, args)
        print(f"wrote {args.png}", file=sys.stderr)


if __name__ == "__main__":
    main()
