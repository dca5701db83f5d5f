"""What speculative decoding buys on the CPU, same run, on the embedded SmolLM2-135M (Q4_1 blocks, greedy): output
tokens/s of the engine without speculation (the baseline), with n-gram prompt lookup and with suffix decoding (k
proposals a step each), on four workloads: copy-heavy requests (scripts/data/copy_heavy.jsonl: code edits that give
back the whole file, quotes of a document) one after another and 16 at once (its 8 cycled twice), and plain chat
(the first 8 of scripts/data/chat_en.jsonl) the same two ways. Requests stop at EOS or --max-tokens.

The three engines are built once and measured in turns (`--rounds`), the median reported with its ratio to the
baseline; before each measurement the prefix cache is emptied (every run prefills its prompts) and the suffix
proposer's cache of finished requests too (a round must not propose the previous round's answers). A run's rate is
its own output tokens over its seconds (an output that left the baseline's at a near-tie may end elsewhere). Also
reported: the acceptance rate over the measured runs (spec_decode_stats' delta), milliseconds a step (a verifying
step computes k + 1 tokens a sequence where a decode computes 1: what a proposal costs when it is rejected), and
whether every output's tokens equal the baseline's (they must: greedy rows accept only the argmax), else how many
outputs differed over the rounds and, for each, where and by what margin the baseline chose there (a bfloat16
near-tie between logits computed in differently shaped steps, or a bug: `--dtype float32` tells them apart).

  python scripts/bench_spec.py [--rounds 2] [--max-tokens 200] [--k 4] [--lookup-min 2] [--lookup-max 4]
  python scripts/bench_spec.py --rounds 1 --workloads "copy x1,chat x1" --dtype float32
  python scripts/bench_spec.py --methods draft --workloads "copy x1,chat x1"   # draft models: a random one, itself
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

DATA = Path(__file__).resolve().parent / "data"
STREAMS = 16


def conversations(name: str, count: int) -> list[list[dict]]:
    lines = (DATA / name).read_text().splitlines()
    return [json.loads(line)["messages"] for line in lines if line.strip()][:count]


def counted_steps(llm) -> list[int]:
    """A counter of the engine's steps (wraps the instance's step method)."""
    count = [0]
    step = llm.engine.step

    def counting_step():
        count[0] += 1
        return step()

    llm.engine.step = counting_step
    return count


def fresh_caches(llm) -> None:
    """Empty the prefix cache and the suffix proposer's finished requests, so a run sees its prompts first."""
    llm.engine.reset_prefix_cache()
    if llm.engine.speculation is not None:
        llm.engine.speculation.forget_finished()


def random_draft(root: Path) -> Path:
    """A 2-layer random Llama of the embedded model's tokenizer: a draft whose proposals are nearly always wrong
    (what the mechanism costs, k draft decodes and its share of every step, with nothing accepted)."""
    import torch
    import transformers

    from jpaged.models.default_model import default_model_path
    from jpaged.models.loader import load_model

    config = transformers.LlamaConfig(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=8192)  # fmt: skip
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(root / "draft")
    load_model(str(default_model_path()), progress=False).tokenizer.save_pretrained(root / "draft")
    return root / "draft"


def run(llm, chats: list[list[dict]], streams: int, params) -> tuple[float, list[list[int]], list[list[int]]]:
    """Seconds, each request's output tokens and its prompt's: one request at a time (streams 1) or all at once."""
    fresh_caches(llm)
    start = time.perf_counter()
    if streams == 1:
        outputs = [llm.chat(chat, params, use_tqdm=False)[0] for chat in chats]
    else:
        outputs = llm.chat(chats, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    return (
        seconds,
        [list(output.outputs[0].token_ids) for output in outputs],
        [list(output.prompt_token_ids) for output in outputs],
    )


def describe(baseline, prompt: list[int], first: int | None, got: list[int], want: list[int]) -> str:
    """Where an output left the baseline's, and the baseline's margin there (its two best logprobs after the prompt
    and the tokens both agree on, prefilled): a margin within bfloat16's rounding of the logits is a near-tie."""
    from jpaged import SamplingParams

    if first is None:
        return f"one output is a prefix of the other ({len(got)} against {len(want)} tokens)"
    params = SamplingParams(temperature=0.0, max_tokens=1, logprobs=2)
    context = {"prompt_token_ids": prompt + want[:first]}
    top = baseline.generate(context, params, use_tqdm=False)[0].outputs[0].logprobs[0]
    best = sorted(top.items(), key=lambda item: -item[1].logprob)[:2]
    margin = best[0][1].logprob - best[1][1].logprob
    return (
        f"first at output token {first}: {got[first]} against the baseline's {want[first]}; the baseline's two "
        f"best there (prefilled) {[token for token, _ in best]}, {margin:.3f} apart in logprob"
    )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=200)
    parser.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    parser.add_argument("--lookup-min", type=int, default=2, help="ngram: prompt_lookup_min")
    parser.add_argument("--lookup-max", type=int, default=4, help="ngram: prompt_lookup_max")
    parser.add_argument(
        "--methods",
        default="ngram,suffix",
        help="of ngram, suffix, draft (a random 2-layer draft, and the model itself)",
    )
    parser.add_argument("--dtype", default="auto", help="activations (auto: bfloat16 on this CPU)")
    parser.add_argument("--workloads", default="copy x1,copy x16,chat x1,chat x16")
    args = parser.parse_args()
    from jpaged import LLM, SamplingParams
    from jpaged.pallas.cpu.library import cpu_flags

    specs = {
        "ngram": {
            "method": "ngram",
            "num_speculative_tokens": args.k,
            "prompt_lookup_min": args.lookup_min,
            "prompt_lookup_max": args.lookup_max,
        },
        "suffix": {"method": "suffix", "num_speculative_tokens": args.k},
    }
    if "draft" in args.methods:
        from jpaged.models.default_model import default_model_path

        drafts = Path(tempfile.mkdtemp())
        specs["draft-random"] = {"model": str(random_draft(drafts)), "num_speculative_tokens": args.k}
        specs["draft-self"] = {"model": str(default_model_path()), "num_speculative_tokens": args.k}
    methods = ["none", *(m for m in specs if m in args.methods.split(",") or m.split("-")[0] in args.methods)]
    engines, steps = {}, {}
    for method in methods:
        built = time.perf_counter()
        engines[method] = LLM(kv_cache_memory=2**30, dtype=args.dtype, speculative_config=specs.get(method))
        print(f"built {method} in {time.perf_counter() - built:.0f} s", file=sys.stderr)
        steps[method] = counted_steps(engines[method])
    copy, chat = conversations("copy_heavy.jsonl", 8), conversations("chat_en.jsonl", 8)
    workloads = {}
    for name in args.workloads.split(","):
        data, streams = name.split(" x")
        chats = copy if data == "copy" else chat
        streams = int(streams)
        workloads[name] = (chats if streams == 1 else (chats * STREAMS)[:STREAMS], streams)
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    warm = SamplingParams(temperature=0.0, max_tokens=16)
    for llm in engines.values():  # warm: a first request and a first batch
        llm.chat([{"role": "user", "content": "Name three colours."}], warm, use_tqdm=False)
        llm.chat(
            [[{"role": "user", "content": f"Count to {i}."}] for i in range(STREAMS)], warm, use_tqdm=False
        )

    seconds = {(w, m): [] for w in workloads for m in methods}
    generated = {(w, m): [] for w in workloads for m in methods}  # output tokens a run (outputs may differ)
    step_counts = {(w, m): 0 for w in workloads for m in methods}
    accepted = {(w, m): [0, 0] for w in workloads for m in methods}
    tokens, prompt_ids, mismatches = {}, {}, {(w, m): 0 for w in workloads for m in methods}
    differing = {}  # (workload, method, request) -> (first differing output token, its tokens, the baseline's)
    for round_ in range(args.rounds):
        for workload, (chats, streams) in workloads.items():
            for method, llm in engines.items():
                before, stats = steps[method][0], llm.engine.spec_decode_stats()
                elapsed, outputs, prompts = run(llm, chats, streams, params)
                seconds[workload, method].append(elapsed)
                generated[workload, method].append(sum(len(output) for output in outputs))
                step_counts[workload, method] += steps[method][0] - before
                if stats is not None:
                    after = llm.engine.spec_decode_stats()
                    accepted[workload, method][0] += after.num_accepted_tokens - stats.num_accepted_tokens
                    accepted[workload, method][1] += after.num_draft_tokens - stats.num_draft_tokens
                if method == "none":
                    tokens[workload], prompt_ids[workload] = outputs, prompts
                else:
                    for index, (got, want) in enumerate(zip(outputs, tokens[workload], strict=True)):
                        if got != want:
                            mismatches[workload, method] += 1
                            first = next(
                                (i for i, (a, b) in enumerate(zip(got, want, strict=False)) if a != b), None
                            )
                            differing.setdefault((workload, method, index), (first, got, want))
            print(f"round {round_ + 1} {workload} done", file=sys.stderr)

    flags = sorted(cpu_flags() & {"avx2", "avx512_bf16", "amx_bf16", "amx_int8"})
    print(
        f"embedded SmolLM2-135M (Q4_1 blocks), greedy, max_tokens {args.max_tokens}, k={args.k}, ngram lookup "
        f"{args.lookup_min}..{args.lookup_max}; {args.rounds} rounds in turns; CPU flags: {' '.join(flags)}"
    )
    print("| workload | method | output tok/s | vs none | acceptance | tokens/step | ms/step | identical |")
    print("|---|---|---|---|---|---|---|---|")
    rows = []

    def rate_of(key) -> float:  # each run's own output tokens over its seconds, the median run
        return statistics.median(n / t for n, t in zip(generated[key], seconds[key], strict=True))

    for workload in workloads:
        base = rate_of((workload, "none"))
        for method in methods:
            key = (workload, method)
            rate, count = rate_of(key), sum(generated[key])
            good, drafted = accepted[key]
            per_step = count / step_counts[key]
            step_ms = 1e3 * sum(seconds[key]) / step_counts[key]
            same = "-" if method == "none" else ("yes" if not mismatches[key] else f"NO ({mismatches[key]})")
            acceptance = f"{good / drafted:.0%}" if drafted else "-"
            print(
                f"| {workload} | {method} | {rate:.0f} | {rate / base:.2f}x | {acceptance} | {per_step:.2f} | "
                f"{step_ms:.1f} | {same} |"
            )
            rows.append({
                "workload": workload, "method": method, "tokens_per_s": round(rate, 1),
                "vs_none": round(rate / base, 3), "acceptance_rate": round(good / drafted, 3) if drafted else None,
                "ms_per_step": round(step_ms, 2), "output_tokens": count, "mismatches": mismatches[key],
            })  # fmt: skip
    for (workload, method, index), (first, got, want) in differing.items():
        note = describe(engines["none"], prompt_ids[workload][index], first, got, want)
        print(f"MISMATCH: {method} on {workload}, request {index}: {note}")
    print(json.dumps({"bench": "spec", "max_tokens": args.max_tokens, "k": args.k, "rows": rows}))
    print("\ncommand: python scripts/bench_spec.py " + " ".join(sys.argv[1:]))


if __name__ == "__main__":
    main()
