"""The order of a conv epilogue's steps on the oneDNN tactic: an Add *after* the activation
(YOLO's shortcut ``x + act(conv(x))``, the plan's ``post_add``) is not oneDNN's ``sum``
post-op (which adds before the activation), and a residual Add *before* it (ResNet) is.
Swapping them changes the numbers wherever the activation is not the identity; compared
with onnxruntime through compile -> artifact -> runtime.load."""

from __future__ import annotations

import pytest
from test_concat_offsets import NEEDS_ONEDNN, compile_run_check

from graphs import Net


def _block(act: str, *, after: bool):
    n = Net(seed=51 if after else 52)
    x = n.relu(n.conv(n.input("x", (1, 16, 8, 8)), 16, name="stem"))
    c = n.conv(x, 16, name="c")
    if not after:  # ResNet: relu(x + conv(x))
        y = n.relu(n.node("Add", [x, c], name="add"), name="act")
    elif act == "Relu":
        y = n.node("Add", [x, n.relu(c, name="act")], name="add")
    else:  # SiLU written out, as YOLO exports it
        y = n.node("Add", [x, n.node("Mul", [c, n.node("Sigmoid", [c], name="sig")], name="act")], name="add")
    return n.build([n.relu(n.conv(y, 16, k=1, name="next"))])


@pytest.mark.parametrize(
    "act, tactics",
    [("Relu", "tvm"), pytest.param("Relu", "onednn", marks=NEEDS_ONEDNN), pytest.param("SiLU", "onednn", marks=NEEDS_ONEDNN)],
)
def test_add_after_the_activation_stays_after_it(act, tactics, tmp_path):
    manifest = compile_run_check(_block(act, after=True), tmp_path, tactics)  # rel. error <= 1e-4
    groups = [g for g in manifest["fusion"]["groups"] if g["template"].startswith("eltwise")]
    assert groups and groups[0]["details"]["op"] == "post_add", groups


@NEEDS_ONEDNN
def test_residual_add_before_the_activation(tmp_path):
    manifest = compile_run_check(_block("Relu", after=False), tmp_path, "onednn")
    layers = [c for c in manifest["tactics"]["layers"] if "_add_relu" in c["layer"]]
    assert layers and all(c["tactic"] == "onednn" for c in layers), manifest["tactics"]["layers"]  # the sum post-op
