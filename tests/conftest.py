import os
import signal
import sys
from pathlib import Path

# Thread pools that sleep when idle: with `-n 2` two test processes share the machine's cores, and
# OpenMP's (oneDNN's) and TVM's pools spinning between calls would take them from each other.
# Set before any test imports TVM or loads oneDNN; subprocesses inherit it. Speed is measured
# in benchmarks, not here.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("TVM_THREAD_POOL_SPIN_COUNT", "0")

# A merge the plan decided and the Relax passes did not carry out fails the test that compiled it
# (outside the suite it is corrected in the plan, with the reason, and logged).
os.environ.setdefault("TVM_LAYERFUSE_STRICT_PLAN", "1")

# Tests import their helpers (graphs.py) as top-level modules.
sys.path.insert(0, str(Path(__file__).parent))

# Ctrl-C tests interrupt commands as a terminal would. A suite started as a background job
# (`pytest &`, `nohup`, some CI runners) inherits SIGINT *ignored*, and an ignored SIGINT stays
# ignored in every child, so those tests would test nothing: give the suite Python's own handler,
# which its children then start with (exec resets a handled signal to the default).
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

