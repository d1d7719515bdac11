"""Run ``python -m k3compile ...`` and dump every thread's stack if it is still running
after ``K3_STACK_DUMP_S`` seconds (default 240) or gets SIGTERM: finds where a multi-GPU
run hangs (torchrun's agent ends its workers with SIGTERM).

    python3 -m torch.distributed.run --nproc-per-node 2 run_with_stack_dump.py run OUT ...
"""

import faulthandler
import os
import runpy
import signal
import sys

faulthandler.register(signal.SIGTERM, chain=True)
faulthandler.dump_traceback_later(float(os.environ.get("K3_STACK_DUMP_S", 240)), repeat=False)
sys.argv = ["k3compile", *sys.argv[1:]]
runpy.run_module("k3compile", run_name="__main__")
