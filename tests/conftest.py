import signal
import sys
from pathlib import Path

# Tests import their helpers (graphs.py) as top-level modules.
sys.path.insert(0, str(Path(__file__).parent))

# Ctrl-C tests interrupt commands as a terminal would. A suite started as a background job
# (`pytest &`, `nohup`, some CI runners) inherits SIGINT *ignored*, and an ignored SIGINT stays
# ignored in every child, so those tests would test nothing: give the suite Python's own handler,
# which its children then start with (exec resets a handled signal to the default).
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

