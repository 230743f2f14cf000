"""Every kind of bad input a user can hand us, through the real command line.

Each case runs ``python -m tvm_layerfuse inspect|compile|run ...`` as a subprocess and
checks what the user sees: exit status 2, exactly one line ``error: ...`` on stderr that
names the input, no traceback, and nothing partially written (no artifact directory, no
hidden temporary directory beside it). Inputs that are legal but suspicious (NaN/Inf
weights, an op TVM cannot import) must not stop ``inspect``: it reports them and goes on.

Four families:

* model files: empty, random bytes, truncated, opset too new/old, cycle, duplicate tensor
  names, missing initializer, dynamic/zero/huge shapes, an op TVM's importer lacks,
  NaN/Inf weights, training-mode BatchNormalization;
* the output: a path under a regular file, a read-only file system, a full disk (a 16 KiB
  tmpfs), a file-size limit (RLIMIT_FSIZE), Ctrl-C in the middle of a compile;
* artifacts, which are untrusted input: checksum mismatch, a manifest naming
  ``../../etc/passwd``, an absolute path, a symlink out of the artifact, a weights file
  outside it, a pickled object in ``params.npz``, malformed manifest fields, weights that
  do not fit the library, a library that is not one; and a pickled ``--input``;
* the vta target: bad ``--vta-config`` files, calibration files, options that do not apply,
  a batch-2 model, a vta artifact run on the wrong device or with a changed program file (and
  the messages of the ``tvm_layerfuse.vta`` Python API, in the same table).

The mount cases need root (a private mount namespace with ``unshare -m``; nothing leaks
to the host) and are skipped otherwise. The subprocesses of a family run concurrently,
so the file takes well under a minute on two cores. ``LAYERFUSE_BAD_INPUTS_TABLE=FILE``
writes the table of inputs and messages (the README's) to FILE.
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import json
import os
import re
import resource
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

F = TensorProto.FLOAT
TABLE: list[tuple[str, str, str]] = []  # (input, command, what the user sees)


# ---------------------------------------------------------------------- running the CLI
def cli(*args: str, prefix: tuple[str, ...] = (), preexec_fn: Optional[Callable] = None, timeout: float = 300):
    return subprocess.run(
        [*prefix, sys.executable, "-m", "tvm_layerfuse", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        preexec_fn=preexec_fn,
    )


def run_all(jobs: dict[str, Callable[[], subprocess.CompletedProcess]]) -> dict[str, subprocess.CompletedProcess]:
    with concurrent.futures.ThreadPoolExecutor(max_workers=4) as pool:
        futures = {k: pool.submit(f) for k, f in jobs.items()}
        return {k: f.result() for k, f in futures.items()}


def one_error_line(proc: subprocess.CompletedProcess, *fragments: str) -> str:
    """Exit 2, exactly one line ``error: ...`` on stderr holding every fragment, no traceback."""
    assert "Traceback" not in proc.stderr, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2, (proc.returncode, proc.stderr)
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr
    for f in fragments:
        assert f in lines[0], (f, lines[0])
    return lines[0]


def nothing_written(out: Path) -> None:
    assert not out.exists(), f"{out} was written"
    leftovers = [p.name for p in out.parent.iterdir() if p.name.startswith(f".{out.name}.")]
    assert leftovers == [], f"temporary files left beside {out}: {leftovers}"


def record(what: str, command: str, proc_or_text, *, note: str = "") -> None:
    if isinstance(proc_or_text, str):
        text = proc_or_text
    else:
        lines = [l for l in proc_or_text.stdout.splitlines() if note and note in l] if note else []
        text = " / ".join(l for l in [*lines, *proc_or_text.stderr.strip().splitlines()] if not l.startswith("wrote "))
        text = f"(exit {proc_or_text.returncode}) {text}" if proc_or_text.returncode == 0 else text
    TABLE.append((what, command, text))


@pytest.fixture(scope="module", autouse=True)
def _write_table(tmp_path_factory):
    yield
    target = os.environ.get("LAYERFUSE_BAD_INPUTS_TABLE")
    if target:
        # a test's temporary directory is left out of the paths: 'TMP/test_x0/out' -> 'out'
        tmp = re.compile(re.escape(str(tmp_path_factory.getbasetemp())) + r"/[^/]+/")
        rows = ["| input | command | message |", "|---|---|---|"]
        rows += [f"| {w} | `{c}` | `{tmp.sub('', m).replace('|', '/')}` |" for w, c, m in TABLE]
        path = Path(target)
        # only the first table is rewritten: the text around it (docs/bad-inputs.md's
        # introduction, the sections other tests check) stays as it is
        head, _, rest = (path.read_text() if path.is_file() else "").partition(rows[0])
        tail = rest.partition("\n\n")[2]
        path.write_text(head + "\n".join(rows) + "\n" + ("\n" + tail if tail else ""))


# ---------------------------------------------------------------------- model files
def _model(nodes, inputs, outputs, inits=(), *, opset=13) -> onnx.ModelProto:
    g = helper.make_graph(nodes, "bad", inputs, outputs, list(inits))
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)])
    m.ir_version = 8
    return m


def _conv(*, w=None, act="Relu", opset=13, x=(1, 3, 8, 8), extra_inits=()) -> onnx.ModelProto:
    rng = np.random.default_rng(0)
    w = rng.standard_normal((4, 3, 3, 3)).astype(np.float32) * 0.3 if w is None else w
    nodes = [helper.make_node("Conv", ["x", "w"], ["y"], name="conv", pads=[1, 1, 1, 1])]
    if act:
        nodes.append(helper.make_node(act, ["y"], ["z"], name="act"))
    out_shape = [x[0], w.shape[0], *x[2:]]
    return _model(
        nodes,
        [helper.make_tensor_value_info("x", F, list(x))],
        [helper.make_tensor_value_info("z" if act else "y", F, out_shape)],
        [numpy_helper.from_array(w, "w"), *extra_inits],
        opset=opset,
    )


def _bytes(m: onnx.ModelProto) -> bytes:
    return m.SerializeToString()


def _nan_weights() -> bytes:
    w = np.random.default_rng(1).standard_normal((4, 3, 3, 3)).astype(np.float32)
    w[0, 0, 0, 0], w[1, 2, 1, 1] = np.nan, np.inf
    return _bytes(_conv(w=w))


def _huge_intermediate() -> bytes:
    shape = numpy_helper.from_array(np.array([100000, 3, 100000, 100000], np.int64), "s")
    return _bytes(
        _model(
            [helper.make_node("Expand", ["x", "s"], ["y"], name="expand"),
             helper.make_node("ReduceMax", ["y"], ["z"], name="max", keepdims=0)],
            [helper.make_tensor_value_info("x", F, [1, 3, 1, 1])],
            [helper.make_tensor_value_info("z", F, [])],
            [shape],
        )
    )  # fmt: skip


def _initializer_without_data() -> bytes:
    w = TensorProto(name="w", data_type=F, dims=[4, 3, 3, 3])  # dims, but no values
    m = _conv()
    del m.graph.initializer[:]
    m.graph.initializer.append(w)
    return _bytes(m)


def _training_batchnorm() -> bytes:
    c = [numpy_helper.from_array(np.ones(4, np.float32), n) for n in ("s", "b", "m", "v")]
    return _bytes(
        _model(
            [helper.make_node("Conv", ["x", "w"], ["y"], name="conv", pads=[1, 1, 1, 1]),
             helper.make_node("BatchNormalization", ["y", "s", "b", "m", "v"], ["z", "rm", "rv"], name="bn",
                              training_mode=1)],
            [helper.make_tensor_value_info("x", F, [2, 3, 8, 8])],
            [helper.make_tensor_value_info("z", F, [2, 4, 8, 8])],
            [numpy_helper.from_array(np.ones((4, 3, 3, 3), np.float32), "w"), *c],
            opset=15,
        )
    )  # fmt: skip


def _reshape_by_runtime_value() -> bytes:
    """A Reshape whose target is a graph input: onnxruntime accepts it, TVM needs a constant."""
    w = numpy_helper.from_array((np.random.default_rng(0).standard_normal((4, 3, 3, 3)) * 0.3).astype(np.float32), "w")
    return _bytes(
        _model(
            [helper.make_node("Conv", ["x", "w"], ["y"], name="conv", pads=[1, 1, 1, 1]),
             helper.make_node("Reshape", ["y", "shape"], ["z"], name="reshape")],
            [helper.make_tensor_value_info("x", F, [1, 3, 8, 8]),
             helper.make_tensor_value_info("shape", TensorProto.INT64, [2])],
            [helper.make_tensor_value_info("z", F, [4, 64])],
            [w],
        )
    )  # fmt: skip


def _resize_with_axes() -> bytes:
    """Resize-19 with ``axes`` and ``keep_aspect_ratio_policy``: TVM's converter fails on it."""
    sizes = numpy_helper.from_array(np.array([16, 16], np.int64), "sizes")
    return _bytes(
        _model(
            [helper.make_node("Relu", ["x"], ["y"], name="relu"),
             helper.make_node("Resize", ["y", "", "", "sizes"], ["z"], name="resize", mode="nearest", axes=[2, 3],
                              keep_aspect_ratio_policy="not_smaller")],
            [helper.make_tensor_value_info("x", F, [1, 4, 8, 8])],
            [helper.make_tensor_value_info("z", F, [1, 4, 16, 16])],
            [sizes],
            opset=19,
        )
    )  # fmt: skip


def _truncated() -> bytes:
    data = _bytes(_conv())
    return data[: len(data) * 2 // 3]


def _missing_initializer() -> bytes:
    m = _conv()
    del m.graph.initializer[:]
    return _bytes(m)


def _prefix_concat_output() -> bytes:
    """A torchvision-style dense block whose middle Concat is also a graph output: it is a
    prefix of the block's last Concat but needs storage of its own, so it stays a copy."""
    from graphs import Net

    n = Net(seed=8)
    x = n.input("x", (1, 4, 4, 4))
    x0 = n.relu(n.conv(x, 4, name="stem"))
    d1 = n.conv(n.relu(n.bn(n.concat([x0], name="cat1"))), 2, name="d1", bias=False)
    cat2 = n.concat([x0, d1], name="cat2")
    d2 = n.conv(n.relu(n.bn(cat2)), 2, name="d2", bias=False)
    return _bytes(n.build([n.concat([x0, d1, d2], name="cat3"), cat2]))


@dataclass(frozen=True)
class Case:
    what: str  # the bad input, as the README names it
    file: str
    content: Optional[Callable[[], bytes]]  # None: the file does not exist / is a directory
    inspect: tuple[str, ...]  # ("error", fragments...) or ("ok", stdout fragments...)
    compile: tuple[str, ...]  # ("error", fragments...) or ("ok", stderr fragments...)


CASES = [
    Case("missing file", "missing.onnx", None, ("error", "does not exist"), ("error", "does not exist")),
    Case("a directory", "adir.onnx", None, ("error", "is a directory"), ("error", "is a directory")),
    Case("empty file", "empty.onnx", lambda: b"", ("error", "is empty"), ("error", "is empty")),
    Case("random bytes", "random.onnx", lambda: np.random.default_rng(0).bytes(4096),
         ("error", "is not an ONNX model"), ("error", "is not an ONNX model")),
    Case("truncated protobuf", "truncated.onnx", _truncated, ("error", "is not an ONNX model"),
         ("error", "is not an ONNX model")),
    Case("opset too new", "opset_new.onnx", lambda: _bytes(_conv(opset=onnx.defs.onnx_opset_version() + 5)),
         ("error", "newer than"), ("error", "newer than")),
    Case("opset too old", "opset_old.onnx", lambda: _bytes(_conv(opset=5)), ("error", "expected opset >= 7"),
         ("error", "expected opset >= 7")),
    Case("cycle", "cycle.onnx", lambda: _bytes(_model(
        [helper.make_node("Add", ["x", "b"], ["a"], name="p"), helper.make_node("Relu", ["a"], ["b"], name="q")],
        [helper.make_tensor_value_info("x", F, [1, 2])], [helper.make_tensor_value_info("b", F, [1, 2])])),
        ("error", "has a cycle through nodes 0 (Add), 1 (Relu)"), ("error", "has a cycle")),
    Case("duplicate tensor names", "duplicate.onnx", lambda: _bytes(_model(
        [helper.make_node("Relu", ["x"], ["y"], name="r"), helper.make_node("Sigmoid", ["x"], ["y"], name="s")],
        [helper.make_tensor_value_info("x", F, [1, 2])], [helper.make_tensor_value_info("y", F, [1, 2])])),
        ("error", "tensor 'y'", "is defined twice"), ("error", "is defined twice")),
    Case("missing initializer", "no_weights.onnx", _missing_initializer,
         ("error", "reads tensor 'w', which no node, initializer or graph input defines"),
         ("error", "reads tensor 'w'")),
    Case("initializer without data", "no_data.onnx", _initializer_without_data, ("error", "is not valid ONNX"),
         ("error", "is not valid ONNX")),
    Case("dynamic input dims", "dynamic.onnx", lambda: _bytes(_conv(x=("N", 3, 8, 8))),
         ("error", "dynamic shape [?,3,8,8]", "--input-shape x=1,3,8,8"), ("error", "--input-shape x=1,3,8,8")),
    Case("zero input dim", "zero.onnx", lambda: _bytes(_conv(x=(1, 3, 0, 8))), ("error", "has a zero dimension"),
         ("error", "has a zero dimension")),
    Case("huge declared input", "huge_input.onnx", lambda: _bytes(_conv(x=(100000, 3, 100000, 100000))),
         ("error", "tensor 'x'", "3e+15 elements); expected at most"), ("error", "3e+15 elements")),
    Case("huge intermediate tensor", "huge_mid.onnx", _huge_intermediate,
         ("error", "tensor 'y'", "3e+15 elements"), ("error", "tensor 'y'", "3e+15 elements")),
    Case("op TVM's importer lacks (Celu)", "celu.onnx", lambda: _bytes(_conv(act="Celu", opset=13)),
         ("ok", "note: TVM 0.27's ONNX importer has no converter for Celu (layers 'act')"),
         ("error", "uses ops TVM's ONNX importer does not support (Celu): node 'act' (Celu, opset 13) has no "
                   "converter", "onnxruntime accepts the model - replace Celu", "report the op to TVM")),
    Case("shape read from a run-time value", "reshape_runtime.onnx", _reshape_by_runtime_value,
         ("ok", "0 groups"),
         ("error", "cannot convert node 'reshape' (Reshape, opset 13)", "its input 'shape' is a run-time value",
                   "onnxruntime accepts the model - make 'shape' a constant")),
    Case("converter TVM lacks for an attribute (Resize axes)", "resize_axes.onnx", _resize_with_axes,
         ("ok", "0 groups"),
         ("error", "cannot convert node 'resize' (Resize, opset 19)", "Resize2D expects",
                   "limit of TVM's importer - convert the model to another opset")),
    Case("training-mode BatchNormalization", "train_bn.onnx", _training_batchnorm,
         ("ok", "BatchNormalization 'bn' is in training mode"), ("error", "is in training mode")),
    Case("NaN/Inf weights", "nan.onnx", _nan_weights,
         ("ok", "note: weights hold NaN/Inf values: 'w' (2 of 108 values)"),
         ("ok", "WARNING: model nan.onnx has weights with NaN/Inf values ('w': 2 of 108); the outputs they "
                "reach are NaN/Inf or clamped")),
    Case("prefix Concat that is also a graph output", "prefix_out.onnx", _prefix_concat_output,
         ("ok", "'cat2' is a prefix of concat 'cat3', whose block its inputs already write into, but its output "
                "'cat2_out' is a graph output"),
         ("ok", "wrote artifact")),
]  # fmt: skip


@pytest.fixture(scope="module")
def model_runs(tmp_path_factory):
    """Every model case through ``inspect --plan-only`` and ``compile``, concurrently."""
    root = tmp_path_factory.mktemp("models")
    paths = {}
    for case in CASES:
        path = root / case.file
        if case.what == "a directory":
            path.mkdir()
        elif case.content is not None:
            path.write_bytes(case.content())
        paths[case.what] = path
    jobs = {}
    for case in CASES:
        p = paths[case.what]
        jobs[(case.what, "inspect")] = lambda p=p: cli("inspect", str(p), "--plan-only")
        jobs[(case.what, "compile")] = lambda p=p: cli("compile", str(p), "-o", str(p.parent / f"out_{p.stem}"))
    return paths, run_all(jobs)


@pytest.mark.parametrize("case", CASES, ids=[c.file for c in CASES])
def test_bad_model(case: Case, model_runs):
    paths, runs = model_runs
    path = paths[case.what]
    for command, expect in (("inspect", case.inspect), ("compile", case.compile)):
        proc = runs[(case.what, command)]
        record(case.what, f"{command} {case.file}", proc, note=expect[1] if expect[0] == "ok" else "")
        if expect[0] == "error":
            line = one_error_line(proc, *expect[1:])
            assert case.file in line  # the message names the input
        else:
            assert proc.returncode == 0, proc.stderr
            assert "Traceback" not in proc.stderr
            stream = proc.stdout if command == "inspect" else proc.stderr
            for fragment in expect[1:]:
                assert fragment in stream, stream
        if command == "compile":
            out = path.parent / f"out_{path.stem}"
            if expect[0] == "error":
                nothing_written(out)
            else:
                manifest = json.loads((out / "manifest.json").read_text())
                carried = {lib["file"] for lib in manifest["tactics"]["libraries"]}  # the oneDNN tactic library, where used
                assert set(manifest["files"]) == {"model.so", "params.npz"} | carried


def test_inspect_reports_and_continues_and_input_shape_fixes_dynamic_dims(model_runs):
    paths, _ = model_runs
    ok = cli("inspect", str(paths["dynamic input dims"]), "--plan-only", "--input-shape", "x=2,3,8,8")
    assert ok.returncode == 0 and "1 vertical" in ok.stdout, ok.stderr
    js = cli("inspect", str(paths["NaN/Inf weights"]), "--json", "--plan-only")
    notes = json.loads(js.stdout)["notes"]
    assert any("NaN/Inf" in n for n in notes) and js.returncode == 0


def test_huge_shapes_are_refused_before_anything_is_allocated(tmp_path):
    """Under a 1 GiB address-space limit (the 3e15-element tensor would need 12 PB)."""
    path = tmp_path / "huge.onnx"
    path.write_bytes(_conv(x=(100000, 3, 100000, 100000)).SerializeToString())
    limit = lambda: resource.setrlimit(resource.RLIMIT_AS, (1 << 30, 1 << 30))
    t = time.perf_counter()
    proc = cli("inspect", str(path), preexec_fn=limit)
    one_error_line(proc, "huge.onnx", "3e+15 elements")
    assert time.perf_counter() - t < 30


# ---------------------------------------------------------------------- the output
def _big_weights() -> onnx.ModelProto:
    """A conv with 576 KiB of weights: the library (~25 KiB) fits a 256 KiB file-size
    limit, params.npz does not."""
    w = (np.random.default_rng(2).standard_normal((128, 128, 3, 3)) * 0.03).astype(np.float32)
    return _conv(w=w, act=None, x=(1, 128, 4, 4))


def _can_mount() -> bool:
    if shutil.which("unshare") is None or os.geteuid() != 0:
        return False
    probe = subprocess.run(["unshare", "-m", "sh", "-c", "mount -t tmpfs -o size=16k tmpfs /mnt"], capture_output=True)
    return probe.returncode == 0


MOUNT = pytest.mark.skipif(not _can_mount(), reason="needs root and `unshare -m` to mount a private tmpfs")


def _in_tmpfs(mount: Path, options: str, *args: str) -> tuple[subprocess.CompletedProcess, list[str]]:
    """Run the CLI with a tmpfs mounted at ``mount`` in a private mount namespace; returns
    the process and what the tmpfs holds afterwards."""
    script = (
        f'mount -t tmpfs -o {options} tmpfs "{mount}" || exit 99; "$@"; rc=$?; '
        f'echo "--listing--"; ls -A "{mount}"; exit $rc'
    )
    proc = cli(*args, prefix=("unshare", "-m", "sh", "-c", script, "sh"))
    assert proc.returncode != 99, proc.stderr
    listing = proc.stdout.split("--listing--", 1)[1].split()
    return proc, listing


@pytest.fixture(scope="module")
def good_model(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("good") / "good.onnx"
    path.write_bytes(_conv().SerializeToString())
    return path


def test_output_under_a_regular_file(good_model, tmp_path):
    afile = tmp_path / "afile"
    afile.write_text("x")
    proc = cli("compile", str(good_model), "-o", str(afile / "out"))
    record("output path under a regular file", "compile good.onnx -o afile/out", proc)
    one_error_line(proc, f"cannot write into {str(afile)!r} (Not a directory)")
    assert afile.read_text() == "x"


@MOUNT
def test_read_only_and_full_file_systems(good_model, tmp_path):
    ro, full = tmp_path / "ro", tmp_path / "full"
    ro.mkdir()
    full.mkdir()
    (ro_proc, ro_listing), (full_proc, full_listing) = run_all(
        {
            "ro": lambda: _in_tmpfs(ro, "ro,size=1m", "compile", str(good_model), "-o", str(ro / "out")),
            "full": lambda: _in_tmpfs(full, "size=16k", "compile", str(good_model), "-o", str(full / "out")),
        }
    ).values()
    record("read-only output file system", "compile good.onnx -o RO/out", ro_proc)
    one_error_line(ro_proc, f"cannot write into {str(ro)!r} (Read-only file system)")
    assert ro_listing == []
    record("disk full while writing the artifact (16 KiB tmpfs)", "compile good.onnx -o FULL/out", full_proc)
    one_error_line(full_proc, f"cannot write artifact {str(full / 'out')!r} (No space left on device); nothing was written")
    assert full_listing == []  # no artifact, no temporary directory left in the full file system


def test_file_size_limit_while_writing_the_artifact(tmp_path):
    """RLIMIT_FSIZE (``ulimit -f``): a real EFBIG from the kernel, no root needed."""
    path = tmp_path / "big.onnx"
    path.write_bytes(_big_weights().SerializeToString())
    out = tmp_path / "out"
    limit = lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (256 << 10, 256 << 10))
    proc = cli("compile", str(path), "-o", str(out), preexec_fn=limit)
    record("file-size limit hit while writing (ulimit -f 256)", "compile big.onnx -o out", proc)
    one_error_line(proc, f"cannot write artifact {str(out)!r} (File too large); nothing was written", "ulimit -f")
    nothing_written(out)


def _wait_until_mapped(proc: subprocess.Popen, library: str) -> None:
    """Wait (on the child's own progress, not a clock) until ``library`` is loaded in it."""
    maps = Path(f"/proc/{proc.pid}/maps")
    while proc.poll() is None:
        try:
            if library in maps.read_text():
                return
        except OSError:  # it exited between the poll and the read
            return
        time.sleep(0.01)


def test_interrupted_compile_leaves_nothing_at_any_point(good_model, tmp_path):
    """Ctrl-C (SIGINT) at several points of a compile: either the artifact is complete and
    verified and the exit status is 0 (the interrupt came once it was in place), or nothing is
    there, the one error line and status 130 - nothing else (test_build_runtime interrupts a
    long GoogLeNet compile once). Each interrupt is sent once the command runs our code (onnx's
    library is mapped: the plan step); before that, Python's own start-up handles it."""

    def compile_and_interrupt(delay: float):
        out = tmp_path / f"out_{int(delay * 10)}"
        proc = subprocess.Popen(
            [sys.executable, "-m", "tvm_layerfuse", "compile", str(good_model), "-o", str(out)],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
        _wait_until_mapped(proc, "onnx_cpp2py_export")
        time.sleep(delay)  # a point later in the compile; every point must give one of the two outcomes
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=300)
        return out, proc.returncode, err

    from tvm_layerfuse.runtime.artifact import verify

    results = list(run_all({d: (lambda d=d: compile_and_interrupt(d)) for d in (0.0, 1.0, 2.0, 3.0)}).values())
    interrupted = 0
    for out, rc, err in results:
        assert "Traceback" not in err, err
        # TVM's C++ side may log its own line while unwinding ("[hh:mm:ss] ... BlockBuilder
        # destroyed with remaining blocks!"); ours must be the one error line.
        ours = [line for line in err.strip().splitlines() if not re.match(r"\[\d\d:\d\d:\d\d\] ", line)]
        if rc == 130:
            interrupted += 1
            assert ours == ["error: interrupted; nothing was written"], err
            nothing_written(out)
        else:
            assert rc == 0, (rc, err)
            assert ours[-1:] == [f"wrote artifact {out}"], err
            manifest = verify(out)
            carried = {lib["file"] for lib in manifest["tactics"]["libraries"]}
            assert set(manifest["files"]) == {"model.so", "params.npz"} | carried
    assert interrupted >= 1  # the first comes right after the plan starts, long before the build ends
    record("Ctrl-C during compile", "compile good.onnx (SIGINT)", "error: interrupted; nothing was written")


def test_interrupt_during_the_artifact_rename_is_held(tmp_path):
    """SIGINT before the artifact's rename: nothing is written; during it: the artifact is
    complete and the interrupt is delivered after ``on_commit``, to the handler then in place."""
    from tvm_layerfuse.runtime.artifact import write_artifact

    def fill(tmp: Path, *, interrupt: bool) -> dict:
        (tmp / "model.so").write_bytes(b"x")
        if interrupt:
            signal.raise_signal(signal.SIGINT)
        return {"format": "tvm_layerfuse.artifact"}

    before = tmp_path / "before"
    with pytest.raises(KeyboardInterrupt):
        write_artifact(before, lambda t: fill(t, interrupt=True))
    nothing_written(before)

    seen = []
    during = tmp_path / "during"

    def on_commit():
        signal.raise_signal(signal.SIGINT)  # held: the artifact is already in place
        seen.append(during.exists())
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # the command is done: ignore it from now on

    previous = signal.getsignal(signal.SIGINT)
    try:
        write_artifact(during, lambda t: fill(t, interrupt=False), on_commit=on_commit)
    finally:
        signal.signal(signal.SIGINT, previous)
    assert seen == [True]
    assert set(json.loads((during / "manifest.json").read_text())["files"]) == {"model.so"}


def test_interrupt_right_after_the_temporary_directory_is_made(tmp_path, monkeypatch):
    """SIGINT the instant mkdtemp returns (before any clean-up can be in place): the interrupt
    is held until the directory is registered, so the command line's clean-up removes it."""
    from tvm_layerfuse.runtime import artifact

    real = artifact.tempfile.mkdtemp

    def mkdtemp_then_interrupt(*a, **kw):
        path = real(*a, **kw)
        signal.raise_signal(signal.SIGINT)  # Ctrl-C lands here
        return path

    monkeypatch.setattr(artifact.tempfile, "mkdtemp", mkdtemp_then_interrupt)
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with pytest.raises(KeyboardInterrupt):
            artifact.write_artifact(tmp_path / "out", lambda t: {"format": "tvm_layerfuse.artifact"})
    finally:
        signal.signal(signal.SIGINT, previous)
    artifact.remove_unfinished()  # what the command line does before "nothing was written"
    nothing_written(tmp_path / "out")


# ---------------------------------------------------------------------- artifacts
def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture(scope="module")
def artifact_dir(good_model, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("art") / "good"
    proc = cli("compile", str(good_model), "-o", str(out), "-q")
    assert proc.returncode == 0, proc.stderr
    return out


def _edit_manifest(d: Path, change: Callable[[dict], None]) -> None:
    m = json.loads((d / "manifest.json").read_text())
    change(m)
    (d / "manifest.json").write_text(json.dumps(m))


def _rehash(d: Path, name: str) -> None:
    """Update the manifest's checksum after a change: the tampering is consistent."""
    _edit_manifest(d, lambda m: m["files"].__setitem__(name, _sha(d / name)))


def _flip_byte(d: Path) -> None:
    data = bytearray((d / "params.npz").read_bytes())
    data[len(data) // 2] ^= 0xFF
    (d / "params.npz").write_bytes(bytes(data))


def _escape(d: Path) -> None:
    _edit_manifest(d, lambda m: m["files"].__setitem__("../../etc/passwd", _sha(Path("/etc/passwd"))))


def _absolute(d: Path) -> None:
    _edit_manifest(d, lambda m: m["files"].__setitem__("/etc/passwd", _sha(Path("/etc/passwd"))))


def _library_outside(d: Path) -> None:
    shutil.copy(d / "model.so", d.parent / f"{d.name}_evil.so")

    def change(m):
        m["library"] = f"../{d.name}_evil.so"
        m["files"][m["library"]] = _sha(d.parent / f"{d.name}_evil.so")

    _edit_manifest(d, change)


def _params_outside(d: Path) -> None:
    np.savez(d.parent / f"{d.name}_evil.npz", w=np.zeros((4, 3, 3, 3), np.float32))
    _edit_manifest(d, lambda m: m["params"].__setitem__("file", f"../{d.name}_evil.npz"))


def _symlink_out(d: Path) -> None:
    evil = d.parent / f"{d.name}_evil.npz"
    np.savez(evil, w=np.zeros((4, 3, 3, 3), np.float32))
    (d / "params.npz").unlink()
    (d / "params.npz").symlink_to(evil)
    _rehash(d, "params.npz")


def _pickle(d: Path) -> None:
    np.savez(d / "params.npz", w=np.array([{"__reduce__": "os.system"}], dtype=object))
    _rehash(d, "params.npz")


def _wrong_weights(d: Path) -> None:
    np.savez(d / "params.npz", w=np.zeros((2, 2), np.float32))
    _rehash(d, "params.npz")


def _not_a_library(d: Path) -> None:
    (d / "model.so").write_bytes(b"\x7fELF but not really" * 10)
    _rehash(d, "model.so")


def _bad_json(d: Path) -> None:
    (d / "manifest.json").write_text("{not json")


def _bad_inputs_field(d: Path) -> None:
    _edit_manifest(d, lambda m: m.__setitem__("inputs", [{"name": "x"}]))


def _bad_params_field(d: Path) -> None:
    _edit_manifest(d, lambda m: m.__setitem__("params", "params.npz"))


def _huge_input(d: Path) -> None:
    _edit_manifest(d, lambda m: m["inputs"][0].__setitem__("shape", [100000, 3, 100000, 100000]))


def _other_version(d: Path) -> None:
    _edit_manifest(d, lambda m: m.__setitem__("format_version", 99))


def _no_manifest(d: Path) -> None:
    (d / "manifest.json").unlink()


def _missing_vendor_library(d: Path) -> None:
    """A board without the vendor library a tactic library needs (oneDNN's, say)."""
    lib = {"file": "model.so", "needs": ["libdnnl_absent.so.2"], "install": "apt-get install -y libdnnl2"}
    _edit_manifest(d, lambda m: m.__setitem__("tactics", {**(m.get("tactics") or {}), "libraries": [lib]}))


def _foreign_cpu(d: Path) -> None:
    """An artifact compiled for a CPU with an extension this one lacks."""
    flags, target = ["avx2", "avx512_nonexistent"], {"kind": "llvm", "mcpu": "futurecpu"}
    _edit_manifest(d, lambda m: m["target"].update(cpu_flags=flags, tvm_target=target))


ARTIFACT_CASES = [
    ("checksum mismatch (a flipped byte in params.npz)", _flip_byte, ("'params.npz' in artifact", "has sha256")),
    ("manifest names ../../etc/passwd", _escape, ("names '../../etc/passwd', outside the artifact; refusing",)),
    ("manifest names /etc/passwd", _absolute, ("names '/etc/passwd', outside the artifact",)),
    ("library outside the artifact (checksummed)", _library_outside, ("_evil.so', outside the artifact",)),
    ("weights file outside the artifact", _params_outside, ("names params file", "without a checksum; refusing")),
    ("symlink out of the artifact", _symlink_out, ("names 'params.npz' (it resolves to", "outside the artifact")),
    ("pickled object in params.npz (checksum updated)", _pickle, ("holds pickled Python objects", "never loaded")),
    ("weights that do not fit the library", _wrong_weights, ("rejects its arguments", "does not match the library")),
    ("library that is not a shared object", _not_a_library, ("library 'model.so' of artifact", "cannot be loaded")),
    ("manifest not JSON", _bad_json, ("manifest.json' is not readable JSON",)),
    ("manifest with malformed inputs", _bad_inputs_field, ("is malformed: inputs[0] must be",)),
    ("manifest with malformed params", _bad_params_field, ("is malformed: 'params' must be an object",)),
    ("manifest declaring a huge input", _huge_input, ("declares shape [100000, 3, 100000, 100000] (3e+15 elements",)),
    ("artifact of another format version", _other_version, ("has format version 99",)),
    ("no manifest", _no_manifest, ("has no manifest.json",)),
    (
        "vendor library missing on this machine",
        _missing_vendor_library,
        ("needs libdnnl_absent.so.2 (for model.so), which is not installed", "apt-get install -y libdnnl2"),
    ),
    ("compiled for a CPU with more extensions", _foreign_cpu, ("compiled for CPU futurecpu and needs avx512_nonexistent", "cpu-portable")),
]


@pytest.fixture(scope="module")
def artifact_runs(artifact_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("tampered")
    dirs = {}
    for k, (what, tamper, _) in enumerate(ARTIFACT_CASES):
        d = root / f"case{k}"
        shutil.copytree(artifact_dir, d)
        tamper(d)
        dirs[what] = d
    runs = run_all({what: (lambda d=d: cli("run", str(d))) for what, d in dirs.items()})
    return dirs, runs


@pytest.mark.parametrize("what,fragments", [(w, f) for w, _, f in ARTIFACT_CASES], ids=[w for w, _, _ in ARTIFACT_CASES])
def test_untrusted_artifact(what, fragments, artifact_runs):
    dirs, runs = artifact_runs
    proc = runs[what]
    record(what, "run ARTIFACT", proc)
    one_error_line(proc, str(dirs[what]), *fragments)


def test_the_untampered_artifact_runs(artifact_dir):
    proc = cli("run", str(artifact_dir))
    assert proc.returncode == 0 and "z: shape [1, 4, 8, 8] float32" in proc.stdout, proc.stderr


def test_bad_run_inputs(artifact_dir, tmp_path):
    pickled, shape, dtype, text = (tmp_path / n for n in ("pickled.npy", "shape.npy", "dtype.npy", "x.txt"))
    np.save(pickled, np.array([{"a": 1}], dtype=object), allow_pickle=True)
    np.save(shape, np.zeros((1, 3, 4, 4), np.float32))
    np.save(dtype, np.zeros((1, 3, 8, 8), np.float64))
    text.write_text("1 2 3")
    runs = run_all({p.name: (lambda p=p: cli("run", str(artifact_dir), "--input", str(p))) for p in (pickled, shape, dtype, text)})
    cases = [
        ("pickled --input .npy", pickled, (f"input file {str(pickled)!r} is not a readable .npy array",)),
        ("--input of the wrong shape", shape, ("input 'x' has shape [1, 3, 4, 4]; expected [1, 3, 8, 8]",)),
        ("--input of the wrong dtype", dtype, ("input 'x' has dtype float64; expected float32", ".astype('float32')")),
        ("--input of an unknown kind", text, (f"input file {str(text)!r} has suffix .txt; expected .npy, .npz or an image",)),
    ]
    for what, path, fragments in cases:
        proc = runs[path.name]
        record(what, f"run ARTIFACT --input {path.name}", proc)
        one_error_line(proc, *fragments)


INTERRUPT_IN_PASS = """
import os, signal, sys
from tvm_layerfuse.relax import fuse_epilogue
from tvm_layerfuse.cli import main

order = fuse_epilogue._order_residual_operands

def interrupted(*args, **kwargs):  # Ctrl-C arrives while TVM runs our pass (C++ -> Python)
    os.kill(os.getpid(), signal.SIGINT)
    return order(*args, **kwargs)

fuse_epilogue._order_residual_operands = interrupted
sys.exit(main(sys.argv[1:]))
"""


def test_ctrl_c_inside_a_relax_pass_is_an_interrupt_not_an_internal_error(good_model, tmp_path):
    """Bug: a KeyboardInterrupt raised in a Python pass that TVM calls from C++ leaves TVM's
    FFI as a bare ``RuntimeError``; the CLI printed ``internal error: RuntimeError:`` (exit 3)
    - the GoogLeNet interrupt in test_build_runtime failed this way on a loaded machine.
    Fix: the CLI records SIGINT and reports any failure after one as the interrupt."""
    out = tmp_path / "out"
    proc = subprocess.run(
        [sys.executable, "-c", INTERRUPT_IN_PASS, "compile", str(good_model), "-o", str(out)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 130, proc.stderr
    assert proc.stderr.strip().splitlines() == ["error: interrupted; nothing was written"]
    nothing_written(out)


def test_nonfinite_note_counts_weights_not_infinite_bounds():
    """NaN/Inf in a weight tensor is reported; an infinite scalar (a Clip bound) is not."""
    from tvm_layerfuse.planner import plan

    w = np.ones((4, 3, 3, 3), np.float32)
    w[0, 0, 0, 0] = np.nan
    w[3, 2, 2, 2] = -np.inf
    inf = numpy_helper.from_array(np.array(np.inf, np.float32), "hi")
    zero = numpy_helper.from_array(np.array(0.0, np.float32), "lo")
    m = _conv(w=w, act=None)
    m.graph.node.append(helper.make_node("Clip", ["y", "lo", "hi"], ["c"], name="clip"))
    m.graph.initializer.extend([inf, zero])
    m.graph.output[0].name = "c"
    p = plan(m)
    assert p.first.meta["nonfinite_constants"] == [{"name": "w", "count": 2, "size": 108}]
    assert [n for n in p.graph_notes() if "NaN/Inf" in n] == [
        "weights hold NaN/Inf values: 'w' (2 of 108 values); outputs they reach become NaN/Inf, or are silently "
        "clamped where a Relu/Clip follows (TVM's max/min drop NaN, onnxruntime keeps it) - check the training "
        "run or the export"
    ]
    m.graph.initializer[0].CopyFrom(numpy_helper.from_array(np.ones((4, 3, 3, 3), np.float32), "w"))
    assert "nonfinite_constants" not in plan(m).first.meta


def test_tvm_log_lines_reach_the_terminal_only_with_verbose(model_runs):
    """TVM's importer prints "Error converting operator ..." and, from C++, "BlockBuilder
    destroyed with remaining blocks!": with -v they are in the debug log, otherwise the user
    sees our one line (test_bad_model checks that)."""
    paths, runs = model_runs
    quiet = runs[("shape read from a run-time value", "compile")]
    assert "BlockBuilder" not in quiet.stderr and "Error converting" not in quiet.stderr + quiet.stdout
    model = paths["shape read from a run-time value"]
    loud = cli("-v", "compile", str(model), "-o", str(model.parent / "out_v"))
    assert loud.returncode == 2
    assert "BlockBuilder destroyed with remaining blocks!" in loud.stderr, loud.stderr
    assert "Error converting operator Reshape" in loud.stderr, loud.stderr
    assert loud.stderr.strip().splitlines()[-1].startswith("error: TVM's ONNX importer cannot convert node 'reshape'")


# ---------------------------------------------------------------------- the vta target
VTA_CONFIGS = {
    "VTA config value not an integer": json.dumps({"LOG_BLOCK": "4"}),
    "VTA config value out of range": json.dumps({"LOG_ACC_WIDTH": 4}),
    "VTA config unknown key": json.dumps({"LOG_BLOK": 4}),
    "VTA config non-square block": json.dumps({"LOG_BLOCK_IN": 4, "LOG_BLOCK_OUT": 3}),
    "VTA config buffers too large for the encoding": json.dumps({"LOG_ACC_BUFF_SIZE": 24, "LOG_INP_BUFF_SIZE": 24}),
    "VTA config not JSON": "{LOG_BLOCK: 4",
}


def _short(text: str, root: Path) -> str:
    return text.replace(f"{root}/", "")


@pytest.fixture(scope="module")
def vta_model(tmp_path_factory) -> Path:
    from tvm_layerfuse.testing import zoo

    root = tmp_path_factory.mktemp("vta")
    onnx.save(zoo.googlenet(blocks=1, width=0.25, image=16, seed=1), root / "g.onnx")
    onnx.save(zoo.googlenet(blocks=1, width=0.25, image=16, seed=1, batch=2), root / "g_batch2.onnx")
    return root / "g.onnx"


def test_bad_vta_compile_inputs(vta_model):
    root = vta_model.parent
    for k, text in enumerate(VTA_CONFIGS.values()):
        (root / f"cfg{k}.json").write_text(text)
    x = np.zeros((1, 3, 16, 16), np.float32)
    np.savez(root / "cal_shape.npz", input=np.zeros((2, 1, 3, 8, 8), np.float32))
    np.savez(root / "cal_names.npz", a=x, b=x)
    np.save(root / "cal.npy", x)
    np.savez(root / "cal.npz", input=x)
    model, out = str(vta_model), str(root / "out")
    jobs = {what: ("compile g.onnx --target vta --vta-config cfg.json", ("--vta-config", str(root / f"cfg{k}.json")))
            for k, what in enumerate(VTA_CONFIGS)}  # fmt: skip
    jobs.update({
        "VTA config file missing": ("compile g.onnx --target vta --vta-config missing.json", ("--vta-config", str(root / "missing.json"))),
        "calibration file missing": ("compile g.onnx --target vta --calibration missing.npz", ("--calibration", str(root / "missing.npz"))),
        "calibration samples of another shape": ("compile g.onnx --target vta --calibration cal_shape.npz",
                                                 ("--calibration", str(root / "cal_shape.npz"))),
        "calibration arrays not named after the inputs": ("compile g.onnx --target vta --calibration cal_names.npz",
                                                          ("--calibration", str(root / "cal_names.npz"))),
        "calibration file a single .npy array": ("compile g.onnx --target vta --calibration cal.npy",
                                                 ("--calibration", str(root / "cal.npy"))),
        "--calibration-count 0": ("compile g.onnx --target vta --calibration-count 0", ("--calibration-count", "0")),
        "--no-fuse with the vta target": ("compile g.onnx --target vta --no-fuse", ("--no-fuse",)),
        "model of batch 2 for VTA": ("compile g_batch2.onnx --target vta", ()),
    })  # fmt: skip
    runs = run_all({
        what: (lambda what=what, extra=extra: cli(
            "compile", str(root / "g_batch2.onnx") if "batch 2" in what else model, "--target", "vta", "-o", out, *extra))
        for what, (_, extra) in jobs.items()
    })  # fmt: skip
    runs["--vta-config with --target cpu"] = cli("compile", model, "--target", "cpu", "--vta-config", str(root / "cfg0.json"), "-o", out)
    jobs["--vta-config with --target cpu"] = ("compile g.onnx --target cpu --vta-config cfg.json", ())
    runs["inspect --compile for another target"] = cli("inspect", model, "--compile", "--target", "cuda")
    jobs["inspect --compile for another target"] = ("inspect g.onnx --compile --target cuda", ())
    for what, proc in runs.items():
        record(what, jobs[what][0], _short(proc.stderr.strip(), root))
        line = one_error_line(proc)
        assert "expected" in line and " - " in line or "drop" in line, line
        nothing_written(root / "out")


@pytest.fixture(scope="module")
def vta_artifact(vta_model) -> Path:
    out = vta_model.parent / "g.vta"
    proc = cli("compile", str(vta_model), "--target", "vta", "-o", str(out), "--calibration-count", "1", "-q")
    assert proc.returncode == 0, proc.stderr
    return out


def test_bad_vta_run_inputs(vta_artifact):
    root = vta_artifact.parent
    changed = root / "changed.vta"
    shutil.copytree(vta_artifact, changed)
    (changed / "programs.npz").write_bytes(b"x")
    nolib = root / "nolib.vta"
    shutil.copytree(vta_artifact, nolib)
    (nolib / "host.so").unlink()
    board_art = root / "board.vta"  # host steps compiled for an aarch64 board
    shutil.copytree(vta_artifact, board_art)
    manifest = json.loads((board_art / "manifest.json").read_text())
    manifest["target"]["machine"] = "aarch64"
    (board_art / "manifest.json").write_text(json.dumps(manifest))
    np.save(root / "small.npy", np.zeros((1, 3, 8, 8), np.float32))
    cases = {
        "vta artifact without its host library": ("run nolib.vta", (str(nolib),), "lacks 'host.so'"),
        "vta artifact with host steps for an aarch64 board": ("run board.vta", (str(board_art),), "compiled for aarch64"),
        "vta artifact run with --device cpu": ("run g.vta --device cpu", (str(vta_artifact), "--device", "cpu"), "compiled for vta"),
        "vta artifact run on a board (no VTA here)": ("run g.vta --device board", (str(vta_artifact), "--device", "board"),
                                                      "no VTA device found"),
        "vta artifact with a changed program file": ("run changed.vta", (str(changed),), "'programs.npz'"),
        "--input of another shape (vta artifact)": ("run g.vta --input small.npy", (str(vta_artifact), "--input", str(root / "small.npy")),
                                                    "has shape [1, 3, 8, 8]"),
    }  # fmt: skip
    runs = run_all({what: (lambda args=args: cli("run", *args)) for what, (_, args, _) in cases.items()})
    for what, (command, _, fragment) in cases.items():
        record(what, command, _short(runs[what].stderr.strip(), root))
        one_error_line(runs[what], fragment)


def test_bad_vta_library_inputs(vta_model, vta_artifact, tmp_path):
    """What the Python API of the vta package refuses (each one line, in the same table)."""
    from tvm_layerfuse.compile.vta import pipeline
    from tvm_layerfuse.errors import LayerfuseError
    from tvm_layerfuse.runtime.vta.config import DEFAULT
    from tvm_layerfuse.runtime.vta.runtime import HostSteps, load_vta, open_device

    (tmp_path / "host.so").write_bytes(b"\x7fELF damaged")
    unlisted = tmp_path / "unlisted.vta"
    shutil.copytree(vta_artifact, unlisted)
    vta = json.loads((unlisted / "vta.json").read_text())
    del vta["host_library"]
    (unlisted / "vta.json").write_text(json.dumps(vta))
    cases = {
        "host library that does not load": ("HostSteps(DIR/host.so, ...)",
                                            lambda: HostSteps(tmp_path / "host.so", {}, [], machine="x86_64")),
        "vta.json without its host library": ("load_vta(unlisted.vta)", lambda: load_vta(unlisted)),
        "compile_vta for a non-VTA preset": ("compile_vta(model, DIR, target='cpu')",
                                             lambda: pipeline.compile_vta(vta_model, tmp_path / "out", target="cpu")),
        "unknown VTA device": ("open_device('fpga', cfg)", lambda: open_device("fpga", DEFAULT)),
        "not a VTA artifact": ("load_vta(DIR)", lambda: load_vta(tmp_path)),
        "calibration input of another shape": ("build(model, calibration=[{'input': 8x8}])",
                                               lambda: pipeline.build(vta_model, calibration=[{"input": np.zeros((1, 3, 8, 8))}])),
        "calibration input missing a model input": ("build(model, calibration=[{'x': 0}])",
                                                    lambda: pipeline.build(vta_model, calibration=[{"x": 0}])),
        "input missing (vta module)": ("load_vta(g.vta).run({})", lambda: load_vta(vta_artifact).run({})),
    }  # fmt: skip
    for what, (command, fn) in cases.items():
        with pytest.raises(LayerfuseError) as exc:
            fn()
        msg = _short(str(exc.value), tmp_path.parent)
        assert "\n" not in msg and "expected" in msg and " - " in msg, msg
        record(what, command, msg)
