"""Output kinds (vLLM's RequestOutputKind): CUMULATIVE reports everything every step, DELTA only what is new,
FINAL_ONLY once at the end with its text decoded in one go; all three end with the same tokens and text."""

from __future__ import annotations

from engine_driver import run_requests

from jpaged.config import EngineConfig
from jpaged.engine.llm_engine import LLMEngine
from jpaged.entrypoints.llm import LLM
from jpaged.outputs import RequestOutput
from jpaged.sampling_params import RequestOutputKind, SamplingParams

CUMULATIVE, DELTA, FINAL_ONLY = (
    RequestOutputKind.CUMULATIVE,
    RequestOutputKind.DELTA,
    RequestOutputKind.FINAL_ONLY,
)
PROMPTS = ["ท้องฟ้าวันนี้สวยมาก", "I ❤️ 🦙 llamas and", "The capital of France is"]
ARGS = dict(max_num_seqs=8, max_num_batched_tokens=64, max_model_len=96, num_blocks=64, enforce_eager=True)


def make(model, **overrides) -> LLMEngine:
    return LLMEngine(EngineConfig(**{**ARGS, **overrides}), model=model)


def stream(
    engine: LLMEngine, requests: dict[str, tuple[object, SamplingParams]]
) -> dict[str, list[RequestOutput]]:
    """Every output of every request, in order."""
    for request_id, (prompt, params) in requests.items():
        engine.add_request(request_id, prompt, params)
    outputs: dict[str, list[RequestOutput]] = {request_id: [] for request_id in requests}
    while engine.has_unfinished():
        for output in engine.step():
            outputs[output.request_id].append(output)
    return outputs


def params(kind: RequestOutputKind, **overrides) -> SamplingParams:
    return SamplingParams(
        **{"temperature": 0.0, "max_tokens": 24, "ignore_eos": True, "output_kind": kind, **overrides}
    )


def final_texts(outputs: list[RequestOutput]) -> list[tuple[str, tuple[int, ...], str | None]]:
    return [(o.text, tuple(o.token_ids), o.finish_reason) for o in outputs[-1].outputs]


def test_final_only_reports_once_with_the_text_cumulative_streams(tiny_llama):
    cumulative = stream(make(tiny_llama), {f"r{i}": (p, params(CUMULATIVE)) for i, p in enumerate(PROMPTS)})
    final = stream(make(tiny_llama), {f"r{i}": (p, params(FINAL_ONLY)) for i, p in enumerate(PROMPTS)})
    for request_id, outputs in final.items():
        assert len(outputs) == 1 and outputs[0].finished
        assert len(cumulative[request_id]) == 24
        assert final_texts(outputs) == final_texts(cumulative[request_id])
        assert outputs[0].outputs[0].text  # the random model's bytes still decode to some text


def test_delta_outputs_concatenate_to_the_cumulative_output(tiny_llama):
    sampled = dict(temperature=1.0, n=2, seed=7)
    cumulative = stream(make(tiny_llama), {"a": (PROMPTS[0], params(CUMULATIVE, **sampled))})["a"]
    deltas = stream(make(tiny_llama), {"a": (PROMPTS[0], params(DELTA, **sampled))})["a"]
    assert len(deltas) == len(cumulative) and deltas[-1].finished
    for index in range(2):
        pieces = [c for o in deltas for c in o.outputs if c.index == index]
        assert all(len(c.token_ids) == 1 for c in pieces)  # one new token per step, never a repeat
        assert "".join(c.text for c in pieces) == cumulative[-1].outputs[index].text
        assert [t for c in pieces for t in c.token_ids] == cumulative[-1].outputs[index].token_ids
        assert [c.finish_reason for c in pieces] == [None] * 23 + ["length"]


def test_delta_sends_prompt_logprobs_once(tiny_llama):
    outputs = stream(make(tiny_llama), {"a": (PROMPTS[2], params(DELTA, max_tokens=3, prompt_logprobs=1))})[
        "a"
    ]
    assert len(outputs[0].prompt_logprobs) == len(outputs[0].prompt_token_ids)
    assert [o.prompt_logprobs for o in outputs[1:]] == [None, None]


def test_final_only_still_stops_at_a_stop_string(tiny_llama):
    cumulative = stream(make(tiny_llama), {"a": (PROMPTS[2], params(CUMULATIVE))})["a"][-1].outputs[0].text
    stop = cumulative[len(cumulative) // 2 : len(cumulative) // 2 + 3]
    expected = cumulative[: cumulative.index(stop)]
    for kind in (CUMULATIVE, FINAL_ONLY):
        output = stream(make(tiny_llama), {"a": (PROMPTS[2], params(kind, stop=stop))})["a"][-1].outputs[0]
        assert (output.text, output.finish_reason, output.stop_reason) == (expected, "stop", stop)


def abort_after(model, kind: RequestOutputKind, steps: int):
    engine = make(model)
    engine.add_request("a", PROMPTS[1], params(kind))
    for _ in range(steps):
        engine.step()
    return engine.abort_request("a").outputs[0]


def test_abort_returns_the_text_of_the_tokens_so_far(tiny_llama):
    streamed, final = abort_after(tiny_llama, CUMULATIVE, 6), abort_after(tiny_llama, FINAL_ONLY, 6)
    assert streamed.token_ids == final.token_ids and len(final.token_ids) == 6
    assert streamed.finish_reason == final.finish_reason == "abort"
    finished = stream(make(tiny_llama), {"a": (PROMPTS[1], params(CUMULATIVE, max_tokens=6))})["a"][
        -1
    ].outputs[0]
    assert final.text == finished.text  # decoded whole, less an incomplete final character
    assert finished.text.startswith(streamed.text)  # a stream keeps back what it never sent


def test_llm_generate_runs_final_only_and_leaves_the_callers_params_alone(tiny_llama, tiny_llama_dir):
    llm = LLM(str(tiny_llama_dir), **ARGS)
    mine = params(CUMULATIVE)
    generated = llm.generate(PROMPTS, mine, use_tqdm=False)
    assert mine.output_kind is CUMULATIVE
    assert all(r.request_id.startswith("offline-") for r in generated)
    reference = stream(make(tiny_llama), {f"r{i}": (p, params(CUMULATIVE)) for i, p in enumerate(PROMPTS)})
    for i, output in enumerate(generated):
        assert final_texts([output]) == final_texts(reference[f"r{i}"])


def test_plain_greedy_rows_pick_the_tokens_of_the_full_sampling_path(tiny_llama):
    """Plain greedy rows skip building sampling inputs; asking for logprobs takes the full path."""
    plain = run_requests(make(tiny_llama), {f"r{i}": (p, params(FINAL_ONLY)) for i, p in enumerate(PROMPTS)})
    mixed = {f"r{i}": (p, params(FINAL_ONLY, logprobs=0 if i == 1 else None)) for i, p in enumerate(PROMPTS)}
    full = run_requests(make(tiny_llama), mixed)
    for request_id, output in plain.items():
        assert output.outputs[0].token_ids == full[request_id].outputs[0].token_ids


def test_max_tokens_none_generates_until_the_context_is_full(tiny_llama):
    output = run_requests(make(tiny_llama), {"a": ([1, 2, 3], params(FINAL_ONLY, max_tokens=None))})[
        "a"
    ].outputs[0]
    assert (len(output.token_ids), output.finish_reason) == (ARGS["max_model_len"] - 3, "length")
