"""Peak host memory while loading a model, beside the size of its weights: what loading each shard straight from
disk (issue 20) is to shrink. Each load runs in a fresh process (peak RSS is per process); figures are that
process's peak resident set after `load_model` returns, less its peak before (Python, JAX and the imports).

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
import json, resource, sys
import jax
from jpaged.models.loader import load_model
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
model = load_model(sys.argv[1] if sys.argv[1] != "default" else None, progress=False)
after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
weights = sum(x.nbytes for x in jax.tree_util.tree_leaves(model.params))
print(json.dumps({"peak_mib": (after - before) / 1024, "weights_mib": weights / 2**20}))
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
    print("| source | weights MiB | peak host MiB while loading | peak / weights |")
    print("|---|---|---|---|")
    for name, source in (("GGUF (conversion cache)", "default"), ("orbax checkpoint", args.orbax_dir)):
        figures = measure(source)
        ratio = figures["peak_mib"] / figures["weights_mib"]
        print(f"| {name} | {figures['weights_mib']:.0f} | {figures['peak_mib']:.0f} | {ratio:.2f} |")
    print("\ncommand: python scripts/bench_load.py " + " ".join(sys.argv[1:]))


if __name__ == "__main__":
    main()
