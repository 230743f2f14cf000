"""Deploy over TVM RPC: the module lives in :mod:`tvm_layerfuse.deploy`; this path keeps
``from tvm_layerfuse import rpc; rpc.deploy(...)`` working."""

from .deploy import *  # noqa: F403 - the same public names
from .deploy import __all__  # noqa: F401
