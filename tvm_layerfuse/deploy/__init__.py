"""Deployment: an artifact on an edge board over TVM RPC, boards to run it on, bundles.

::

    from tvm_layerfuse import deploy
    result = deploy.deploy("out/squeezenet", rpc=("192.168.1.20", 9091), repeat=10)

* :mod:`.client` - :func:`deploy`: checks, the job, the result;
* :mod:`.inputs` - what deploy is given (address, inputs, library, device, board machine);
* :mod:`.results` - :class:`DeployResult` and what it holds;
* :mod:`.watchdog` / :mod:`.worker` - the worker subprocess and the deadline of each step;
* :mod:`.tracker` - TVM's tracker protocol with deadlines;
* :mod:`.board` - local, tracked and emulated AArch64 RPC servers (``python -m tvm_layerfuse.board``);
* :mod:`.bundle` - a runtime-only directory for a machine without TVM.
"""

from ..errors import BoardMismatchError, DeployError, DeployTimeoutError
from .client import DEFAULT_RPC, DEFAULT_TIMEOUT, MAX_SESSION_TIMEOUT, deploy
from .inputs import elf_machine, normalize_inputs, parse_address
from .results import BoardInfo, DeployResult, Latency, RunRecord

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
]
