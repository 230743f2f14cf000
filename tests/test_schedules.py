"""The CPU schedule rules (``tvm_layerfuse/compile/schedules``): every kernel of an artifact
is scheduled, the scheduled convs agree with onnxruntime on every conv kind the zoo uses,
and the emitted code is parallel and vectorised (x86: FMAs on ymm/zmm; AArch64: ``fmla
v.4s``), with a MetaSchedule database still taking precedence.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import numpy as np
import onnx
import pytest

from tvm_layerfuse.compile.build import compile_model
from tvm_layerfuse.runtime.artifact import read_manifest
from tvm_layerfuse.testing._builder import NetBuilder
from tvm_layerfuse.testing.checks import run_onnxruntime

RTOL = 1e-4  # max |a - b| / max |a| against onnxruntime with optimisations off

# (name, input [C, H, W], out channels, kernel, stride, pad, groups): every conv kind of the zoo,
# with channel counts and widths that do not fill a vector (7, 13, 5, 37 ...)
CONVS = [
    ("pointwise", (16, 14, 14), 24, 1, 1, 0, 1),
    ("pointwise_odd", (13, 9, 9), 37, 1, 1, 0, 1),
    ("k3_pad", (16, 12, 12), 32, 3, 1, 1, 1),
    ("k3_nopad_odd", (7, 11, 11), 5, 3, 1, 0, 1),
    ("k5_pad", (8, 10, 10), 12, 5, 1, 2, 1),
    ("k7_stride2", (3, 32, 32), 16, 7, 2, 3, 1),
    ("k3_stride2", (12, 15, 15), 24, 3, 2, 1, 1),
    ("depthwise", (24, 14, 14), 24, 3, 1, 1, 24),
    ("depthwise_stride2_odd", (13, 13, 13), 13, 3, 2, 1, 13),
    ("grouped", (12, 9, 9), 18, 3, 1, 1, 3),
    ("one_column", (16, 3, 3), 20, 3, 1, 0, 1),  # a 1x1 output: vectorised over channels
    # channels in whole blocks of 16 (and so of 8 and 4): NCHW[x]c on every target
    ("blocked_pointwise", (32, 14, 14), 48, 1, 1, 0, 1),
    ("blocked_k3_nopad", (16, 10, 10), 32, 3, 1, 0, 1),
    ("blocked_k3_pad_prime_width", (16, 19, 19), 16, 3, 1, 1, 1),  # 19 columns: no divisor fits a tile
    ("blocked_k5_pad", (16, 9, 9), 16, 5, 1, 2, 1),
    ("blocked_k7_stride2", (16, 23, 23), 32, 7, 2, 3, 1),
    # partial register tiles: on AVX2 13 columns x 5 channel blocks in 2 x 3 tiles (a last tile of
    # 1 column, 2 blocks), 27 x 5 in 4 x 2 (3 columns, 1 block); on NEON 13 x 10 in 5 x 3 (3 x 1)
    ("blocked_k3_pad_tail_w13", (16, 13, 13), 40, 3, 1, 1, 1),
    ("blocked_pointwise_tail_w27", (8, 27, 27), 40, 1, 1, 0, 1),
]
BLOCKED_RULE = "conv2d NCHWc"


def _blocked(lanes: int) -> list[str]:
    """The convs of CONVS in the blocked layout for a target of ``lanes`` fp32 lanes: plain
    convs whose output channels fill whole blocks and whose input channels do too or are
    fewer than a block (an image's 3: one narrow block)."""
    return [n for n, (c, _, _), cout, _, _, _, g in CONVS if g == 1 and (c % lanes == 0 or c < lanes) and cout % lanes == 0]


def _conv_zoo() -> onnx.ModelProto:
    """One branch per conv kind (its own input: nothing merges them), each Conv (+ bias) + ReLU;
    one branch also has the pools and the classifier (dense) after it."""
    b = NetBuilder("conv_kinds", seed=5)
    outputs = []
    for k, (name, (c, h, w), cout, kernel, stride, pad, groups) in enumerate(CONVS):
        x = b.input(f"x_{name}", (1, c, h, w))
        y = b.relu(b.conv(x, cout, kernel, stride=stride, pad=pad, groups=groups, bias=k % 3 != 1))
        outputs.append(y)
    y = b.maxpool(outputs[2], 3, 2, 1)
    y = b.avgpool(y, 3, 1, 1, count_include_pad=False)
    outputs.append(b.linear(b.flatten(b.global_avgpool(y)), 10))
    # MobileNet's inverted residual: the depthwise convs between blocked convs are blocked too
    x = b.input("x_mobile", (1, 16, 19, 19))  # 19 columns: partial tiles (AVX2: 4 x 2 tiles, 7 + 7 + 5 depthwise)
    y = b.clip(b.conv(x, 32, 1))
    y = b.clip(b.conv(y, 32, 3, pad=1, groups=32))
    y = b.clip(b.conv(y, 32, 3, stride=2, pad=1, groups=32))  # 19 -> 10 columns
    outputs.append(b.conv(y, 16, 1))
    # 1x1 convs on small planes with a residual add and a ReLU in their epilogue: tiled over the
    # whole plane (AVX2: 49 = 12 x 4 + 1 positions, 169 = 42 x 4 + 1), the residual read per tile
    for size in (7, 13):
        x = b.input(f"x_plane{size}", (1, 128, size, size))
        outputs.append(b.relu(b.add(b.conv(x, 128, 1), x)))
    return b.build(outputs)


MOBILE_CONVS = 4  # the inverted-residual branch's convs, all blocked on every target
PLANE_CONVS = 2  # the 1x1 convs with a residual, blocked on every target


def _feeds(model: onnx.ModelProto, seed: int = 3) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {
        i.name: rng.standard_normal([d.dim_value for d in i.type.tensor_type.shape.dim]).astype(np.float32)
        for i in model.graph.input
    }


@pytest.fixture(scope="module")
def conv_zoo(tmp_path_factory):
    d = tmp_path_factory.mktemp("schedules")
    model = _conv_zoo()
    onnx.save(model, d / "convs.onnx")
    return model, d


@pytest.fixture(scope="module")
def x86_artifact(conv_zoo):
    model, d = conv_zoo
    return compile_model(d / "convs.onnx", d / "cpu", target="cpu", tactics="tvm", progress=False)


def _rel_err(ref: np.ndarray, got: np.ndarray) -> float:
    return float(np.abs(ref - got).max() / max(np.abs(ref).max(), 1e-30))


def _conv_kernels(manifest: dict) -> dict[str, dict]:
    return {k: v for k, v in manifest["schedules"]["kernels"].items() if "conv2d" in k}


def test_scheduled_convs_agree_with_onnxruntime(conv_zoo, x86_artifact):
    from tvm_layerfuse import runtime

    model, _ = conv_zoo
    feeds = _feeds(model)
    got = runtime.load(x86_artifact, device="cpu").run(feeds)
    refs = run_onnxruntime(model, feeds)
    names = [o.name for o in model.graph.output]
    errors = {n: _rel_err(r, got[n]) for n, r in zip(names, refs)}
    assert max(errors.values()) <= RTOL, errors
    # a plausible schedule bug (a tile's tail dropped) would leave zeros: the outputs are alive
    assert all(float(np.abs(r).max()) > 0 for r in refs)

    manifest = read_manifest(x86_artifact)
    kernels = _conv_kernels(manifest)
    assert len(kernels) == len(CONVS) + MOBILE_CONVS + PLANE_CONVS
    rules = [v["rule"] for v in kernels.values()]
    assert set(rules) == {"conv2d", BLOCKED_RULE}, kernels  # not a fallback rule
    lanes = manifest["schedules"]["lanes"]
    assert rules.count(BLOCKED_RULE) == len(_blocked(lanes)) + MOBILE_CONVS + PLANE_CONVS, kernels
    tactics = manifest["tactics"]
    blocked = len(_blocked(lanes)) + MOBILE_CONVS + PLANE_CONVS
    assert (tactics["tvm_layout"], tactics["blocked_convs"]) == (f"NCHW{lanes}c", blocked), tactics


def test_artifact_has_no_unscheduled_kernel(x86_artifact):
    schedules = read_manifest(x86_artifact)["schedules"]
    assert schedules["unscheduled"] == []
    rules = {v["rule"] for v in schedules["kernels"].values()}
    assert None not in rules
    assert {"conv2d", "dense", "pool/reduction"} <= rules
    # every kernel bigger than a vector has vector code
    assert schedules["vectorized"] == schedules["total"], schedules["kernels"]
    assert schedules["isa"] in ("avx2", "avx512") and schedules["lanes"] in (8, 16)


def test_inspect_shows_the_rule_of_every_kernel(x86_artifact, capsys):
    from tvm_layerfuse.cli.commands import main

    assert main(["inspect", str(x86_artifact)]) == 0
    out = capsys.readouterr().out
    kernels = read_manifest(x86_artifact)["schedules"]["kernels"]
    summary = next(line for line in out.splitlines() if line.startswith("schedules:"))
    assert "none unscheduled" in summary and "conv2d " in summary and "parallel" in summary, summary
    for name, k in kernels.items():  # one line per kernel: its name and rule
        assert re.search(rf"^  {re.escape(name)}\s+{re.escape(k['rule'])}", out, re.M), name


def _objdump(tool: str, library: Path) -> str:
    if shutil.which(tool) is None:
        pytest.skip(f"{tool} is missing (binutils)")
    return subprocess.run([tool, "-d", "-T", str(library)], capture_output=True, text=True, check=True).stdout


def _function(text: str, name: str) -> str:
    """The disassembly of the kernel ``name`` and the parallel bodies TVM outlines from it
    (``name_compute_``): everything up to the next function not of its family."""
    parts = re.split(r"\n(?=[0-9a-f]+ <)", text)
    body = [p for p in parts if re.match(rf"[0-9a-f]+ <{re.escape(name)}(_compute_\w*)?>:", p)]
    assert body, f"no function {name} in the library"
    return "\n".join(body)


def test_x86_conv_kernel_is_parallel_and_vectorised(x86_artifact):
    kernels = _conv_kernels(read_manifest(x86_artifact))
    assert any(v["parallel"] and v["vectorized"] for v in kernels.values()), kernels
    blocked = [k for k, v in kernels.items() if v["rule"] == BLOCKED_RULE]
    assert blocked and all(kernels[k]["parallel"] and kernels[k]["vectorized"] for k in blocked), kernels
    text = _objdump("objdump", x86_artifact / "model.so")
    assert "__TVMBackendParallelLaunch" in text
    assert re.search(r"vfmadd\d+ps\s+%[yz]mm", text), "no vector FMA on ymm/zmm registers"
    for name in blocked:
        assert re.search(r"vfmadd\d+ps\s+\S*%[yz]mm", _function(text, name)), f"{name}: no vector FMA"


@pytest.fixture(scope="module")
def aarch64_artifact(conv_zoo):
    if shutil.which("aarch64-linux-gnu-gcc") is None:
        pytest.skip("aarch64-linux-gnu-gcc is missing: run scripts/setup_arm64_board.sh (apt: gcc-aarch64-linux-gnu)")
    _, d = conv_zoo
    return compile_model(d / "convs.onnx", d / "aarch64", target="aarch64", progress=False)


def test_aarch64_conv_kernel_is_parallel_and_vectorised(aarch64_artifact):
    schedules = read_manifest(aarch64_artifact)["schedules"]
    assert schedules["isa"] == "neon" and schedules["lanes"] == 4
    assert schedules["unscheduled"] == []
    kernels = _conv_kernels(read_manifest(aarch64_artifact))
    rules = [v["rule"] for v in kernels.values()]
    assert set(rules) == {"conv2d", BLOCKED_RULE}, kernels
    assert rules.count(BLOCKED_RULE) == len(_blocked(4)) + MOBILE_CONVS + PLANE_CONVS, kernels
    blocked = [v for v in kernels.values() if v["rule"] == BLOCKED_RULE]
    assert all(v["vectorized"] for v in blocked), kernels
    # all parallel but one_column's (a 1x1 output: too little work for a parallel launch)
    assert sum(v["parallel"] for v in blocked) == len(blocked) - 1, kernels
    text = _objdump("aarch64-linux-gnu-objdump", aarch64_artifact / "model.so")
    assert "__TVMBackendParallelLaunch" in text
    fmla = len(re.findall(r"\tfmla\s+v\d+\.4s", text))
    assert fmla >= 20, f"{fmla} vector FMAs (fmla v.4s) in the library"
    # the blocked conv kernels themselves: vector FMAs with a broadcast lane or vector operand
    blocked = [k for k, v in kernels.items() if v["rule"] == BLOCKED_RULE]
    for name in blocked:
        body = _function(text, name)
        assert re.search(r"\tfmla\s+v\d+\.4s", body), f"{name}: no fmla v.4s"


# objdump -d lines (a tab before the mnemonic) of a library with kernels conv, conv_1 and pool;
# the __TVMBackendParallelLaunch pointer's GOT slot is at 0x3ffc8; conv loads it (a parallel
# launch), conv_1 loads the slot next to it
_DISASSEMBLY = {
    "aarch64": """
0000000000000e74 <__tvm_ffi_conv>:
     e74:\t4e20cc00 \tfmla\tv0.4s, v0.4s, v0.4s
0000000000001000 <conv_compute_>:
    1000:\tb0000148 \tadrp\tx8, 3f000 <__FRAME_END__+0x1b87c>
    1004:\tf947e508 \tldr\tx8, [x8, #4040]
    1008:\t4f801000 \tfmla\tv0.4s, v0.4s, v0.s[0]
    100c:\t0e20cc00 \tfmla\tv0.2s, v0.2s, v0.2s
0000000000002000 <__tvm_ffi_conv_1>:
    2000:\t1f000000 \tfmadd\ts0, s0, s0, s0
    2004:\tb0000148 \tadrp\tx9, 3f000 <__FRAME_END__+0x1b87c>
    2008:\tf947e508 \tldr\tx8, [x9, #4048]
0000000000003000 <conv_1_compute_>:
    3000:\t4e20f400 \tfmax\tv0.4s, v0.4s, v0.4s
    3004:\t4e23cc41 \tfmla\tv1.4s, v2.4s, v3.4s
0000000000004000 <__tvm_ffi_pool>:
    4000:\t4e20cc00 \tfadd\tv0.4s, v0.4s, v0.4s
""",
    "x86_64": """
0000000000001000 <__tvm_ffi_conv>:
    1000:\tc4 e2 75 b8 c2       \tvfmadd231ps %ymm2,%ymm1,%ymm0
0000000000001100 <conv_compute_>:
    1100:\t48 8b 05 35 d0 01 00 \tmov    0x1d035(%rip),%rax        # 3ffc8 <__TVMBackendParallelLaunch@@Base-0x60>
    1107:\tc4 e2 75 b8 40 20    \tvfmadd231ps 0x20(%rax),%ymm1,%ymm0
    110d:\t62 f2 75 48 bc c2    \tvfnmadd231ps %zmm2,%zmm1,%zmm0
0000000000002000 <__tvm_ffi_conv_1>:
    2000:\tc4 e2 71 b8 c2       \tvfmadd231ps %xmm2,%xmm1,%xmm0
    2005:\tc4 e2 71 b9 c2       \tvfmadd231ss %xmm2,%xmm1,%xmm0
    200a:\t48 8b 05 35 d0 01 00 \tmov    0x1d035(%rip),%rax        # 3ffd0 <__TVMBackendParallelLaunch@@Base-0x58>
0000000000003000 <conv_1_compute_>:
    3000:\tc5 f4 5f c2          \tvmaxps %ymm2,%ymm1,%ymm0
    3004:\tc4 e2 6d a8 cb       \tvfmadd213ps %ymm3,%ymm2,%ymm1
0000000000004000 <__tvm_ffi_pool>:
    4000:\tc5 f4 58 c2          \tvaddps %ymm2,%ymm1,%ymm0
""",
}
_DYNAMIC = """
DYNAMIC SYMBOL TABLE:
0000000000040030  w   DO .bss\t0000000000000008  Base        __TVMBackendParallelLaunch

DYNAMIC RELOCATION RECORDS
OFFSET           TYPE              VALUE
000000000003ffc8 R_AARCH64_GLOB_DAT  __TVMBackendParallelLaunch@@Base
000000000003ffd0 R_AARCH64_GLOB_DAT  __TVMFFIEnvModRegisterCAPI@@Base
"""


@pytest.mark.parametrize("machine", sorted(_DISASSEMBLY))
def test_kernel_code_reads_each_kernels_own_functions(machine):
    """A kernel's code is its entry point and its compute functions, not another kernel's
    whose name it begins (conv / conv_1); a parallel launch is a load of the launcher's GOT
    slot; only 4-lane NEON / ymm-zmm FMAs count."""
    from tvm_layerfuse.compile.schedules.disassembly import kernel_code, launcher_addresses

    launcher = launcher_addresses(_DYNAMIC)
    assert launcher == {0x40030, 0x3FFC8}
    code = kernel_code(_DISASSEMBLY[machine], machine, ["conv", "conv_1", "pool", "absent"], launcher)
    assert code == {
        "conv": {"found": True, "parallel_launch": True, "vector_fmas": 3 if machine == "x86_64" else 2},
        "conv_1": {"found": True, "parallel_launch": False, "vector_fmas": 1},
        "pool": {"found": True, "parallel_launch": False, "vector_fmas": 0},
        "absent": {"found": False, "parallel_launch": False, "vector_fmas": 0},
    }


@pytest.mark.parametrize("fixture", ["x86_artifact", "aarch64_artifact"])
def test_inspect_counts_parallel_launches_and_vector_fmas(fixture, request, capsys):
    """`inspect ARTIFACT` reads the library's disassembly: every kernel the schedule made
    parallel launches parallel work, every blocked conv has vector FMAs, pools (no multiply)
    have none, and the summary counts what the kernel lines say."""
    from tvm_layerfuse.cli.commands import main

    art = request.getfixturevalue(fixture)
    machine = read_manifest(art)["target"]["machine"]
    tool, fma = ("objdump", r"vfn?madd\d+ps\s+\S*%[yz]mm") if machine == "x86_64" else ("aarch64-linux-gnu-objdump", r"\tfmla\s+v\d+\.4s")
    text = _objdump(tool, art / "model.so")
    assert main(["inspect", str(art)]) == 0
    out = capsys.readouterr().out
    schedules = read_manifest(art)["schedules"]
    kernels = {k: v for k, v in schedules["kernels"].items() if "view" not in v["rule"] and "library call" not in v["rule"]}
    lines = {}
    for name in kernels:
        m = re.search(rf"^  {re.escape(name)}\s.*code: (parallel launch|one thread), (\d+) vector FMAs$", out, re.M)
        assert m, f"{name}: no code in its line"
        lines[name] = (m.group(1) == "parallel launch", int(m.group(2)))
    assert {k: p for k, (p, _) in lines.items()} == {k: v["parallel"] for k, v in kernels.items()}
    for name, v in kernels.items():
        if v["rule"] == BLOCKED_RULE:
            parts = re.split(r"\n(?=[0-9a-f]+ <)", text)
            own = [p for p in parts if re.match(rf"[0-9a-f]+ <(__tvm_ffi_)?{re.escape(name)}(_compute_\w*)?>:", p)]
            assert lines[name][1] == sum(len(re.findall(fma, p)) for p in own) > 0, name
        if v["rule"] == "pool/reduction" and "max_pool" in name:
            assert lines[name][1] == 0, name
    summary = next(line for line in out.splitlines() if line.startswith("code ("))
    total = len(kernels)
    assert f"{sum(p for p, _ in lines.values())} of {total} kernels launch parallel work" in summary, summary
    assert f"{sum(n > 0 for _, n in lines.values())} of {total} have vector FMAs" in summary, summary


def test_aarch64_schedules_agree_with_onnxruntime_on_the_emulated_board(conv_zoo, aarch64_artifact):
    from tvm_layerfuse import deploy as rpc
    from tvm_layerfuse.deploy import board

    try:
        board.arm64_board()
    except board.BoardError as e:
        pytest.skip(f"emulated AArch64 board not set up: {e}")
    if shutil.which("qemu-aarch64-static") is None:
        pytest.skip("qemu-aarch64-static is missing: run scripts/setup_arm64_board.sh")
    model, _ = conv_zoo
    feeds = _feeds(model, seed=4)
    with board.start_arm64_board(port=0) as server:
        result = rpc.deploy(aarch64_artifact, rpc=server.address, inputs=feeds, repeat=1, timeout=300)
    refs = run_onnxruntime(model, feeds)
    names = [o.name for o in model.graph.output]
    errors = {n: _rel_err(r, result.outputs[n]) for n, r in zip(names, refs)}
    assert max(errors.values()) <= RTOL, errors


def test_what_onednn_leaves_to_tvm_is_scheduled(tmp_path):
    """With the default tactics the kernels oneDNN does not take (a product of two convs, the
    softmax) are TVM's, and scheduled too; the numbers still match."""
    from tvm_layerfuse import runtime

    b = NetBuilder("leftovers", seed=7)
    x = b.input("x", (1, 8, 12, 12))
    y = b.mul(b.relu(b.conv(x, 16, 3, pad=1)), b.conv(x, 16, 1))
    y = b.linear(b.flatten(b.global_avgpool(b.maxpool(y, 2, 2))), 10)
    model = b.build([b.node("Softmax", [y], [(1, 10)], axis=1)[0]])
    onnx.save(model, tmp_path / "m.onnx")
    art = compile_model(tmp_path / "m.onnx", tmp_path / "m", target="cpu", progress=False, winograd="never")
    schedules = read_manifest(art)["schedules"]
    assert schedules["unscheduled"] == [] and schedules["total"] >= 2, schedules
    feeds = _feeds(model)
    got = runtime.load(art, device="cpu").run(feeds)
    (ref,) = run_onnxruntime(model, feeds)
    assert _rel_err(ref, next(iter(got.values()))) <= RTOL


# ---------------------------------------------------------------------- the pass itself
NEON = {"kind": "llvm", "mtriple": "aarch64-linux-gnu", "mattr": ["+neon"]}


def _conv_module(target: dict = NEON):
    import tvm
    from tvm import relax

    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((1, 8, 12, 12), "float32"))
    w = relax.Var("w", relax.TensorType((16, 8, 3, 3), "float32"))
    with bb.function("main", [x, w]):
        with bb.dataflow():
            y = bb.emit(relax.op.nn.relu(relax.op.nn.conv2d(x, w, padding=1)))
            o = bb.emit_output(relax.op.add(y, relax.const(1.0)))
        bb.emit_func_output(o)
    passes = [relax.transform.LegalizeOps(), relax.transform.AnnotateTIROpPattern(), relax.transform.FuseOps(), relax.transform.FuseTIR()]
    tgt = tvm.target.Target(target)
    with tgt:
        return tvm.transform.Sequential(passes)(bb.get()), tgt


def test_a_wrapper_around_a_library_call_is_left_as_written():
    """TIR without blocks (the oneDNN tactic's in-place conv wrapper: one ``call_packed``) is
    not a loop nest: no rule, and not counted as unscheduled."""
    import tvm
    from tvm.script import tirx as T

    from tvm_layerfuse.compile.schedules import ApplySchedules

    @T.prim_func(private=True)
    def wrap(x: T.Buffer((4,), "float32"), y: T.Buffer((4,), "float32")):
        T.call_packed("layerfuse.test.copy", x, y)

    mod = tvm.IRModule({"wrap": wrap})
    tgt = tvm.target.Target({"kind": "llvm"})
    apply = ApplySchedules(tgt)
    with tgt:
        out = apply(mod)
    tvm.ir.assert_structural_equal(out["wrap"], wrap)
    report = apply.report.to_dict()
    assert report["kernels"]["wrap"]["rule"] == "library call (no loop nest)"
    assert report["unscheduled"] == [] and report["total"] == 0


def test_a_tuned_kernel_keeps_its_schedule():
    """A kernel MetaSchedule's database scheduled (``tirx.is_scheduled``) is left as it is and
    reported as tuned; the others get a rule. The database pass runs first in the pipeline."""
    import tvm
    from tvm import tirx

    from tvm_layerfuse.compile.schedules import ApplySchedules
    from tvm_layerfuse.lowering import layerfuse_pipeline

    mod, tgt = _conv_module()
    (gv,) = [g for g, f in mod.functions_items() if isinstance(f, tirx.PrimFunc)]
    tuned = mod[gv].with_attr("tirx.is_scheduled", True)
    mod.update_func(gv, tuned)
    apply = ApplySchedules(tgt)
    with tgt:
        out = apply(mod)
    tvm.ir.assert_structural_equal(out[gv], tuned)
    assert apply.report.kernels[gv.name_hint].rule == "metaschedule"

    with tgt:
        names = [p.info.name for p in layerfuse_pipeline(tgt, database="db").passes()]
    assert names.index("MetaScheduleApplyDatabase") < names.index("LayerfuseSchedules")


def test_a_padding_after_a_pool_is_written_whole():
    """max_pool2d then a padding of one row at the bottom, fused into one kernel (a Conv with
    ``auto_pad=SAME_UPPER`` after a MaxPool). The padding writes more rows than the pool: it
    stays a loop nest of its own instead of being computed per pool tile, which never wrote
    the padded row (uninitialised memory in the output; fuzz.py with the exporter blocks,
    seed 901). The output starts as NaN, so a row left unwritten shows."""
    import tvm
    from tvm import relax, tirx

    from tvm_layerfuse.compile.schedules import ApplySchedules

    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((2, 8, 6, 6), "float32"))
    with bb.function("main", [x]):
        with bb.dataflow():
            y = bb.emit(relax.op.nn.max_pool2d(x, pool_size=(3, 3), strides=(1, 1)))  # [2, 8, 4, 4]
            o = bb.emit_output(relax.op.nn.pad(y, [0, 0, 0, 0, 0, 1, 0, 0]))  # [2, 8, 5, 4]
        bb.emit_func_output(o)
    passes = [relax.transform.LegalizeOps(), relax.transform.AnnotateTIROpPattern(), relax.transform.FuseOps(), relax.transform.FuseTIR()]
    tgt = tvm.target.Target({"kind": "llvm", "num-cores": 2})
    apply = ApplySchedules(tgt)
    with tgt:
        mod = apply(tvm.transform.Sequential(passes)(bb.get()))
    (gv,) = [g for g, f in mod.functions_items() if isinstance(f, tirx.PrimFunc)]
    assert apply.report.kernels[gv.name_hint].rule == "pool/reduction"
    kernel = tvm.compile(tvm.IRModule({"main": mod[gv].with_attr("global_symbol", "main")}), target=tgt)
    data = np.random.default_rng(7).standard_normal((2, 8, 6, 6)).astype(np.float32)
    out = tvm.runtime.tensor(np.full((2, 8, 5, 4), np.nan, np.float32))
    kernel["main"](tvm.runtime.tensor(data), out)
    pooled = np.lib.stride_tricks.sliding_window_view(data, (3, 3), axis=(2, 3)).max(axis=(-2, -1))  # [2, 8, 4, 4]
    np.testing.assert_array_equal(out.numpy(), np.pad(pooled, [(0, 0), (0, 0), (0, 1), (0, 0)]))


@pytest.mark.parametrize(
    "target, isa, lanes, width",
    [
        (NEON, "neon", 4, 4),  # 12 output columns: three vectors of 4
        ({"kind": "llvm", "mcpu": "znver3"}, "avx2", 8, 6),  # 8 does not divide 12; a vector of 12 would shuffle
        ({"kind": "llvm", "mcpu": "skylake-avx512"}, "avx512", 16, 12),  # one vector
    ],
)
def test_the_conv_rule_uses_the_target_vector_width(target, isa, lanes, width):
    """The conv's innermost loop is a vector of output columns sized by the target, under an
    unrolled tile of output channels, under one parallel loop (compiled, not run: the
    AVX-512 and NEON kernels do not run on every build machine)."""
    from tvm_layerfuse.compile.schedules import ApplySchedules

    mod, tgt = _conv_module(target)
    apply = ApplySchedules(tgt)
    with tgt:
        out = apply(mod)
    (name,) = apply.report.kernels
    assert apply.report.kernels[name].rule == "conv2d"
    assert (apply.report.isa, apply.report.lanes) == (isa, lanes)
    text = out[name].script()
    assert "T.parallel" in text and "T.unroll" in text
    assert f"T.vectorized(T.int64({width}))" in text, text


AVX2 = {"isa": "avx2", "lanes": 8, "registers": 16}


@pytest.mark.parametrize(
    "params, width, chunks, tile",
    [
        (AVX2, 56, 8, (4, 2)),  # divisors where they are as good as any: unchanged
        (AVX2, 28, 16, (4, 2)),
        (AVX2, 14, 32, (2, 4)),
        (AVX2, 13, 125, (2, 4)),  # SqueezeNet's last conv: 7 tiles of 2 columns (the last 1), 32 of 4 blocks (the last 1)
        (AVX2, 27, 16, (4, 2)),  # 3 x 2 divides 27 but loads 5 vectors per 6 FMAs
        (AVX2, 55, 8, (4, 2)),  # 5 x 1 divides 55: 5 FMAs per 6 loads
        (AVX2, 13, 5, (2, 3)),
        (AVX2, 7, 64, (4, 2)),
        (AVX2, 19, 1, (7, 1)),  # one channel block (a depthwise conv): 7 + 7 + 5 columns
        (AVX2, 15, 1, (5, 1)),  # 8 + 7 scores as 5 + 5 + 5, which has no partial tile
        (AVX2, 3, 2, (3, 2)),
        ({"isa": "neon", "lanes": 4, "registers": 32}, 13, 125, (5, 3)),
        ({"isa": "neon", "lanes": 4, "registers": 32}, 56, 16, (4, 4)),
    ],
)
def test_register_tile_scores_loads_and_the_partial_tile(params, width, chunks, tile):
    """The tile of the most FMAs per load times the fraction of its slots that hold outputs,
    within half the vector registers as accumulators; it need not divide the row or the
    channel blocks."""
    from tvm_layerfuse.compile.schedules.base import CPUParams
    from tvm_layerfuse.compile.schedules.conv2d_nchwc import register_tile

    p = CPUParams(cores=2, **params)
    w, c = register_tile(width, chunks, p)
    assert (w, c) == tile
    assert w <= width and c <= chunks and w * c <= p.registers // 2 and w * c + c + 1 <= p.registers


def _lowered_blocked_conv(cin: int, width: int, cout: int, kernel: int, pad: int, flat: bool = False):
    """A blocked conv + bias (+ a residual where ``flat``) + ReLU (NCHW8c) legalized and fused
    as the pipeline does (int64 indices), scheduled by the rule for AVX2 and compiled by TVM's
    default pipeline: (the kernel as TVM's lowering leaves it after ``LoopPartition``,
    ``UnrollLoop`` and ``Simplify``, its register tile (over the whole plane where ``flat``),
    the compiled library, the argument shapes)."""
    import tvm
    from tvm import relax, tirx

    from tvm_layerfuse.compile.schedules.base import CPUParams
    from tvm_layerfuse.compile.schedules.conv2d_nchwc import Conv2DNCHWc, register_tile
    from tvm_layerfuse.lowering.blocked_conv import LegalizeBlockedConv

    tgt = tvm.target.Target({"kind": "llvm", "mcpu": "znver3", "num-cores": 2})
    params = CPUParams.of(tgt)
    chunks = cout // 8
    out_w = width + 2 * pad - kernel + 1
    out_shape = (1, chunks, out_w, out_w, 8)
    shapes = [(1, cin // 8, width, width, 8), (chunks, cin // 8, kernel, kernel, 8, 8), (1, chunks, 1, 1, 8)]
    shapes += [out_shape] if flat else []
    bb = relax.BlockBuilder()
    args = [relax.Var(n, relax.TensorType(s, "float32")) for n, s in zip(("data", "weight", "bias", "residual"), shapes)]
    with bb.function("main", args):
        with bb.dataflow():
            y = bb.emit(relax.op.nn.conv2d(args[0], args[1], padding=pad, data_layout="NCHW8c", kernel_layout="OIHW8i8o"))
            y = relax.op.add(y, args[2])
            o = bb.emit_output(relax.op.nn.relu(relax.op.add(y, args[3]) if flat else y))
        bb.emit_func_output(o)
    passes = [LegalizeBlockedConv(), relax.transform.AnnotateTIROpPattern(), relax.transform.FuseOps(), relax.transform.FuseTIR()]
    with tgt:
        mod = tvm.transform.Sequential(passes)(bb.get())
    (func,) = [f for _, f in mod.functions_items() if isinstance(f, tirx.PrimFunc)]
    sch = Conv2DNCHWc().apply(func, params, tgt)
    tile = register_tile(out_w * out_w, chunks, params, flat=True) if flat else register_tile(out_w, chunks, params)

    seen = []

    @tvm.instrument.pass_instrument
    class AfterRemoveNoOp:  # the last one runs after UnrollLoop and StmtSimplify
        def run_after_pass(self, mod, info):
            if info.name == "tirx.RemoveNoOp":
                seen.append(mod["main"])

    with tvm.transform.PassContext(instruments=[AfterRemoveNoOp()]):
        lib = tvm.compile(tvm.IRModule({"main": sch.mod["main"].with_attr("global_symbol", "main")}), target=tgt)
    return seen[-1], tile, lib, shapes + [out_shape]


def _fmas(func) -> tuple[int, int]:
    """(weight loads, those under an ``if`` or in a select) in a lowered kernel's script: in
    the conv's update every statement loads one weight vector, for one FMA."""
    total = guarded = 0
    open_ifs: list[int] = []  # indents of the enclosing if/else blocks
    for line in func.script().splitlines():
        indent = len(line) - len(line.lstrip())
        while open_ifs and indent <= open_ifs[-1]:
            open_ifs.pop()
        if re.match(r"(if|elif|else)\b", line.strip()):
            open_ifs.append(indent)
        n = len(re.findall(r"\bweight(_\d+)?\[", line))
        total += n
        guarded += n if open_ifs or "if_then_else" in line else 0
    return total, guarded


@pytest.mark.parametrize(
    "shape, tile, flat",
    [
        ((16, 13, 40, 3, 1), (2, 3), False),  # a last tile of 1 column, one of 2 channel blocks
        ((8, 27, 40, 1, 0), (4, 2), False),  # 3 columns, 1 block (5 channel tiles: too few for the plane)
        ((16, 10, 16, 3, 1), (4, 2), False),  # 10 = 4 + 4 + 2 columns, the blocks divide
        # 1x1 on small planes, tiled over the plane: 49 = 12 x 4 + 1 positions (rows: 7 x (4 + 3)),
        # 169 = 42 x 4 + 1 (rows: 13 x (2 + 2 + 2 + 2 + 2 + 2 + 1) in 2 x 4 tiles); 196 = 49 x 4
        ((64, 7, 136, 1, 0), (4, 2), True),  # 17 channel blocks: a last tile of 1 block too
        ((32, 13, 128, 1, 0), (4, 2), True),
        ((32, 14, 128, 1, 0), (4, 2), True),  # rows: 2 x 4 tiles; the plane: no partial tile
    ],
)
def test_partial_tiles_run_unpredicated_and_whole(shape, tile, flat):
    """A tile that divides neither the row (or plane) nor the channel blocks: after TVM's
    lowering no FMA is under a condition (the full tiles and the partial last ones are loops
    of their own), and the unrolled FMAs are exactly the tiles' (full + partial) per
    reduction step: none wasted, none missing. A 1x1 conv on a small plane runs along the
    whole plane, with plain addresses (no division or modulo left by the flattening). The
    kernel computes the conv, every output written (the output starts as NaN)."""
    import tvm

    cin, width, cout, kernel, pad = shape
    func, got_tile, lib, shapes = _lowered_blocked_conv(cin, width, cout, kernel, pad, flat=flat)
    assert got_tile == tile
    total, guarded = _fmas(func)
    assert guarded == 0, func.script()
    text = func.script()
    assert not flat or ("//" not in text and "%" not in text), text  # (a padding pass has its own)
    w, c = tile
    chunks, icb, out_w = cout // 8, 8, shapes[-1][3]
    # per (reduction step of ic_0, kh, kw) x (channel-tile kind) x (column-tile kind): icb * cols * blocks FMAs
    run = out_w * out_w if flat else out_w  # the positions a tile runs along
    col_kinds = [w] + ([run % w] if run % w else [])
    blk_kinds = [c] + ([chunks % c] if chunks % c else [])
    assert total == sum(icb * a * b for a in col_kinds for b in blk_kinds), func.script()

    rng = np.random.default_rng(2)
    args = [rng.standard_normal(s).astype(np.float32) for s in shapes[:-1]]
    out = np.full(shapes[-1], np.nan, np.float32)
    res = tvm.runtime.tensor(out)
    lib["main"](*[tvm.runtime.tensor(a) for a in args], res)
    data, weight, bias = args[:3]
    padded = np.pad(data, [(0, 0), (0, 0), (pad, pad), (pad, pad), (0, 0)])
    ref = np.zeros_like(out)
    for ry in range(kernel):
        for rx in range(kernel):
            window = padded[:, :, ry : ry + out_w, rx : rx + out_w, :]  # [n, C_o, y, x, c_i]
            ref += np.einsum("ncyxi,ocij->noyxj", window, weight[:, :, ry, rx])
    ref = np.maximum(ref + bias + (args[3] if flat else 0), 0)
    assert _rel_err(ref, res.numpy()) <= RTOL


def test_blocked_layout_transforms_each_activation_once():
    """Two blocked convs exchange a blocked tensor (no transform between them); the two
    grouped convs that stay NCHW read one transform of it, not one each; the blocked
    module computes what the plain one computes."""
    import tvm
    from tvm import relax

    from tvm_layerfuse.lowering import layerfuse_pipeline
    from tvm_layerfuse.relax.blocked_layout import BlockedConvLayout

    rng = np.random.default_rng(11)
    shapes = {"w1": (16, 16, 3, 3), "w2": (32, 16, 1, 1), "d1": (16, 4, 3, 3), "d2": (16, 4, 3, 3)}
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((1, 16, 10, 10), "float32"))
    ws = {k: relax.Var(k, relax.TensorType(v, "float32")) for k, v in shapes.items()}
    with bb.function("main", [x, *ws.values()]):
        with bb.dataflow():
            y = bb.emit(relax.op.nn.relu(relax.op.nn.conv2d(x, ws["w1"], padding=1)))
            e = bb.emit(relax.op.nn.conv2d(y, ws["w2"]))  # [1, 32, 10, 10]
            a = bb.emit(relax.op.nn.conv2d(y, ws["d1"], padding=1, groups=4))
            b = bb.emit(relax.op.nn.conv2d(y, ws["d2"], padding=1, groups=4))
            o = bb.emit_output(relax.op.concat([e, relax.op.add(a, b)], axis=1))
        bb.emit_func_output(o)
    plain = bb.get()
    layout = BlockedConvLayout(8)
    blocked = layout(plain)
    assert (layout.blocked, layout.convs) == (2, 4)

    transforms = []  # the activations a layout_transform reads
    relax.analysis.post_order_visit(
        blocked["main"].body,
        lambda v: transforms.append(v.args[0])
        if isinstance(v, relax.Call) and getattr(v.op, "name", "") == "relax.layout_transform" and v.args[0] not in ws.values()
        else None,
    )
    # x -> blocked; y -> NCHW once for both grouped convs; e -> NCHW for the concat
    assert len(transforms) == 3, blocked["main"]

    tgt = tvm.target.Target({"kind": "llvm", "num-cores": 2})
    args = [rng.standard_normal((1, 16, 10, 10)).astype(np.float32)]
    args += [rng.standard_normal(s).astype(np.float32) * 0.3 for s in shapes.values()]
    outs = []
    for mod in (plain, blocked):
        ex = tvm.compile(mod, target=tgt, relax_pipeline=layerfuse_pipeline(tgt))
        vm = relax.VirtualMachine(ex, tvm.cpu())
        outs.append(vm["main"](*[tvm.runtime.tensor(v) for v in args]).numpy())
    assert _rel_err(outs[0], outs[1]) <= 1e-5 and float(np.abs(outs[0]).max()) > 0


def _inception(seed: int = 9) -> onnx.ModelProto:
    """A stem conv, a pool, an Inception block (three 1x1 branches that merge horizontally
    into one conv and a split, a 3x3 after one of them, a pool branch), a concat, a conv
    after it and a residual add: every op between the blocked convs of GoogLeNet/ResNet."""
    b = NetBuilder("inception_blocked", seed=seed)
    x = b.input("x", (1, 16, 14, 14))
    s = b.maxpool(b.relu(b.conv(x, 32, 3, pad=1)), 3, 1, 1)
    one = b.relu(b.conv(s, 16, 1))
    two = b.relu(b.conv(b.relu(b.conv(s, 32, 1)), 32, 3, pad=1))
    three = b.relu(b.conv(s, 16, 1))
    four = b.relu(b.conv(b.maxpool(s, 3, 1, 1), 16, 1))
    cat = b.concat([one, two, three, four])  # 80 channels: whole blocks of 16 (and 8, 4)
    y = b.relu(b.add(b.conv(cat, 32, 1), s))
    return b.build([b.global_avgpool(b.maxpool(y, 2, 2))])


def test_blocked_graph_transforms_only_at_its_edges(tmp_path):
    """The fused model's convs, pools, split pieces, concat and residual add all run blocked:
    the only activation transforms are the input's and the one before the global pool; the
    merged conv still writes its split pieces and the concat stays in place; the numbers
    match onnxruntime."""
    from tvm import relax

    from tvm_layerfuse import runtime
    from tvm_layerfuse.compile.build import relax_module
    from tvm_layerfuse.compile.presets import resolve
    from tvm_layerfuse.compile.tactics import apply_tactics
    from tvm_layerfuse.planner import plan as make_plan

    model = _inception()
    onnx.save(model, tmp_path / "m.onnx")
    mod, params, _ = relax_module(tmp_path / "m.onnx", plan=make_plan(tmp_path / "m.onnx"), fuse=True)
    blocked, tactics = apply_tactics(mod, params, resolve("cpu"), tactics="tvm")
    assert tactics.blocked_convs == tactics.convs == 5, tactics  # (the three 1x1 are one conv)
    main = blocked["main"]
    static = set(relax.analysis.computable_at_compile_time(main))
    moves = []
    relax.analysis.post_order_visit(
        main.body,
        lambda e: moves.append(e)
        if isinstance(e, relax.Call) and getattr(e.op, "name", "") == "relax.layout_transform" and e.args[0] not in static
        else None,
    )
    assert len(moves) == 2, [str(m.args[0]) for m in moves]

    art = compile_model(tmp_path / "m.onnx", tmp_path / "art", target="cpu", tactics="tvm", progress=False)
    manifest = read_manifest(art)
    assert manifest["fusion"]["kernels"]["concat_kernels"] == 0, manifest["fusion"]["kernels"]
    assert manifest["fusion"]["kernels"]["split_kernels"] == 0, manifest["fusion"]["kernels"]
    feeds = _feeds(model)
    (ref,) = run_onnxruntime(model, feeds)
    got = next(iter(runtime.load(art, device="cpu").run(feeds).values()))
    assert _rel_err(ref, got) <= RTOL and float(np.abs(ref).max()) > 0


def _dense_block(seed: int = 5, *, growth: int = 8) -> onnx.ModelProto:
    """DenseNet's pattern at small size: a stem, two dense layers (BatchNorm + ReLU before a
    1x1 conv, whose own BatchNorm + ReLU fold into it, then a 3x3 conv) whose outputs grow one
    concat, a transition (BatchNorm + ReLU before a 1x1 conv, then an average pool) and a
    pre-activation 3x3 conv with padding (ResNet-v2's form). Every channel count a multiple
    of ``growth`` (a block width: each tensor whole blocks)."""
    b = NetBuilder("dense_blocked", seed=seed)
    x = b.input("x", (1, 8, 12, 12))
    stem = b.relu(b.conv(x, 2 * growth, 3, pad=1))
    features = [stem]
    for _ in range(2):
        cat = b.concat(features) if len(features) > 1 else features[0]
        mid = b.relu(b.batchnorm(b.conv(b.relu(b.batchnorm(cat)), 4 * growth, 1, bias=False)))
        features.append(b.conv(mid, growth, 3, pad=1, bias=False))
    cat = b.concat(features)  # 4 * growth channels
    trans = b.avgpool(b.conv(b.relu(b.batchnorm(cat)), 2 * growth, 1, bias=False), 2, 2)
    pre = b.conv(b.relu(b.batchnorm(trans)), 2 * growth, 3, pad=1)
    pooled = b.avgpool(b.maxpool(pre, 3, 1, 1), 3, 1, 1, count_include_pad=False)  # padded blocked pools
    return b.build([b.global_avgpool(b.add(pooled, pre))])


def test_prologue_groups_run_blocked(tmp_path):
    """On the TVM path a BatchNorm + ReLU prologue group keeps its prologue and runs blocked:
    every conv is NCHW[x]c (x: this CPU's lanes, the model's channels whole blocks of them),
    each prologue group's input is a blocked tensor, the normalisation
    goes into the padding stage of a padded conv and stays one pass before an unpadded one
    (never inside the multiply-adds), the concats stay in place, and the numbers (padded
    blocked pools included) match onnxruntime."""
    from tvm import relax

    from tvm_layerfuse import runtime
    from tvm_layerfuse.compile.build import relax_module
    from tvm_layerfuse.compile.presets import resolve
    from tvm_layerfuse.compile.schedules import CPUParams
    from tvm_layerfuse.compile.tactics import apply_tactics
    from tvm_layerfuse.lowering import layerfuse_pipeline
    from tvm_layerfuse.planner import plan as make_plan
    from tvm_layerfuse.relax._ir import tvm_compile
    from tvm_layerfuse.relax.fuse_prologue import PROLOGUE_PREFIX

    model = _dense_block(growth=CPUParams.of(resolve("cpu").tvm_target()).lanes)
    onnx.save(model, tmp_path / "m.onnx")
    mod, params, _ = relax_module(tmp_path / "m.onnx", plan=make_plan(tmp_path / "m.onnx"), fuse=True)

    def prologues(m) -> dict[str, int]:  # prologue group -> rank of its data input
        return {
            gv.name_hint: len(f.params[0].ty.shape)
            for gv, f in m.functions_items()
            if isinstance(f, relax.Function) and str((f.attrs or {}).get("Composite", "")).startswith(PROLOGUE_PREFIX)
        }

    plain = prologues(mod)
    assert len(plain) == 4 and set(plain.values()) == {4}, plain  # two dense layers, the transition, the pre-act conv
    blocked, tactics = apply_tactics(mod, params, resolve("cpu"), tactics="tvm")
    assert tactics.blocked_convs == tactics.convs == 7, tactics
    assert sorted(prologues(blocked).values()) == [5, 5, 5, 5], prologues(blocked)

    tgt = resolve("cpu").tvm_target()
    pipeline = layerfuse_pipeline(tgt)
    with tgt:
        tvm_compile(blocked, target=tgt, relax_pipeline=pipeline)
    inlined = pipeline.prologue_report.inlined
    assert not pipeline.prologue_report.kept, pipeline.prologue_report.kept
    # x * s, + t inlined into the ReLU (kept as a pass) of the three 1x1 convs; all three into the padding of the 3x3
    assert sorted(len(v) for v in inlined.values()) == [2, 2, 2, 3], inlined
    rules = {k: v.rule for k, v in pipeline.schedule_report.kernels.items() if k.startswith(PROLOGUE_PREFIX)}
    assert len(rules) == 4 and set(rules.values()) == {"conv2d NCHWc"}, rules

    art = compile_model(tmp_path / "m.onnx", tmp_path / "art", target="cpu", tactics="tvm", progress=False)
    assert read_manifest(art)["fusion"]["kernels"]["concat_kernels"] == 0
    feeds = _feeds(model)
    (ref,) = run_onnxruntime(model, feeds)
    got = next(iter(runtime.load(art, device="cpu").run(feeds).values()))
    assert _rel_err(ref, got) <= RTOL and float(np.abs(ref).std()) > 0


def test_kernels_narrow_to_int32_only_where_every_buffer_fits():
    """The blocked conv kernels' int32 step (``lowering/narrow_indices.py``) narrows a kernel
    whose buffers all have fewer than 2**31 elements and leaves one with a larger buffer as it is."""
    import tvm
    from tvm import te

    from tvm_layerfuse.lowering.narrow_indices import int32_indices

    def copy(shape):
        a = te.placeholder(shape, "float32", name="a")
        b = te.compute((tvm.tirx.IntImm("int64", 4),), lambda i: a[(i,) + (0,) * (len(shape) - 1)], name="b")
        return te.create_prim_func([a, b])

    def int64(func) -> bool:  # the printer writes int64 extents and indices as T.int64(...)
        return "T.int64(" in func.script()

    small = copy([tvm.tirx.IntImm("int64", 4), tvm.tirx.IntImm("int64", 8)])
    big = copy([tvm.tirx.IntImm("int64", 4), tvm.tirx.IntImm("int64", 1 << 30)])
    assert int64(small) and int64(big)
    assert not int64(int32_indices(small))
    assert int32_indices(big).same_as(big)


def _scheduled_kernel(build, shape):
    """The one TVM kernel of a Relax function ``build(x)`` over x of ``shape``, scheduled by
    the rules for a 2-core AVX2 target: (rule, [(loop kind, extent)] of its block, compiled)."""
    import tvm
    from tvm import relax, s_tir, tirx

    from tvm_layerfuse.compile.schedules import ApplySchedules

    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType(shape, "float32"))
    with bb.function("main", [x]):
        with bb.dataflow():
            o = bb.emit_output(build(bb, x))
        bb.emit_func_output(o)
    passes = [relax.transform.LegalizeOps(), relax.transform.AnnotateTIROpPattern(), relax.transform.FuseOps(), relax.transform.FuseTIR()]
    tgt = tvm.target.Target({"kind": "llvm", "mcpu": "core-avx2", "num-cores": 2})
    apply = ApplySchedules(tgt)
    with tgt:
        mod = apply(tvm.transform.Sequential(passes)(bb.get()))
    (gv,) = [g for g, f in mod.functions_items() if isinstance(f, tirx.PrimFunc)]
    sch = s_tir.Schedule(mod[gv])
    (block,) = sch.get_child_blocks(sch.get_sblock("root", func_name="main"))
    kinds = {tirx.ForKind.SERIAL: "serial", tirx.ForKind.PARALLEL: "parallel", tirx.ForKind.VECTORIZED: "vectorized"}
    loops = [(kinds.get(sch.get(lp).kind, "other"), int(sch.get(lp).extent)) for lp in sch.get_loops(block)]
    kernel = tvm.compile(tvm.IRModule({"main": mod[gv].with_attr("global_symbol", "main")}), target=tgt)
    return apply.report.kernels[gv.name_hint].rule, loops, kernel


def _run_kernel(kernel, data, out_shape):
    import tvm

    out = tvm.runtime.tensor(np.full(out_shape, np.nan, np.float32))
    kernel["main"](tvm.runtime.tensor(data), out)
    return out.numpy()


def test_a_channel_shuffle_runs_whole_planes_per_task():
    """ShuffleNetV2's channel shuffle (reshape, transpose, reshape) moves whole 28 x 28 planes:
    the rule fuses the plane's two axes (contiguous in input and output) into one axis of 98
    vectors, run as a serial loop under a parallel loop over the channels, not one parallel
    iteration per 7 floats of a row (5x the time on one thread)."""
    from tvm import relax

    c, h, w = 116, 28, 28

    def shuffle(bb, x):
        r = bb.emit(relax.op.reshape(x, (1, 2, c // 2, h, w)))
        t = bb.emit(relax.op.permute_dims(r, (0, 2, 1, 3, 4)))
        return relax.op.reshape(t, (1, c, h, w))

    rule, loops, kernel = _scheduled_kernel(shuffle, (1, c, h, w))
    assert rule == "injective"
    assert loops == [("parallel", c), ("serial", h * w // 8), ("vectorized", 8)], loops
    data = np.random.default_rng(3).standard_normal((1, c, h, w)).astype(np.float32)
    want = data.reshape(1, 2, c // 2, h, w).transpose(0, 2, 1, 3, 4).reshape(1, c, h, w)
    np.testing.assert_array_equal(_run_kernel(kernel, data, (1, c, h, w)), want)


def test_an_injective_kernel_without_outer_axes_splits_its_vectors_over_the_cores():
    """A relu over one long contiguous row: no outer axis to run in parallel, so the vector
    loop is split into 4 x cores parallel chunks of serial vectors. A transpose of the last two
    axes reads across rows: those are not fused, and the result is still the transpose."""
    from tvm import relax

    rule, loops, kernel = _scheduled_kernel(lambda bb, x: relax.op.nn.relu(x), (1, 1 << 16))
    assert rule == "injective"
    assert loops == [("parallel", 8), ("serial", (1 << 16) // 8 // 8), ("vectorized", 8)], loops
    data = np.random.default_rng(4).standard_normal((1, 1 << 16)).astype(np.float32)
    np.testing.assert_array_equal(_run_kernel(kernel, data, (1, 1 << 16)), np.maximum(data, 0))

    rule, loops, kernel = _scheduled_kernel(lambda bb, x: relax.op.permute_dims(x, (0, 1, 3, 2)), (1, 64, 24, 40))
    assert rule == "injective" and loops[-1] == ("vectorized", 8) and ("parallel", 64 * 40) in loops[:1], loops
    data = np.random.default_rng(5).standard_normal((1, 64, 24, 40)).astype(np.float32)
    np.testing.assert_array_equal(_run_kernel(kernel, data, (1, 64, 40, 24)), data.transpose(0, 1, 3, 2))
