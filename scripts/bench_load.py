"""Peak host memory while loading a model, beside the size of its weights: what loading each shard straight from
disk (issue 20) is to shrink. Each load runs in a fresh process (peak RSS is per process); figures are that
process's peak resident set after `load_model` returns, less its peak before (Python, JAX and the imports), and
the peak of its anonymous memory alone (RssAnon, sampled every 5 ms while loading, less before): the resident set
also counts the pages of memory-mapped files read, which the kernel may drop at any time.

Sources: the embedded SmolLM2 GGUF (dequantised through the conversion cache, as every start after the first
reads it) and an orbax checkpoint of it (`jpaged convert`, written to --orbax-dir first if missing). Then the
weights loaded and placed on 3 simulated CPU devices at tensor_parallel_size 3, read whole first (eager) or each
device's part from the cache file or the orbax checkpoint (lazy, as tensor parallelism loads): the devices'
buffers are this process's memory too, so placing costs 1x the weights either way, and what eager loading adds on
top is the host's copy.

  python scripts/bench_load.py
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

MEASURE = """
import json, re, resource, sys, threading, time
import jax
from jpaged.models.loader import load_model

def anon_kib():
    with open("/proc/self/status") as status:
        return int(re.search(r"RssAnon:\\s+(\\d+)", status.read()).group(1))

samples, done = [anon_kib()], threading.Event()
def sample():
    while not done.is_set():
        samples.append(anon_kib())
        time.sleep(0.005)

before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
sampler = threading.Thread(target=sample)
sampler.start()
source, mode = (None if sys.argv[1] == "default" else sys.argv[1]), sys.argv[2]
model = load_model(source, progress=False, lazy=mode == "lazy")
if mode != "load":
    from jpaged.config import EngineConfig
    from jpaged.runner.model_runner import ModelRunner

    config = EngineConfig(tensor_parallel_size=3, max_num_seqs=4, max_num_batched_tokens=16).for_platform("cpu")
    runner = ModelRunner(config, model.config, model.params, num_blocks=2, max_model_len=64)
done.set()
sampler.join()
after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
weights = sum(x.nbytes for x in jax.tree_util.tree_leaves(model.params))
figures = {"peak_mib": (after - before) / 1024, "anon_mib": (max(samples) - samples[0]) / 1024}
print(json.dumps({**figures, "weights_mib": weights / 2**20}))
"""


def measure(source: str, mode: str = "load") -> dict:
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=3"}
    result = subprocess.run(
        [sys.executable, "-c", MEASURE, source, mode],
        capture_output=True,
        text=True,
        cwd=ROOT,
        check=True,
        env=env,
    )
    return json.loads(result.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--orbax-dir", default="/tmp/jpaged-bench-load-orbax")
    args = parser.parse_args()
    measure("default")  # fills the GGUF conversion cache if this machine has not yet
    if not Path(args.orbax_dir).exists():
        sys.path.insert(0, str(ROOT))
        from jpaged.models.default_model import default_model_path

        convert = [
            sys.executable,
            "-m",
            "jpaged.entrypoints.cli",
            "convert",
            str(default_model_path()),
            args.orbax_dir,
        ]
        subprocess.run(convert, check=True, cwd=ROOT)
    print(
        "| source | weights MiB | peak RSS MiB while loading | / weights | peak anonymous MiB | / weights |"
    )
    print("|---|---|---|---|---|---|")
    runs = (
        ("GGUF (conversion cache)", "default", "load"),
        ("orbax checkpoint", args.orbax_dir, "load"),
        ("GGUF cache, placed at tp 3, read whole", "default", "eager"),
        ("GGUF cache, placed at tp 3, each device's part read", "default", "lazy"),
        ("orbax, placed at tp 3, read whole first", args.orbax_dir, "eager"),
        ("orbax, placed at tp 3, restored into each device's shard", args.orbax_dir, "lazy"),
    )
    for name, source, mode in runs:
        figures = measure(source, mode)
        weights, rss, anon = figures["weights_mib"], figures["peak_mib"], figures["anon_mib"]
        print(
            f"| {name} | {weights:.0f} | {rss:.0f} | {rss / weights:.2f} | {anon:.0f} | {anon / weights:.2f} |"
        )
    print("\ncommand: python scripts/bench_load.py " + " ".join(sys.argv[1:]))


if __name__ == "__main__":
    main()
