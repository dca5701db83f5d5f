"""Peak host memory while loading a model, beside the size of its weights: what loading each shard straight from
disk (issue 20) is to shrink. Each load runs in a fresh process (peak RSS is per process); figures are that
process's peak resident set after `load_model` returns, less its peak before (Python, JAX and the imports), and
the peak of its anonymous memory alone (RssAnon, sampled every 5 ms while loading, less before): the resident set
also counts the pages of memory-mapped files read, which the kernel may drop at any time.

Sources: the embedded SmolLM2 GGUF (dequantised through the conversion cache, as every start after the first
reads it) and an orbax checkpoint of it (`jpaged convert`, written to --orbax-dir first if missing).

  python scripts/bench_load.py
"""

from __future__ import annotations

import argparse
import json
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
model = load_model(sys.argv[1] if sys.argv[1] != "default" else None, progress=False)
done.set()
sampler.join()
after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
weights = sum(x.nbytes for x in jax.tree_util.tree_leaves(model.params))
figures = {"peak_mib": (after - before) / 1024, "anon_mib": (max(samples) - samples[0]) / 1024}
print(json.dumps({**figures, "weights_mib": weights / 2**20}))
"""


def measure(source: str) -> dict:
    result = subprocess.run(
        [sys.executable, "-c", MEASURE, source], capture_output=True, text=True, cwd=ROOT, check=True
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
    for name, source in (("GGUF (conversion cache)", "default"), ("orbax checkpoint", args.orbax_dir)):
        figures = measure(source)
        weights, rss, anon = figures["weights_mib"], figures["peak_mib"], figures["anon_mib"]
        print(
            f"| {name} | {weights:.0f} | {rss:.0f} | {rss / weights:.2f} | {anon:.0f} | {anon / weights:.2f} |"
        )
    print("\ncommand: python scripts/bench_load.py " + " ".join(sys.argv[1:]))


if __name__ == "__main__":
    main()
