"""Beam search: the selection rules (pure), equality with transformers, shared blocks, lockstep beams, the API."""

from __future__ import annotations

import math
import re

import httpx
import pytest
from conftest import TINY, hf_model
from engine_driver import run_requests
from jpaged_server.api_server import build_app
from server_harness import serve_in_thread

from jpaged.config import EngineConfig
from jpaged.core.beam_search import BeamSearch
from jpaged.engine.async_engine import AsyncLLMEngine
from jpaged.engine.llm_engine import LLMEngine
from jpaged.entrypoints.llm import LLM
from jpaged.models.loader import load_model
from jpaged.sampling_params import BeamSearchParams, SamplingParams, StructuredOutputsParams
from jpaged.structured import allocate_bitmask, allowed_tokens, shared_compiler

EOS = 9


def search(width: int, *, max_tokens: int = 10, length_penalty: float = 1.0, eos=(EOS,)) -> BeamSearch:
    return BeamSearch.start(BeamSearchParams(width, max_tokens, length_penalty), eos, max_tokens)


# ---- the selection rules ----


def test_best_continuations_over_all_beams_survive_and_a_beam_can_take_every_slot():
    s = search(2)
    assert s.step([[(5, -0.1), (6, -1.0), (7, -2.0), (8, -3.0)]]) == [0, 0]  # both extend the prompt
    assert [(b.token_ids, b.cumulative_logprob) for b in s.beams] == [([5], -0.1), ([6], -1.0)]
    parents = s.step(
        [[(1, -3.0), (2, -4.0), (3, -5.0), (4, -6.0)], [(3, -0.5), (4, -0.6), (1, -7.0), (2, -8.0)]]
    )
    assert parents == [1, 1]  # beam [5] is dropped, beam [6] continues twice
    assert [b.token_ids for b in s.beams] == [[6, 3], [6, 4]]
    assert [b.cumulative_logprob for b in s.beams] == pytest.approx([-1.5, -1.6])


def test_eos_among_the_top_width_becomes_a_hypothesis_scored_with_the_length_penalty():
    s = search(2, length_penalty=2.0)
    s.step([[(5, -0.2), (6, -0.3), (7, -3.0), (8, -4.0)]])
    s.step([[(EOS, -0.5), (5, -0.6), (6, -0.7), (7, -3.0)], [(5, -2.0), (6, -2.1), (7, -3.0), (8, -4.0)]])
    (hypothesis,) = s.hypotheses
    assert hypothesis.token_ids == [5, EOS] and hypothesis.ended_on_eos
    assert hypothesis.score == pytest.approx(-0.7 / 2**2.0)  # the EOS counts in the length
    assert [b.token_ids for b in s.beams] == [[5, 5], [5, 6]]  # the EOS took no live slot


def test_eos_ranked_below_the_width_is_dropped():
    s = search(2)
    assert s.step([[(5, -0.1), (6, -0.2), (EOS, -0.3), (7, -0.4)]]) == [0, 0]
    assert s.hypotheses == [] and [b.token_ids for b in s.beams] == [[5], [6]]


@pytest.mark.parametrize(("eos_logprob", "done"), [(-0.1, True), (-0.3, False)])
def test_stops_once_the_best_live_beam_cannot_beat_the_worst_kept_hypothesis(eos_logprob, done):
    s = search(1)
    s.step([[(EOS, eos_logprob), (5, -0.2)]])
    assert s.done is done
    assert s.beams == [] if done else [b.token_ids for b in s.beams] == [[5]]


def test_a_token_its_grammar_does_not_allow_is_never_taken_even_when_too_few_remain():
    s = search(3)
    assert s.step([[(5, -0.1), (6, -2.0), (7, -math.inf), (8, -math.inf)]]) == [0, 0]  # two allowed tokens
    assert [b.token_ids for b in s.beams] == [[5], [6]]


def test_max_tokens_turns_the_top_width_into_hypotheses_and_ends():
    s = search(2, max_tokens=1)
    assert s.step([[(5, -0.1), (6, -0.2), (7, -0.3), (8, -0.4)]]) == []
    assert s.done and [(h.token_ids, h.ended_on_eos) for h in s.hypotheses] == [([5], False), ([6], False)]
    with pytest.raises(ValueError, match="done"):
        s.step([])


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        (dict(beam_width=0), "beam_width"),
        (dict(beam_width=2, max_tokens=0), "max_tokens"),
        (dict(beam_width=2, length_penalty=math.nan), "length_penalty"),
        (dict(beam_width=2, ignore_eos=1), "ignore_eos"),
        (dict(beam_width=2, structured_outputs={"regex": "a"}), "structured_outputs"),
        (
            dict(beam_width=2, ignore_eos=True, structured_outputs=StructuredOutputsParams(regex="a")),
            "ignore_eos",
        ),
    ],
)
def test_bad_parameters_raise_naming_the_field(kwargs, field):
    with pytest.raises(ValueError, match=f"^{field}"):
        BeamSearchParams(**kwargs)


def test_beam_width_is_capped_by_the_logprobs_a_step_returns():
    with pytest.raises(ValueError, match="^beam_width must be at most 6"):
        BeamSearch.start(BeamSearchParams(7), eos_token_ids=(1, 2), max_tokens=16)  # 3 x 7 candidates > 20
    assert BeamSearch.start(BeamSearchParams(7, ignore_eos=True), (1, 2), 16).num_candidates == 14


# ---- against transformers, on a tiny model whose logits are not flat ----

PROMPT = [
    504,
    2365,
    6354,
    16438,
    27003,
    690,
    260,
    23790,
    2767,
]  # "The quick brown fox jumps over the lazy dog"
WIDTH, MAX_TOKENS = 3, 8
ENGINE_ARGS = dict(
    max_num_seqs=8, max_num_batched_tokens=64, max_model_len=128, num_blocks=64, enforce_eager=True
)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, default_tokenizer):
    """A tiny Llama with its LM head scaled up (top-2 gaps of tenths of a nat, not of 1e-4, so rounding cannot
    reorder beams), whose EOS is the third token of the EOS-free best beam: EOS-ended hypotheses really occur."""
    import torch
    import transformers

    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(
        transformers.LlamaConfig(**TINY), dtype=torch.float32
    )
    with torch.no_grad():
        model.lm_head.weight.mul_(30.0)
    model.generation_config.eos_token_id = None
    best = model.generate(torch.tensor([PROMPT]), num_beams=WIDTH, max_new_tokens=MAX_TOKENS, do_sample=False)
    eos = int(best[0, len(PROMPT) + 2])
    model.config.eos_token_id = model.generation_config.eos_token_id = eos
    path = tmp_path_factory.mktemp("beam_model") / "llama"
    model.save_pretrained(path)
    default_tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def loaded(model_dir):
    return load_model(str(model_dir), progress=False)


@pytest.fixture(scope="module")
def engine(loaded):
    return LLMEngine(EngineConfig(**ENGINE_ARGS), model=loaded)


def hf_beams(
    model_dir, eos: list[int] | None, length_penalty: float, prefix_allowed_tokens_fn=None
) -> list[tuple[list[int], float]]:
    """transformers' best WIDTH beams (early_stopping=False), cut after their EOS, with their scores."""
    import torch

    out = hf_model(model_dir).generate(
        torch.tensor([PROMPT]),
        prefix_allowed_tokens_fn=prefix_allowed_tokens_fn,
        num_beams=WIDTH,
        num_return_sequences=WIDTH,
        max_new_tokens=MAX_TOKENS,
        do_sample=False,
        early_stopping=False,
        length_penalty=length_penalty,
        eos_token_id=eos,
        pad_token_id=0,
        output_scores=True,
        return_dict_in_generate=True,
    )
    beams = []
    for tokens, score in zip(
        out.sequences[:, len(PROMPT) :].tolist(), out.sequences_scores.tolist(), strict=True
    ):
        ends = [i for i, t in enumerate(tokens) if t in (eos or ())]
        beams.append((tokens[: ends[0] + 1] if ends else tokens, score))
    return beams


def assert_same_beams(output, reference, length_penalty):
    assert [o.token_ids for o in output.outputs] == [tokens for tokens, _ in reference]
    scores = [o.cumulative_logprob / len(o.token_ids) ** length_penalty for o in output.outputs]
    assert scores == pytest.approx([score for _, score in reference], abs=1e-4)


def test_beams_equal_transformers_when_eos_is_ignored(engine, model_dir):
    params = BeamSearchParams(WIDTH, MAX_TOKENS, ignore_eos=True)
    output = run_requests(engine, {"a": (PROMPT, params)})["a"]
    reference = hf_beams(model_dir, None, 1.0)
    assert_same_beams(output, reference, 1.0)
    # Beams that share a first token: some beam was dropped and another forked after the first step.
    assert len({o.token_ids[0] for o in output.outputs}) < WIDTH
    assert engine.model_config.eos_token_ids[0] in output.outputs[0].token_ids  # an ignored EOS, mid-beam
    assert all(o.finish_reason == "length" for o in output.outputs)


@pytest.mark.parametrize("length_penalty", [0.0, 1.0, 2.0])
def test_beams_ending_on_eos_equal_transformers_with_the_length_penalty(engine, model_dir, length_penalty):
    params = BeamSearchParams(WIDTH, MAX_TOKENS, length_penalty)
    output = run_requests(engine, {"a": (PROMPT, params)})["a"]
    assert_same_beams(
        output, hf_beams(model_dir, list(engine.model_config.eos_token_ids), length_penalty), length_penalty
    )
    # Unpenalised, the short beam that ended on EOS wins; a length penalty of 1 or more prefers the long ones.
    assert (output.outputs[0].finish_reason == "stop") is (length_penalty == 0.0)


# ---- under a grammar ----


def grammar_allowed_tokens(engine, spec: StructuredOutputsParams):
    """transformers' prefix_allowed_tokens_fn for `spec`: what a fresh matcher fed the beam's tokens allows."""
    config = engine.model_config
    compiled = shared_compiler(engine.tokenizer, config.vocab_size, tuple(config.eos_token_ids)).compile(spec)

    def allowed(batch_id: int, input_ids) -> list[int]:
        matcher = compiled.matcher()
        for token in input_ids[len(PROMPT) :].tolist():
            assert matcher.accept_token(token)
        row = allocate_bitmask(1, config.vocab_size)[0]
        matcher.fill_bitmask(row)
        return allowed_tokens(row, config.vocab_size).nonzero()[0].tolist()

    return allowed


def text_before_eos(engine, beam) -> str:
    """The beam's text without its EOS (this tiny model's EOS is an ordinary token, decoded as text)."""
    ended = beam.token_ids[-1] in engine.model_config.eos_token_ids
    return engine.tokenizer.decode(beam.token_ids[:-1] if ended else beam.token_ids)


def test_beams_under_a_grammar_equal_transformers_constrained_beam_search(engine, model_dir):
    """Each beam proposes its best allowed tokens, where free text would have taken others."""
    spec = StructuredOutputsParams(regex=r"[a-z ]+")
    output = run_requests(
        engine, {"a": (PROMPT, BeamSearchParams(WIDTH, MAX_TOKENS, structured_outputs=spec))}
    )
    reference = hf_beams(
        model_dir, list(engine.model_config.eos_token_ids), 1.0, grammar_allowed_tokens(engine, spec)
    )
    assert_same_beams(output["a"], reference, 1.0)
    free = run_requests(engine, {"b": (PROMPT, BeamSearchParams(WIDTH, MAX_TOKENS))})["b"]
    assert [o.token_ids for o in free.outputs] != [o.token_ids for o in output["a"].outputs]
    for beam in output["a"].outputs:
        assert re.fullmatch(r"[a-z ]+", text_before_eos(engine, beam))


def test_beams_under_a_choice_end_on_eos_once_complete_and_free_every_block(engine):
    choices = ["yes", "no", "maybe"]
    params = BeamSearchParams(WIDTH, MAX_TOKENS, structured_outputs=StructuredOutputsParams(choice=choices))
    output = run_requests(engine, {"a": (PROMPT, params)})["a"]
    assert 1 <= len(output.outputs) <= WIDTH
    for beam in output.outputs:
        assert beam.finish_reason == "stop" and beam.token_ids[-1] in engine.model_config.eos_token_ids
        assert text_before_eos(engine, beam) in choices
    engine.reset_prefix_cache()
    assert engine.blocks.num_free_blocks == engine.blocks.num_total_blocks


def test_beams_share_the_prompt_blocks_and_dropped_beams_free_theirs_at_once(loaded):
    engine = LLMEngine(EngineConfig(**ENGINE_ARGS), model=loaded)
    prompt = (PROMPT * 12)[:100]  # 6 full blocks and a partial one
    engine.add_request("a", prompt, BeamSearchParams(4, 12, ignore_eos=True))
    request = engine.requests["a"]
    while engine.has_unfinished():
        engine.step()
        tables = [engine.blocks.block_table(seq.seq_id) for seq in request.seqs]
        held = [b for table in tables for b in table]
        # Every referenced block belongs to a live beam, as often as beams hold it: nothing of a dropped beam.
        assert engine.blocks.num_total_blocks - engine.blocks.num_free_blocks == len(set(held))
        assert all(engine.blocks.pool.refcount(b) == held.count(b) for b in held)
        if len(tables) > 1:
            assert all(table[:6] == tables[0][:6] for table in tables)  # the full prompt blocks, once
            assert len(set(held)) <= 6 + 4 * 2  # each beam: its copy of the partial block, maybe one more
    assert engine.blocks.num_free_blocks == engine.blocks.num_total_blocks


@pytest.mark.parametrize(
    "overrides",
    [
        dict(max_num_batched_tokens=16, max_num_seqs=16),  # chunked neighbours split the token budget
        dict(num_blocks=12, max_model_len=96),  # a beam is preempted while its siblings run
    ],
    ids=["split_budget", "preempted"],
)
def test_beam_search_among_other_requests_gives_the_solo_beams(loaded, engine, overrides):
    params = BeamSearchParams(WIDTH, MAX_TOKENS)
    solo = run_requests(engine, {"beam": (PROMPT, params)})["beam"]
    busy = LLMEngine(EngineConfig(**{**ENGINE_ARGS, **overrides}), model=loaded)
    others = [
        ((PROMPT * 6)[i : 40 + i], SamplingParams(max_tokens=8, seed=i, ignore_eos=True)) for i in range(4)
    ]
    requests = {"o0": others[0], "o1": others[1], "beam": (PROMPT, params), "o2": others[2], "o3": others[3]}
    outputs = run_requests(busy, requests)
    assert [o.token_ids for o in outputs["beam"].outputs] == [o.token_ids for o in solo.outputs]
    if "num_blocks" in overrides:
        assert busy.scheduler.num_preemptions > 0
    busy.reset_prefix_cache()
    assert busy.blocks.num_free_blocks == busy.blocks.num_total_blocks


def test_a_beam_search_the_block_pool_cannot_hold_is_refused_up_front(engine):
    with pytest.raises(ValueError, match="^beam_width=8 beams .* need 64 KV blocks"):
        engine.add_request("huge", PROMPT, BeamSearchParams(8, 110, ignore_eos=True))  # 8 x 8 blocks > 63
    assert not engine.has_unfinished()


def test_more_beams_than_max_num_seqs_are_refused_up_front(engine):
    """The beams advance together, so they must fit in one step; queued, such a search would wait forever."""
    with pytest.raises(ValueError, match=r"^beam_width must be at most max_num_seqs \(8\).* got 9"):
        engine.add_request("wide", PROMPT, BeamSearchParams(9, 4, ignore_eos=True))
    assert not engine.has_unfinished()


def test_llm_beam_search_returns_the_beams_best_first(model_dir):
    llm = LLM(str(model_dir), **ENGINE_ARGS)
    (output,) = llm.beam_search([PROMPT], beam_width=2, max_tokens=4, ignore_eos=True)
    assert [o.index for o in output.outputs] == [0, 1]
    assert output.outputs[0].cumulative_logprob >= output.outputs[1].cumulative_logprob
    assert output.outputs[0].text == llm.tokenizer.decode(
        output.outputs[0].token_ids, skip_special_tokens=True
    )


# ---- the OpenAI API ----


def test_completions_with_use_beam_search_return_every_beam_as_a_choice(loaded, engine):
    reference = run_requests(engine, {"r": (PROMPT, BeamSearchParams(WIDTH, MAX_TOKENS, 2.0))})["r"]
    server_engine = AsyncLLMEngine(LLMEngine(EngineConfig(**ENGINE_ARGS), model=loaded))
    try:
        with (
            serve_in_thread(build_app(server_engine, "tiny")) as server,
            httpx.Client(base_url=server.base_url, timeout=60) as http,
        ):
            body = dict(
                prompt=PROMPT, use_beam_search=True, n=WIDTH, max_tokens=MAX_TOKENS, length_penalty=2.0
            )
            choices = http.post("/v1/completions", json=body).json()["choices"]
            assert [c["index"] for c in choices] == list(range(WIDTH))
            assert [c["text"] for c in choices] == [o.text for o in reference.outputs]
            assert [c["finish_reason"] for c in choices] == [o.finish_reason for o in reference.outputs]
            refused = http.post("/v1/completions", json={**body, "top_p": 0.5})
            assert refused.status_code == 400 and refused.json()["error"]["param"] == "top_p"
            too_wide = http.post("/v1/completions", json={**body, "n": 11})
            assert too_wide.status_code == 400 and too_wide.json()["error"]["param"] == "n"
            regex = {"structured_outputs": {"regex": "[a-z ]+"}}
            constrained = http.post("/v1/completions", json={**body, **regex}).json()["choices"]
            assert len(constrained) == WIDTH
            assert all(re.fullmatch("[a-z ]+", c["text"]) for c in constrained)
            bad = http.post("/v1/completions", json={**body, "structured_outputs": {"regex": "("}})
            assert bad.status_code == 400 and bad.json()["error"]["param"] == "structured_outputs"
    finally:
        server_engine.shutdown(timeout=5)
