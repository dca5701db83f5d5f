"""What quantization costs in quality, side by side on the embedded model, same run: perplexity on a fixed text
(the English support chats in scripts/data, each distinct message once) and greedy agreement with the bfloat16 model
(over the first 12 chats' user turns, 48 tokens each: the share of generated tokens equal to bfloat16's at the same
position, and the mean length of the run before the first difference).

Configurations: bfloat16 (the reference: the GGUF dequantised at load, --quantization none), the GGUF's Q4_1 / Q8_0
blocks as stored (the default), --quantization int8, --quantization fp8, --kv-cache-dtype fp8, and both fp8
together. The bfloat16 model is the Q4_1 file's weights rounded to bfloat16, and the blocks' kernel dequantises each
weight to that same bfloat16 value: their rows differ only by the order of the sums. What 4-bit quantization costs
is in every row (the embedded model ships as Q4_1 only).

  python scripts/bench_quality.py
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

DATA = Path(__file__).resolve().parent / "data" / "chat_en.jsonl"
CONFIGS = {
    "bfloat16": {"quantization": "none"},
    "Q4_1 blocks as stored (default)": {},
    "int8 weights (W8A8)": {"quantization": "int8"},
    "fp8 weights (W8A8)": {"quantization": "fp8"},
    "fp8 KV cache": {"kv_cache_dtype": "fp8", "quantization": "none"},
    "fp8 weights + fp8 KV": {"quantization": "fp8", "kv_cache_dtype": "fp8"},
}
GENERATED = 48


def chats() -> list[list[dict]]:
    return [json.loads(line)["messages"] for line in DATA.read_text().splitlines() if line.strip()]


def perplexity(llm, SamplingParams, text_ids: list[int]) -> float:
    (output,) = llm.generate(
        [{"prompt_token_ids": text_ids}], SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False
    )
    logprobs = [
        step[token].logprob for step, token in zip(output.prompt_logprobs[1:], text_ids[1:], strict=True)
    ]
    return math.exp(-sum(logprobs) / len(logprobs))


def main() -> None:
    from jpaged import LLM, SamplingParams

    conversations = chats()
    # Every message once (the chats share one system prompt, which repeated would be copied, not predicted).
    text = "\n".join(dict.fromkeys(m["content"] for messages in conversations for m in messages))
    greedy = SamplingParams(max_tokens=GENERATED, temperature=0.0, ignore_eos=True)
    prompts = [[m for m in messages if m["role"] != "assistant"][:2] for messages in conversations]
    results, reference = {}, None
    for name, fields in CONFIGS.items():
        llm = LLM(dtype="bfloat16", max_model_len=2048, max_num_seqs=16, **fields)
        text_ids = llm.tokenizer.encode(text)[:2000]
        outputs = [o.outputs[0].token_ids for o in llm.chat(prompts, greedy, use_tqdm=False)]
        reference = reference or outputs
        same = sum(
            a == b
            for ours, theirs in zip(outputs, reference, strict=True)
            for a, b in zip(ours, theirs, strict=True)
        )
        runs = [
            next((i for i, (a, b) in enumerate(zip(o, r, strict=True)) if a != b), len(o))
            for o, r in zip(outputs, reference, strict=True)
        ]
        results[name] = (perplexity(llm, SamplingParams, text_ids), same / (GENERATED * len(outputs)), runs)
        del llm
    print(f"embedded SmolLM2-135M, {len(text_ids)} tokens of text, {len(prompts)} chats x {GENERATED} tokens")
    print(
        "| configuration | perplexity | greedy tokens equal to bfloat16's | mean run before the first difference |"
    )
    print("|---|---|---|---|")
    for name, (ppl, agreement, runs) in results.items():
        print(f"| {name} | {ppl:.3f} | {agreement:.1%} | {sum(runs) / len(runs):.1f} |")
    print("\ncommand: python scripts/bench_quality.py " + " ".join(sys.argv[1:]))


if __name__ == "__main__":
    main()
