"""Every user-facing message of the VTA flow: one line, and listed in docs/bad-inputs.md."""

import json
from pathlib import Path

import numpy as np
import pytest

from tvm_layerfuse.errors import LayerfuseError
from tvm_layerfuse.testing import zoo
from tvm_layerfuse.vta import pipeline
from tvm_layerfuse.vta.config import DEFAULT, load_config
from tvm_layerfuse.vta.runtime import load_vta, open_device

DOC = Path(__file__).resolve().parents[1] / "docs" / "bad-inputs.md"


def _config_file(tmp: Path, text: str) -> Path:
    p = tmp / "vta_config.json"
    p.write_text(text)
    return p


CASES = {
    "config value not an integer": lambda tmp: load_config(_config_file(tmp, json.dumps({"LOG_BLOCK": "4"}))),
    "config value out of range": lambda tmp: load_config(_config_file(tmp, json.dumps({"LOG_ACC_WIDTH": 4}))),
    "config unknown key": lambda tmp: load_config(_config_file(tmp, json.dumps({"LOG_BLOK": 4}))),
    "config non-square block": lambda tmp: load_config(_config_file(tmp, json.dumps({"LOG_BLOCK_IN": 4, "LOG_BLOCK_OUT": 3}))),
    "config buffers too large for the encoding": lambda tmp: load_config(
        _config_file(tmp, json.dumps({"LOG_ACC_BUFF_SIZE": 24, "LOG_INP_BUFF_SIZE": 24}))),
    "config not JSON": lambda tmp: load_config(_config_file(tmp, "{LOG_BLOCK: 4")),
    "config file missing": lambda tmp: load_config(tmp / "missing.json"),
    "no VTA board": lambda tmp: open_device("board", DEFAULT),
    "unknown VTA device": lambda tmp: open_device("fpga", DEFAULT),
    "not an artifact": lambda tmp: load_vta(tmp),
    "batch > 1": lambda tmp: pipeline.build(zoo.resnet18(batch=2, width=0.25)),
    "calibration input of another shape": lambda tmp: pipeline.build(
        zoo.resnet18(width=0.25), calibration=[{"input": np.zeros((1, 3, 8, 8), np.float32)}]),
    "calibration input missing a model input": lambda tmp: pipeline.build(zoo.resnet18(width=0.25), calibration=[{"x": 0}]),
}


def _artifact_cases(tmp: Path, art: Path) -> dict:
    import shutil

    bad = tmp / "art"
    shutil.copytree(art, bad)
    (bad / "programs.npz").write_bytes(b"x")
    return {
        "artifact file changed": lambda: load_vta(bad),
        "input missing": lambda: load_vta(art).run({}),
        "input of another shape": lambda: load_vta(art).run({"input": np.zeros((1, 3, 8, 8), np.float32)}),
    }


def _normalise(msg: str, tmp: Path) -> str:
    return msg.replace(str(tmp), "TMP")


def _messages(tmp_path) -> dict[str, str]:
    out = {}
    for name, fn in CASES.items():
        with pytest.raises(LayerfuseError) as exc:
            fn(tmp_path)
        out[name] = _normalise(str(exc.value), tmp_path)
    art = tmp_path / "compiled"
    pipeline.compile_vta(zoo.googlenet(blocks=1, width=0.25, image=16, seed=1), art, n_calibration=1)
    for name, fn in _artifact_cases(tmp_path, art).items():
        with pytest.raises(LayerfuseError) as exc:
            fn()
        out[name] = _normalise(str(exc.value), tmp_path)
    return out


def test_vta_messages_are_one_line_and_documented(tmp_path):
    doc = DOC.read_text()
    for name, msg in _messages(tmp_path).items():
        assert "\n" not in msg and "expected" in msg and " - " in msg, (name, msg)
        assert f"| {name} | `{msg}` |" in doc, f"docs/bad-inputs.md lacks the row: | {name} | `{msg}` |"
