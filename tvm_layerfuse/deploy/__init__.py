"""Deployment: an artifact on an edge board over TVM RPC, boards to run it on, bundles.

::

    from tvm_layerfuse import deploy
    result = deploy.deploy("out/squeezenet", rpc=("192.168.1.20", 9091), repeat=10)

* :mod:`.client` - :func:`deploy`: checks, the job, the result;
* :mod:`.board` - local, tracked and emulated AArch64 RPC servers (``python -m tvm_layerfuse.board``);
* :mod:`.bundle` - a runtime-only directory for a machine without TVM.
"""

from .client import (
    DEFAULT_RPC,
    DEFAULT_TIMEOUT,
    MAX_SESSION_TIMEOUT,
    BoardInfo,
    BoardMismatchError,
    DeployError,
    DeployResult,
    DeployTimeoutError,
    Latency,
    RunRecord,
    deploy,
    elf_machine,
    normalize_inputs,
    parse_address,
    random_inputs,
)

__all__ = [
    "DEFAULT_RPC",
    "DEFAULT_TIMEOUT",
    "MAX_SESSION_TIMEOUT",
    "BoardInfo",
    "BoardMismatchError",
    "DeployError",
    "DeployResult",
    "DeployTimeoutError",
    "Latency",
    "RunRecord",
    "deploy",
    "elf_machine",
    "normalize_inputs",
    "parse_address",
    "random_inputs",
]
