"""Run by tests/test_multihost.py: tensor_parallel_worker's greedy generation and engine features (recompute
preemption: swap is one process's) at one tensor_parallel_size, printed as one JSON line.

  python tests/multihost_worker.py MODEL_PATH TP
  python tests/multihost_worker.py MODEL_PATH TP --enable-expert-parallel   # the greedy generation alone, a mixture
                                                                            # of experts' experts split whole
  python tests/multihost_worker.py MODEL_PATH TP --lora ADAPTER[,ADAPTER]   # and LoRA adapters mixed with the base
                                                                            # model (their slots written everywhere)

Alone, it is one process. Started twice with JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES=2 and JAX_PROCESS_ID set,
it is one engine over both processes: process 0 generates and prints, process 1 follows it.
"""

from __future__ import annotations

import json
import sys

import jpaged
from jpaged.runner.multihost import distributed_requested

if __name__ == "__main__":
    if distributed_requested() and jpaged.initialize_distributed() != 0:
        sys.exit(jpaged.follow())
    from tensor_parallel_worker import engine_features, lora_run, run

    model, tp = sys.argv[1], int(sys.argv[2])
    if sys.argv[3:] == ["--enable-expert-parallel"]:
        print(json.dumps({"run": run(model, tp, expert_parallel=True)}))
    else:
        results = {"run": run(model, tp), "features": engine_features(model, tp, modes=("recompute",))}
        if sys.argv[3:4] == ["--lora"]:
            results["lora"] = lora_run(model, tp, sys.argv[4].split(","))
        print(json.dumps(results))
