"""Start-up time of an offline engine: jpaged's imports, then LLM(...) (model load, KV pool, warm-up).

Run it twice: the first run fills the caches (GGUF conversion, compiled step programs), the second is a warm start.

  python scripts/bench_startup.py                      # the embedded model, the throughput benchmark's engine
"""

from __future__ import annotations

import time


def main() -> None:
    start = time.perf_counter()
    from jpaged import LLM  # its heavy imports (jax, transformers) happen here and in LLM()

    llm = LLM(max_num_seqs=64, max_num_batched_tokens=512, max_model_len=512)
    engine = llm.engine
    print(
        f"imports + LLM(): {time.perf_counter() - start:.1f} s, of which the warm-up of "
        f"{engine.runner.num_compilations} step shapes {engine.warmup_seconds:.1f} s"
    )
    print("command: python scripts/bench_startup.py")


if __name__ == "__main__":
    main()
