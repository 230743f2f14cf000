"""Export the bench's torchvision networks to ONNX, with seeded live weights.

Usage: python scripts/export_torchvision.py OUT_DIR [NAME ...] [--seed 0] [--opset 17]

Needs torch and torchvision, which the package does not depend on; on Linux x86_64 for
example ``pip install torch torchvision onnx onnxscript`` in a virtual environment of its own.
With no NAME it writes the twelve networks ``scripts/bench_models.py`` is run on
(:data:`NETWORKS`) as ``OUT_DIR/NAME.onnx``.

Each network is torchvision's full configuration, batch 1, float32, written by torch's
TorchScript exporter (``dynamo=False``) in eval mode with constant folding: BatchNorm folded
into the convs, HardSwish and HardSigmoid as ops, SiLU as ``x * Sigmoid(x)``, the SE gate's
pooling as GlobalAveragePool, one file with its weights inside, as torchvision users have
them. GoogLeNet and Inception-v3 without their auxiliary heads.

Weights are not torchvision's trained ones (nothing is downloaded) but drawn so that every
activation stays O(1), as ``tvm_layerfuse.testing.weights`` does for ONNX files: conv and
linear weights He-normal ``N(0, 2 / fan_in)`` from ``torch.manual_seed(seed)``, BatchNorm
``gamma ~ U(0.5, 1.5)``, ``beta ~ N(0, 0.1)``, and running statistics calibrated on a seeded
standard-normal batch of 8 (a cumulative average over one forward pass in training mode), so
that each normalised tensor has mean 0 and standard deviation 1 per channel on that batch.
GoogLeNet's and Inception-v3's own initialisation (truncated normal, std 0.01) leaves their
logits equal to the classifier's bias to 1e-12, which no numeric comparison can fail.
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

NETWORKS = {  # name -> (torchvision builder keyword arguments, image side)
    "mobilenet_v3_small": ({}, 224),
    "mobilenet_v3_large": ({}, 224),
    "efficientnet_b0": ({}, 224),
    "shufflenet_v2_x1_0": ({}, 224),
    "mnasnet1_0": ({}, 224),
    "googlenet": ({"aux_logits": False, "init_weights": False}, 224),
    "inception_v3": ({"aux_logits": False, "init_weights": False}, 299),
    "densenet121": ({}, 224),
    "resnet50": ({}, 224),
    "resnet18": ({}, 224),
    "mobilenet_v2": ({}, 224),
    "squeezenet1_1": ({}, 224),
}


def live(net, image: int, *, seed: int):
    """``net`` with seeded He-normal weights and calibrated BatchNorm statistics, in eval mode."""
    import torch

    torch.manual_seed(seed)
    with torch.no_grad():
        for m in net.modules():
            if isinstance(m, (torch.nn.Conv2d, torch.nn.Linear)):
                fan_in = math.prod(m.weight.shape[1:])
                m.weight.normal_(0.0, math.sqrt(2.0 / fan_in))
                if m.bias is not None:
                    m.bias.normal_(0.0, 0.1)
            elif isinstance(m, torch.nn.BatchNorm2d):
                m.weight.uniform_(0.5, 1.5)
                m.bias.normal_(0.0, 0.1)
                m.reset_running_stats()
                m.momentum = None  # a cumulative average: one batch sets the statistics
        net.train()
        net(torch.randn(8, 3, image, image))
    return net.eval()


def export(name: str, out: Path, *, seed: int, opset: int) -> Path:
    import torch
    import torchvision

    kwargs, image = NETWORKS[name]
    net = live(getattr(torchvision.models, name)(weights=None, **kwargs), image, seed=seed)
    path = out / f"{name}.onnx"
    torch.onnx.export(
        net,
        (torch.randn(1, 3, image, image),),
        str(path),
        input_names=["input"],
        output_names=["logits"],
        opset_version=opset,
        do_constant_folding=True,
        dynamo=False,
    )
    return path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("names", nargs="*", metavar="NAME", help=f"any of {', '.join(NETWORKS)}")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--opset", type=int, default=17)
    args = ap.parse_args()
    unknown = sorted(set(args.names) - set(NETWORKS))
    if unknown:
        ap.error(f"unknown network(s) {', '.join(unknown)}: expected any of {', '.join(NETWORKS)}")
    args.out.mkdir(parents=True, exist_ok=True)
    for name in args.names or NETWORKS:
        print(export(name, args.out, seed=args.seed, opset=args.opset))


if __name__ == "__main__":
    main()
