"""The command line as a user runs it: real subprocesses, exit codes, one-line errors."""

import json
import os
import shutil
import subprocess
import sys

import pytest

from tvm_layerfuse.models import light_model


def cli(*args, env=None, cwd=None):
    return subprocess.run(
        [sys.executable, "-m", "tvm_layerfuse", *args],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
        cwd=cwd,
    )


def assert_one_line_error(proc, *fragments):
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr
    assert "Traceback" not in proc.stderr
    for f in fragments:
        assert f in lines[0]


def test_inspect_default_model_prints_plan():
    p = cli("inspect", "--plan-only")
    assert p.returncode == 0, p.stderr
    assert "75 groups: 57 vertical, 9 horizontal, 0 element-wise, 9 in-place concat" in p.stdout
    assert "3 convs on" in p.stdout


def test_inspect_full_tables():
    p = cli("inspect", str(light_model("squeezenet")))
    assert p.returncode == 0, p.stderr
    for section in ("== first topology graph ==", "== fusion plan ==", "== second topology graph ==", "refused:"):
        assert section in p.stdout
    assert "kernel_shape differ" in p.stdout


def test_inspect_json():
    p = cli("inspect", str(light_model("resnet50")), "--json")
    assert p.returncode == 0, p.stderr
    d = json.loads(p.stdout)
    assert d["counts"]["eltwise"] == 16
    assert len(d["first_graph"]["layers"]) == 176 and len(d["second_graph"]["layers"]) == 58


@pytest.mark.skipif(shutil.which("dot") is None, reason="Graphviz is not installed")
def test_inspect_svg_and_dot(tmp_path):
    svg, dot = tmp_path / "g.svg", tmp_path / "g.dot"
    p = cli("inspect", str(light_model("squeezenet")), "--svg", str(svg), "--dot", str(dot), "-q")
    assert p.returncode == 0, p.stderr
    assert svg.read_text().lstrip().startswith("<?xml") and "<svg" in svg.read_text()
    text = dot.read_text()
    assert text.startswith("digraph") and "cluster_a_g" in text and "second topology graph" in text


def test_svg_without_graphviz_writes_dot(tmp_path):
    env = dict(os.environ, PATH=os.path.dirname(sys.executable))  # no dot on this PATH
    p = cli("inspect", str(light_model("squeezenet")), "--svg", str(tmp_path / "g.svg"), env=env)
    assert p.returncode == 0, p.stderr
    assert (tmp_path / "g.dot").read_text().startswith("digraph")
    assert not (tmp_path / "g.svg").exists()
    assert "apt-get install graphviz" in p.stderr


def test_errors_are_one_line(tmp_path):
    assert_one_line_error(cli("inspect", str(tmp_path / "missing.onnx")), "does not exist")
    junk = tmp_path / "junk.onnx"
    junk.write_bytes(b"this is not a protobuf \x00\xff" * 50)
    assert_one_line_error(cli("inspect", str(junk)), "junk.onnx")
    cut = tmp_path / "cut.onnx"
    data = light_model("squeezenet").read_bytes()
    cut.write_bytes(data[: len(data) // 3])
    assert_one_line_error(cli("inspect", str(cut)))
    assert_one_line_error(cli("inspect", "--input-shape", "data_0=1,a,3"), "non-integer")
    assert_one_line_error(cli("inspect", "--input-shape", "nope=1,3"), "not an input")
    assert_one_line_error(cli("inspect", "--svg", str(tmp_path / "no" / "dir" / "g.svg")), "does not exist")


def test_dynamic_shape_needs_override(tmp_path):
    import onnx

    m = onnx.load(str(light_model("squeezenet")))
    m.graph.input[[i.name for i in m.graph.input].index("data_0")].type.tensor_type.shape.dim[0].dim_param = "N"
    path = tmp_path / "dyn.onnx"
    onnx.save(m, str(path))
    assert_one_line_error(cli("inspect", str(path)), "--input-shape data_0=1,3,224,224")
    p = cli("inspect", str(path), "--plan-only", "--input-shape", "data_0=2,3,224,224")
    assert p.returncode == 0, p.stderr
    assert "8 in-place concat" in p.stdout


def test_inspect_compile_reports_fewer_kernels_than_tvm_default():
    p = cli("inspect", "--plan-only", "--compile", "--json")
    assert p.returncode == 0, p.stderr
    c = json.loads(p.stdout)["compiled"]
    assert c["parallel_conv_groups"] == 9
    assert c["layerfuse"]["conv_kernels"] == c["default"]["conv_kernels"] - 18  # 9 groups of 3 -> 1
    assert c["layerfuse"]["kernels"] < c["default"]["kernels"]
    assert c["layerfuse"]["concat_kernels"] == 0 and c["layerfuse"]["concat_bytes_copied"] == 0
    assert c["default"]["concat_kernels"] == 9 and c["default"]["concat_bytes_copied"] > 0
    assert c["layerfuse"]["bytes_written"] < c["default"]["bytes_written"]
    assert c["layerfuse"]["activation_bytes"] <= c["default"]["activation_bytes"]


INTERRUPTED_CONSTRUCTOR = """
import sys
from tvm_layerfuse.cli import commands

class Half:  # as TVM's TempDirectory when Ctrl-C comes inside its __init__
    def __init__(self):
        raise KeyboardInterrupt
    def __del__(self):
        self.temp_dir

def command():
    staging = Half()

try:
    command()
except KeyboardInterrupt:
    commands._say_interrupted(standalone=True)
"""


def test_an_interrupt_prints_one_line_even_where_it_cut_a_constructor_short():
    """Ctrl-C inside an object's constructor leaves it half built; freeing it with the
    interrupt's traceback ran its ``__del__``, and Python printed "Exception ignored in" and a
    traceback after the command's one line (seen from TVM's TempDirectory while a compile
    exported its library). The command's process prints the one line and nothing after it."""
    p = subprocess.run([sys.executable, "-c", INTERRUPTED_CONSTRUCTOR], capture_output=True, text=True, timeout=120)
    assert p.stderr.strip().splitlines() == ["error: interrupted; nothing was written"], p.stderr
