"""Fusion gain and int8 accuracy on VTA (simulator counters), fused vs unfused.

    python scripts/vta_report.py                       # the default networks
    python scripts/vta_report.py --nets googlenet:blocks=9,width=0.5,image=64 --inputs 8

For each network: what runs on VTA and on the host, the simulator's counters for one
inference of the fused program set and of the unfused one with the same quantization
(DRAM bytes loaded per buffer kind and stored, instructions, GEMM/ALU micro-op steps),
and the int8 vs fp32 (onnxruntime) accuracy on the calibration inputs and on held-out
seeded inputs. The simulator runs in its hardware mode (what VTA's FPGA and Chisel designs
execute); every int8 tensor both forms produce is checked bit for bit against the int8
numpy reference.
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from tvm_layerfuse.compile.vta import pipeline
from tvm_layerfuse.compile.vta.executor import execute
from tvm_layerfuse.compile.vta.quantize import random_samples, reference
from tvm_layerfuse.runtime.vta.config import DEFAULT, load_config
from tvm_layerfuse.testing import zoo

DEFAULT_NETS = [
    "resnet18:width=0.25,image=32",
    "resnet18:width=0.5,image=64",
    "googlenet:blocks=2,width=0.25,image=32",
    "googlenet:blocks=9,width=0.5,image=64",
]


def parse_net(spec: str):
    name, _, args = spec.partition(":")
    kw = {}
    for part in filter(None, args.split(",")):
        k, v = part.split("=")
        kw[k] = float(v) if "." in v else int(v)
    return name, kw


def check_bit_exact(b, feeds) -> int:
    """Both forms under the hardware mode vs the int8 numpy reference; the int8 tensors compared."""
    n = 0
    for compiled in (b.fused, b.unfused):
        trace = {}
        ref = reference(compiled.graph, b.quantization, feeds, trace=trace)
        run = execute(compiled, feeds, trace=True, device="sim")
        for name, value in trace.items():
            np.testing.assert_array_equal(run.ints[name], value, err_msg=name)
        for name in compiled.graph.outputs:
            np.testing.assert_array_equal(run.outputs[name], ref[name], err_msg=name)
        n += len(trace)
    return n


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nets", nargs="*", default=DEFAULT_NETS, help="zoo builder:key=value,... (default: %(default)s)")
    ap.add_argument("--calibration", type=int, default=4, help="seeded random calibration inputs")
    ap.add_argument("--inputs", type=int, default=4, help="held-out seeded inputs for the accuracy check")
    ap.add_argument("--config", help="a vta_config.json (default: VTA's default configuration)")
    args = ap.parse_args()
    cfg = load_config(args.config) if args.config else DEFAULT
    rows = []
    for spec in args.nets:
        name, kw = parse_net(spec)
        model = zoo.BUILDERS[name](seed=0, **kw)
        t0 = time.perf_counter()
        b = pipeline.build(model, cfg=cfg, baseline=True, n_calibration=args.calibration, seed=1)
        build_s = time.perf_counter() - t0
        feeds = random_samples(b.graph, 1, seed=100)[0]
        t0 = time.perf_counter()
        g = pipeline.gain(b, feeds)
        sim_s = (time.perf_counter() - t0) / 2
        exact = check_bit_exact(b, feeds)
        held = random_samples(b.graph, args.inputs, seed=1000)
        acc_cal = pipeline.accuracy(b, model, b.calibration)
        acc_held = pipeline.accuracy(b, model, held)
        place = b.placement()
        on_vta = sum(r["where"] == "vta" for r in place)
        print(f"\n## {spec}  ({on_vta} ops on VTA, {len(place) - on_vta} on the host; build {build_s:.1f} s, "
              f"one simulated inference {sim_s:.2f} s)")
        n_prog = len(b.fused.programs) + len(b.unfused.programs)
        print(f"   hardware mode: {n_prog} programs (fused and unfused) ran; {exact} int8 tensors bit-exact "
              "with the int8 numpy reference")
        for r in place:
            if r["where"] == "host":
                print(f"   host: {r['op']} ({r['reason']})")
        keys = ["inp_load_nbytes", "wgt_load_nbytes", "acc_load_nbytes", "uop_load_nbytes", "out_store_nbytes",
                "dram_nbytes", "insn_count", "insn_load", "insn_store", "insn_gemm", "insn_alu", "gemm_counter", "alu_counter"]
        print(f"   {'counter':<18}{'unfused':>12}{'fused':>12}{'change':>9}")
        for k in keys:
            u, f = g["unfused"][k], g["fused"][k]
            print(f"   {k:<18}{u:>12}{f:>12}{(f - u) / u * 100 if u else 0:>8.1f}%")
        act = {form: g[form]["dram_nbytes"] - g[form]["wgt_load_nbytes"] - g[form]["uop_load_nbytes"] for form in g}
        print(f"   {'activation bytes':<18}{act['unfused']:>12}{act['fused']:>12}"
              f"{(act['fused'] - act['unfused']) / act['unfused'] * 100:>8.1f}%")
        print(f"   int8 vs fp32: calibration {acc_cal['inputs']} inputs top-1 {acc_cal['top1_agreement']:.2f} "
              f"max rel err {acc_cal['max_rel_error']:.3f}; held-out {acc_held['inputs']} inputs top-1 "
              f"{acc_held['top1_agreement']:.2f} max rel err {acc_held['max_rel_error']:.3f}")
        rows.append((spec, g, act))
    print("\n| network | DRAM bytes unfused | fused | change | activation bytes change | instructions unfused | fused | change |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for spec, g, act in rows:
        u, f = g["unfused"], g["fused"]
        print(f"| {spec} | {u['dram_nbytes']} | {f['dram_nbytes']} | {(f['dram_nbytes'] - u['dram_nbytes']) / u['dram_nbytes'] * 100:.1f}% "
              f"| {(act['fused'] - act['unfused']) / act['unfused'] * 100:.1f}% | {u['insn_count']} | {f['insn_count']} "
              f"| {(f['insn_count'] - u['insn_count']) / u['insn_count'] * 100:.1f}% |")


if __name__ == "__main__":
    main()
