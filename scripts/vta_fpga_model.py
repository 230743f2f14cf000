"""Run the VTA programs on upstream's FPGA design, compiled as plain C++: the strongest check here
that they are what a VTA bitstream executes.

    python scripts/vta_fpga_model.py --tvm-vta DIR --ap-types DIR [--nets resnet18:width=0.25,image=32 ...]

``--tvm-vta``: a checkout of github.com/apache/tvm-vta (``hardware/xilinx/src/vta.cc``, the HLS
source of the PYNQ/Ultra96 bitstreams, with ``include/`` and ``config/``). ``--ap-types``: a
checkout of github.com/Xilinx/HLS_arbitrary_Precision_Types (the open-source ``ap_int.h`` that
Vivado HLS compiles ``vta.cc`` with). ``vta.cc`` is compiled with g++ as a shared library with
two stand-in headers (``hls::stream`` as an unbounded FIFO, ``ap_axi_sdata.h`` empty) and the
configuration's ``-D`` flags (``config/vta_config.py --cflags``); its ``vta()`` top function is
the C simulation of the design: fetch, then the load, compute and store stages run in turn as
their dependency tokens allow, with the design's ``out_mem``, static ``acc_mem``/``uop_mem`` and
ALU. The one change: the C simulation's scheduler gives up after 1000 rounds of its control loop
(a test-bench bound, not hardware), raised here so that programs of many steps finish.

For each network, fused and unfused: every program runs on the model (a ``VTADevice`` over the
library), and every int8 tensor VTA produces is compared with the int8 numpy reference.
"""

from __future__ import annotations

import argparse
import ctypes
import hashlib
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

from tvm_layerfuse.compile.vta import pipeline
from tvm_layerfuse.compile.vta.executor import to_module
from tvm_layerfuse.compile.vta.quantize import random_samples, reference
from tvm_layerfuse.runtime.vta.sim import Counters
from tvm_layerfuse.testing import zoo

DEFAULT_NETS = ["resnet18:width=0.25,image=32", "googlenet:blocks=2,width=0.25,image=32"]

HLS_STREAM = """#pragma once
#include <cassert>
#include <deque>
namespace hls {
template <typename T> class stream {
 public:
  std::deque<T> q;
  T read() { assert(!q.empty()); T v = q.front(); q.pop_front(); return v; }
  void read(T &v) { v = read(); }
  bool read_nb(T &v) { if (q.empty()) return false; v = read(); return true; }
  void write(const T &v) { q.push_back(v); }
  bool empty() const { return q.empty(); }
};
}  // namespace hls
"""

HARNESS = """#include "vta.h"
static_assert(sizeof(insn_T) == 16, "a 128-bit instruction");
static_assert(sizeof(uop_T) == 4, "a 32-bit micro-op");
static_assert(sizeof(bus_T) == VTA_BUS_WIDTH / 8, "a bus word");
extern "C" int vta_run(uint32_t insn_count, void *insns, void *dram) {
  // every AXI port sees the one DRAM image: addresses are element indices into it
  vta(insn_count, (volatile insn_T *)insns, (volatile uop_T *)dram, (volatile bus_T *)dram,
      (volatile bus_T *)dram, (volatile bus_T *)dram, (volatile bus_T *)dram);
  return 0;
}
"""


def build_model(tvm_vta: Path, ap_types: Path, out: Path) -> Path:
    """Compile ``vta.cc`` into ``out/libvta_fpga_<hash>.so`` (cached by the sources' hash)."""
    src = (tvm_vta / "hardware/xilinx/src/vta.cc").read_text()
    src = src.replace("exit_counter > 1000", "exit_counter > 100000000")  # the C simulation's bound
    cflags = subprocess.run([sys.executable, str(tvm_vta / "config/vta_config.py"), "--cflags"], capture_output=True,
                            text=True, check=True).stdout.split()
    defines = [f for f in cflags if f.startswith("-D")]
    key = hashlib.sha256((src + " ".join(defines)).encode()).hexdigest()[:12]
    lib = out / f"libvta_fpga_{key}.so"
    if lib.exists():
        return lib
    with tempfile.TemporaryDirectory() as tmp:
        t = Path(tmp)
        (t / "stub").mkdir()
        (t / "stub/hls_stream.h").write_text(HLS_STREAM)
        (t / "stub/ap_axi_sdata.h").write_text("#pragma once\n")
        (t / "vta_model.cc").write_text(src)
        (t / "harness.cc").write_text(HARNESS)
        cmd = ["g++", "-O2", "-shared", "-fPIC", "-std=c++14", "-w", f"-I{t / 'stub'}", f"-I{ap_types / 'include'}",
               f"-I{tvm_vta / 'include'}", f"-I{tvm_vta / 'hardware/xilinx/src'}", *defines,
               str(t / "vta_model.cc"), str(t / "harness.cc"), "-o", str(lib)]
        subprocess.run(cmd, check=True)
    return lib


class FPGAModel:
    """The compiled FPGA design as a :class:`tvm_layerfuse.runtime.vta.runtime.VTADevice` (no counters)."""

    def __init__(self, lib: Path) -> None:
        self.lib = ctypes.CDLL(str(lib))
        self.dram = np.zeros(0, np.uint8)

    def reset(self, image: np.ndarray) -> None:
        self.dram = np.ascontiguousarray(image, np.uint8).copy()

    def write(self, addr: int, data: np.ndarray) -> None:
        raw = np.ascontiguousarray(data).view(np.uint8).reshape(-1)
        self.dram[addr : addr + raw.size] = raw

    def read(self, addr: int, nbytes: int) -> np.ndarray:
        return self.dram[addr : addr + nbytes].copy()

    def run(self, stream: np.ndarray) -> Counters:
        s = np.ascontiguousarray(stream, np.uint8)
        self.lib.vta_run(ctypes.c_uint32(s.size // 16), s.ctypes.data_as(ctypes.c_void_p), self.dram.ctypes.data_as(ctypes.c_void_p))
        return Counters()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tvm-vta", type=Path, required=True, help="a checkout of apache/tvm-vta")
    ap.add_argument("--ap-types", type=Path, required=True, help="a checkout of Xilinx/HLS_arbitrary_Precision_Types")
    ap.add_argument("--nets", nargs="*", default=DEFAULT_NETS, help="zoo builder:key=value,... (default: %(default)s)")
    ap.add_argument("--build-dir", type=Path, default=Path(tempfile.gettempdir()) / "tvm_layerfuse_vta_fpga")
    args = ap.parse_args()
    args.build_dir.mkdir(parents=True, exist_ok=True)
    device = FPGAModel(build_model(args.tvm_vta, args.ap_types, args.build_dir))
    failed = 0
    for spec in args.nets:
        name, _, rest = spec.partition(":")
        kw = {k: (float(v) if "." in v else int(v)) for k, v in (p.split("=") for p in filter(None, rest.split(",")))}
        model = zoo.BUILDERS[name](seed=1, **kw)
        b = pipeline.build(model, baseline=True, n_calibration=2, seed=2)
        feeds = random_samples(b.graph, 1, seed=11)[0]
        for form, compiled in (("fused", b.fused), ("unfused", b.unfused)):
            trace: dict = {}
            ref = reference(compiled.graph, b.quantization, feeds, trace=trace)
            run = to_module(compiled, device=device).run(feeds, trace=True)
            bad = sorted(n for n, v in trace.items() if not np.array_equal(run.ints[n], v))
            bad += [o for o in compiled.graph.outputs if not np.array_equal(run.outputs[o], ref[o])]
            kinds: dict[str, int] = {}
            for p in compiled.programs.values():
                kinds[p.kind] = kinds.get(p.kind, 0) + 1
            print(f"{spec} {form}: programs {kinds}; {len(trace) - len(bad)} of {len(trace)} int8 tensors bit-exact "
                  f"with the int8 numpy reference on the FPGA design's C model" + (f"; differ: {bad[:5]}" if bad else ""))
            failed += bool(bad)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
