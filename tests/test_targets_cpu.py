"""CPU presets: ``cpu`` compiles for this host's CPU (explicit -mcpu), ``cpu-portable`` for any
x86-64; the manifest records which, and an artifact built for missing extensions is refused."""

import json

import onnx
import pytest

from graphs import rel_err, run_ort
from tvm_layerfuse.compile.build import compile_model
from tvm_layerfuse.compile.presets import host_cpu_name, preset_names, resolve
from tvm_layerfuse.errors import ArtifactError
from tvm_layerfuse.runtime import load
from tvm_layerfuse.runtime.tactics import check_cpu, cpu_flags
from tvm_layerfuse.testing import random_cnn, random_inputs


def test_cpu_preset_names_this_hosts_cpu():
    from tvm.target import codegen

    spec = resolve("cpu")
    mcpu = spec.target["mcpu"]
    assert mcpu == host_cpu_name() and mcpu not in ("host", "generic", "")
    assert codegen.llvm_is_valid_cpu(mcpu, "x86_64-pc-linux-gnu")
    d = spec.to_dict()
    assert d["portable"] is False and d["tvm_target"]["mcpu"] == mcpu
    have = cpu_flags() or set()
    assert set(d["cpu_flags"]) <= have and ("avx2" in d["cpu_flags"]) == ("avx2" in have)


def test_portable_preset_is_baseline_x86_64():
    assert "cpu-portable" in preset_names()
    d = resolve("cpu-portable").to_dict()
    assert d["tvm_target"] == {"kind": "llvm", "mcpu": "x86-64"}
    assert d["portable"] is True and d["cpu_flags"] == []


def test_missing_cpu_extension_is_refused_in_one_line():
    manifest = {"target": {"tvm_target": {"kind": "llvm", "mcpu": "znver4"}, "cpu_flags": ["avx2", "avx512f"]}}
    check_cpu(manifest, flags={"avx2", "avx512f", "sse4_2"})
    with pytest.raises(ArtifactError) as e:
        check_cpu(manifest, flags={"avx2", "sse4_2"})
    msg = str(e.value)
    assert "\n" not in msg and "avx512f" in msg and "znver4" in msg and "cpu-portable" in msg
    check_cpu({"target": {"cpu_flags": []}}, flags=set())  # portable: nothing needed


def test_both_presets_compile_run_and_are_recorded(tmp_path):
    model = random_cnn(11, max_layers=4)
    path = tmp_path / "m.onnx"
    onnx.save(model, str(path))
    feeds = random_inputs(model, 1)
    expected = run_ort(model, feeds)
    for preset in ("cpu", "cpu-portable"):
        out = compile_model(path, tmp_path / preset, target=preset, progress=False)
        m = json.loads((out / "manifest.json").read_text())
        assert m["target"]["preset"] == preset
        assert m["target"]["portable"] is (preset == "cpu-portable")
        if m["tactics"]["used"] == "onednn":  # weights packed for this CPU's oneDNN, never for "any x86-64"
            packing = m["tactics"]["packed_weights"]
            assert (packing is None) is (preset == "cpu-portable"), packing
        got = load(out).run(feeds)
        for e, g in zip(expected, got.values()):
            assert rel_err(g, e) <= 1e-4
