"""How long `inspect` takes: reading + planning + rendering, per built-in model.

Usage: python scripts/bench_inspect.py [--repeat 5] [MODEL ...]

Prints, per model, the median in-process time of read+plan and of read+plan+text report,
and the median wall time of the whole `python -m tvm_layerfuse inspect` command (Python
start-up and imports included).
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time

from tvm_layerfuse.models import light_model
from tvm_layerfuse.planner import plan
from tvm_layerfuse.report import plan_text


def _median(fn, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("models", nargs="*", default=["inception_v1", "inception_v2", "resnet50", "densenet121"])
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args()
    print(f"{'model':<14} {'layers':>6} {'plan s':>8} {'report s':>9} {'CLI wall s':>11}")
    for name in args.models:
        path = light_model(name)
        p = plan(path)
        t_plan = _median(lambda: plan(path), args.repeat)
        t_report = _median(lambda: plan_text(plan(path)), args.repeat)
        cmd = [sys.executable, "-m", "tvm_layerfuse", "inspect", str(path)]
        t_cli = _median(lambda: subprocess.run(cmd, check=True, capture_output=True), args.repeat)
        print(f"{name:<14} {len(p.first):>6} {t_plan:>8.3f} {t_report:>9.3f} {t_cli:>11.3f}")


if __name__ == "__main__":
    main()
