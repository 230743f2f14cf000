"""Resident memory of a process that loads an artifact and runs it once.

    python scripts/memory_after_load.py ARTIFACT [--runs N]

Prints VmRSS (resident now) and VmHWM (peak resident) from /proc/self/status after the load,
and again after the runs (random inputs of the manifest's shapes, seed 0), with the size of
the artifact's weights file for scale. Linux only. A loaded model should hold its weights once:
with the oneDNN tactic's weights packed in the artifact (compile/tactics/prepack.py) nothing
of them is copied at the first run.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np


def status() -> dict[str, int]:
    """VmRSS and VmHWM of this process, in KiB."""
    out = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            out[key] = int(value.split()[0])
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("artifact", type=Path)
    ap.add_argument("--runs", type=int, default=1)
    args = ap.parse_args(argv)
    from tvm_layerfuse.runtime import load

    base = status()
    rt = load(args.artifact)
    loaded = status()
    rng = np.random.default_rng(0)
    feeds = {i["name"]: rng.standard_normal(i["shape"]).astype(i["dtype"]) for i in rt.inputs}
    for _ in range(args.runs):
        rt.run(feeds)
    ran = status()
    weights = (args.artifact / (rt.manifest.get("params") or {}).get("file", "params.npz")).stat().st_size
    mib = 1024.0
    print(f"artifact {args.artifact}: weights file {weights / 2**20:.1f} MiB")
    print(f"before load     VmRSS {base['VmRSS'] / mib:8.1f} MiB  VmHWM {base['VmHWM'] / mib:8.1f} MiB")
    print(f"after load      VmRSS {loaded['VmRSS'] / mib:8.1f} MiB  VmHWM {loaded['VmHWM'] / mib:8.1f} MiB")
    print(f"after {args.runs} run(s)  VmRSS {ran['VmRSS'] / mib:8.1f} MiB  VmHWM {ran['VmHWM'] / mib:8.1f} MiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
