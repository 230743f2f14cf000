"""Per-kernel times of a compiled artifact: each call's minimum over several inferences.

Usage: python scripts/kernel_times.py ARTIFACT [ARTIFACT ...] [--runs 30] [--threads 1] [--top 0]

Every inference runs under the VM's instrument hook, which times each call. The hook adds
Python overhead per call, and at more than one thread it lets the worker threads sleep
between calls, so a build with more kernels pays more there than it does uninstrumented.
Per call (its place in the inference and its symbol) the minimum over ``--runs``
inferences is kept. The sums, grouped by kind (conv / pool / concat / element-wise / layout
/ other, as ``bench_tactics.py --breakdown`` groups them), compare two builds of one model
kernel by kernel: e.g. ``--tactics tvm`` with and without fusion. Timings, so run it on a quiet
machine, alone.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections import Counter, defaultdict

if "--threads" not in sys.argv and not any(a.startswith("--threads=") for a in sys.argv):
    for _var in ("OMP_NUM_THREADS", "TVM_NUM_THREADS"):
        os.environ.setdefault(_var, "1")  # this script's default; bench_tactics' is 2

import numpy as np  # noqa: E402
from bench_tactics import kind_of  # noqa: E402 (sets OMP/TVM_NUM_THREADS from --threads before TVM loads)

from tvm_layerfuse.runtime import load  # noqa: E402


def call_minima(artifact: str, runs: int) -> dict[tuple[int, str], float]:
    """(place, symbol) -> the call's shortest time in seconds over ``runs`` inferences."""
    rt = load(artifact)
    vm = rt._vm()
    rng = np.random.default_rng(0)
    args = rt._arguments({i["name"]: rng.standard_normal(i["shape"]).astype(i.get("dtype", "float32")) for i in rt.inputs})
    for _ in range(3):
        vm["main"](*args)
    best: dict[tuple[int, str], float] = {}
    start: list[float] = []
    calls: list[tuple[str, float]] = []

    def instrument(func, symbol, before, ret, *rest):
        if before:
            start.append(time.perf_counter())
        else:
            calls.append((str(symbol), time.perf_counter() - start.pop()))
        return 0

    for _ in range(runs):
        calls.clear()
        vm.set_instrument(instrument)
        vm["main"](*args)
        vm.set_instrument(lambda *a: 0)
        for place, (symbol, spent) in enumerate(calls):
            best[(place, symbol)] = min(best.get((place, symbol), spent), spent)
    return best


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("artifacts", nargs="+")
    p.add_argument("--runs", type=int, default=30)
    p.add_argument("--threads", default="1", help="OMP_NUM_THREADS / TVM_NUM_THREADS (default 1)")
    p.add_argument("--top", type=int, default=0, help="also list the N slowest calls")
    args = p.parse_args()
    for artifact in args.artifacts:
        best = {k: v for k, v in call_minima(artifact, args.runs).items() if not k[1].startswith("vm.")}
        kinds: dict[str, float] = defaultdict(float)
        for (_, symbol), spent in best.items():
            kinds[kind_of(symbol)] += spent
        threads = os.environ["TVM_NUM_THREADS"]
        total = sum(best.values()) * 1e3
        print(f"{artifact}: {len(best)} kernel calls, sum of their minima {total:.2f} ms ({args.runs} runs, {threads} thread(s))")
        for kind, spent in Counter(kinds).most_common():
            print(f"  {kind:14s} {spent * 1e3:8.2f} ms")
        for (place, symbol), spent in sorted(best.items(), key=lambda kv: -kv[1])[: args.top]:
            print(f"  #{place:<4d} {symbol:48s} {spent * 1e3:8.3f} ms")


if __name__ == "__main__":
    main()
