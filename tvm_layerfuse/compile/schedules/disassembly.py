"""What each kernel of a CPU artifact's library holds as machine code, read from its
disassembly (binutils' ``objdump -d``): whether it launches parallel work and how many vector
FMAs it has. ``inspect ARTIFACT`` prints it beside the schedule report (which says what the
TIR schedule asked for; this says what LLVM emitted).

A kernel ``K`` of the library is a family of functions (symbols)::

    __tvm_ffi_K    the packed entry point (argument checks; the body where LLVM inlines it)
    K              the body, where LLVM keeps it out of line
    K_compute_*    the body in its own function (MakePackedAPI's compute scope); a parallel
                   loop's body, TVM's ``__tvm_parallel_lambda``, has private linkage and no
                   symbol: it is emitted right after the function that launches it, and
                   objdump shows it as part of that function

parallel launch: a function of the family loads the runtime's ``__TVMBackendParallelLaunch``
pointer (its GOT slot, from the dynamic relocations, or the variable itself): x86_64 through a
``%rip``-relative operand whose address objdump prints; aarch64 through ``adrp xN, PAGE`` and
``ldr xM, [xN, #OFF]``.

vector FMA:  aarch64  ``fmla vD.4s, ...`` (NEON, 4 fp32 lanes, by vector or by element)
             x86_64   ``vfmadd...ps`` / ``vfnmadd...ps`` on a ``%ymm`` or ``%zmm`` register
(narrower ones, ``fmla vD.2s`` or ``%xmm``, and scalar ``fmadd`` / ``vfmadd...ss`` do not count).
"""

from __future__ import annotations

import platform
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any, Iterable, Optional

_FMA: dict[str, tuple[re.Pattern[str], str]] = {
    "aarch64": (re.compile(r"\tfmla\s+v\d+\.4s"), "fmla v.4s"),
    "x86_64": (re.compile(r"\tvfn?madd\d+ps\s+\S*%[yz]mm"), "vfmadd...ps ymm/zmm"),
}
_HEADER = re.compile(r"^[0-9a-f]+ <([^>]+)>:", re.M)
_ENTRY = "__tvm_ffi_"
_BODY = "_compute_"
_LAUNCH = "__TVMBackendParallelLaunch"
_X86_ADDRESS = re.compile(r"#\s*([0-9a-f]+)\s*<")  # the address of a %rip-relative operand
_ADRP = re.compile(r"\tadrp\s+(x\d+),\s*([0-9a-f]+)")
_LDR = re.compile(r"\tldr\s+x\d+,\s*\[(x\d+),\s*#(0x[0-9a-f]+|\d+)\]")


def objdump_for(machine: str) -> Optional[str]:
    """The objdump that reads ``machine``'s code here: this host's own for its machine, the
    cross binutils' ``<machine>-linux-gnu-objdump`` otherwise (None when missing)."""
    names = (["objdump"] if machine == platform.machine() else []) + [f"{machine}-linux-gnu-objdump"]
    return next((shutil.which(n) for n in names if shutil.which(n)), None)


def functions(text: str) -> dict[str, str]:
    """``objdump -d`` output -> {function name: its disassembly}."""
    heads = list(_HEADER.finditer(text))
    ends = [m.start() for m in heads[1:]] + [len(text)]
    return {m.group(1): text[m.start() : end] for m, end in zip(heads, ends)}


def launcher_addresses(symbols_and_relocations: str) -> set[int]:
    """The addresses that hold the ``__TVMBackendParallelLaunch`` pointer, from ``objdump -T -R``:
    the variable itself and the GOT slots relocated to it."""
    out = set()
    for line in symbols_and_relocations.splitlines():
        fields = line.split()
        if fields and re.fullmatch(r"[0-9a-f]+", fields[0]) and any(f.split("@")[0] == _LAUNCH for f in fields[1:]):
            out.add(int(fields[0], 16))
    return out


def _loaded_addresses(code: str, machine: str) -> set[int]:
    """The data addresses a function's code reads (see the module docstring)."""
    if machine == "x86_64":
        return {int(a, 16) for a in _X86_ADDRESS.findall(code)}
    pages: dict[str, int] = {}
    out = set()
    for line in code.splitlines():
        if m := _ADRP.search(line):
            pages[m.group(1)] = int(m.group(2), 16)
        elif (m := _LDR.search(line)) and m.group(1) in pages:
            out.add(pages[m.group(1)] + int(m.group(2), 0))
    return out


def kernel_code(disassembly: str, machine: str, kernels: Iterable[str], launcher: set[int]) -> dict[str, dict[str, Any]]:
    """{kernel: {"found", "parallel_launch", "vector_fmas"}} for each name in ``kernels``, from
    the disassembly (``objdump -d``) of the library that holds them; ``launcher``: the
    addresses of :func:`launcher_addresses`."""
    fma = _FMA[machine][0]
    funcs = functions(disassembly)
    out = {}
    for name in kernels:
        family = [funcs[f] for f in funcs if f in (name, _ENTRY + name) or f.startswith(name + _BODY)]
        out[name] = {
            "found": bool(family),
            "parallel_launch": any(_loaded_addresses(code, machine) & launcher for code in family),
            "vector_fmas": sum(len(fma.findall(code)) for code in family),
        }
    return out


def library_code(library: Path, machine: str, kernels: Iterable[str]) -> dict[str, Any]:
    """What :func:`kernel_code` finds in ``library`` (an artifact's ``model.so`` for
    ``machine``), with the tool and the FMA form counted; ``{"unavailable": reason}`` where
    the machine has no FMA form here or no objdump reads it."""
    if machine not in _FMA:
        return {"unavailable": f"no vector FMA form known for {machine} code (aarch64 and x86_64 are)"}
    tool = objdump_for(machine)
    if tool is None:
        package = "binutils" if machine == platform.machine() else f"binutils-{machine.replace('_', '-')}-linux-gnu"
        return {"unavailable": f"no objdump for {machine} code here - install it (apt-get install {package})"}
    outputs = []
    for flags in (["-d"], ["-T", "-R"]):
        done = subprocess.run([tool, *flags, str(library)], capture_output=True, text=True)
        if done.returncode != 0:
            last = (done.stderr.strip().splitlines() or ["no message"])[-1]
            return {"unavailable": f"{Path(tool).name} {' '.join(flags)} {library} failed: {last}"}
        outputs.append(done.stdout)
    disassembly, dynamic = outputs
    return {
        "tool": Path(tool).name,
        "fma": _FMA[machine][1],
        "kernels": kernel_code(disassembly, machine, kernels, launcher_addresses(dynamic)),
    }
