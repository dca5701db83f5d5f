"""The async front: concurrent streams, validation before queueing, aborts that end the stream and free blocks."""

from __future__ import annotations

import asyncio
import contextlib
import time

import pytest
from engine_gate import EngineGate, wait_until

from jpaged.config import EngineConfig
from jpaged.engine.async_engine import AsyncLLMEngine
from jpaged.engine.llm_engine import LLMEngine
from jpaged.sampling_params import SamplingParams

LONG = SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True)


def small_config(tiny_model_dir, **overrides) -> EngineConfig:
    args = dict(max_model_len=256, max_num_seqs=8, max_num_batched_tokens=64, num_blocks=64)
    return EngineConfig(model=str(tiny_model_dir("llama")), **{**args, **overrides})


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    async_engine = AsyncLLMEngine(LLMEngine(small_config(tiny_model_dir, enforce_eager=True)))
    yield async_engine
    async_engine.shutdown(timeout=5)


async def collect(engine, request_id, prompt, params):
    return [o async for o in engine.generate(prompt, params, request_id)]


def test_concurrent_requests_each_stream_to_their_end(engine):
    async def main():
        params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
        return await asyncio.gather(*(collect(engine, f"c{i}", [1, 2, 3 + i], params) for i in range(4)))

    for outputs in asyncio.run(main()):
        assert outputs[-1].finished and not any(o.finished for o in outputs[:-1])
        assert len(outputs[-1].outputs[0].token_ids) == 8


def test_invalid_prompt_raises_before_anything_is_queued(engine):
    async def main():
        await collect(engine, "bad", [1] * 300, LONG)

    with pytest.raises(ValueError, match="max_model_len is 256"):
        asyncio.run(main())
    assert engine.num_unfinished == 0


def test_abort_from_outside_ends_the_stream_and_frees_blocks(engine):
    async def main(gate: EngineGate):
        stream = engine.generate([5, 6, 7], LONG, "victim")
        first = await anext(stream)
        engine.abort("victim")
        gate.release()
        rest = [o async for o in stream]
        return first, rest

    with EngineGate(engine, steps=1) as gate:  # the request cannot finish before the abort, on any machine
        first, rest = asyncio.run(main(gate))
    assert not first.finished
    assert rest[-1].finished and rest[-1].outputs[0].finish_reason == "abort"
    assert len(rest[-1].outputs[0].token_ids) < 200
    assert engine.metrics()["kv_cache_usage_perc"] == 0.0


def test_a_consumer_that_stops_early_aborts_its_request(engine):
    async def main():
        stream = engine.generate([9, 9, 9], LONG, "leaver")
        await anext(stream)
        await stream.aclose()  # what a client disconnect does to the server's consumer

    with EngineGate(engine, steps=1) as gate:  # still running when its consumer stops, on any machine
        asyncio.run(main())
        assert gate.wait_for_aborts(1) == ["leaver"]
    wait_until(lambda: engine.metrics()["kv_cache_usage_perc"] == 0.0, message="its blocks were not freed")


def test_a_consumer_cancelled_while_its_request_is_being_added_aborts_it_once_it_is_in(engine):
    """Adding waits for the engine lock (a step in progress): a client can leave before its request is in."""

    async def main(gate: EngineGate):
        consumer = asyncio.ensure_future(anext(engine.generate([3, 3, 3], LONG, "early")))
        with engine._lock:  # what a running step does to the thread adding the request
            await asyncio.sleep(0)  # the consumer now waits for its request to be added
            consumer.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await consumer
        return await asyncio.to_thread(gate.wait_for_aborts, 1)

    with EngineGate(engine) as gate:  # nothing runs before the abort, on any machine
        assert asyncio.run(main(gate)) == ["early"]
    wait_until(lambda: engine.num_unfinished == 0, message="the request was never aborted")
    wait_until(lambda: engine.metrics()["kv_cache_usage_perc"] == 0.0, message="its blocks were not freed")


def test_a_request_whose_event_loop_closed_is_aborted_and_the_engine_loop_lives_on(engine):
    """What a server's shutdown does to a stream it never finished reading: the loop closes under it."""
    with EngineGate(engine, steps=1) as gate:  # still running when its loop closes, on any machine
        loop = asyncio.new_event_loop()
        stream = engine.generate([4, 4, 4], LONG, "orphan")
        loop.run_until_complete(anext(stream))
        loop.close()
        gate.release()
        assert gate.wait_for_aborts(1) == ["orphan"]  # by the engine loop, which had nowhere to deliver
    wait_until(lambda: engine.metrics()["kv_cache_usage_perc"] == 0.0, message="its blocks were not freed")
    assert engine.is_alive and engine.num_unfinished == 0


def test_an_idle_loop_gives_every_warm_up_shape_its_first_run(tiny_model_dir):
    engine = LLMEngine(small_config(tiny_model_dir))
    assert engine.runner.num_unrun_shapes > 0  # the prefill-sized shapes wait for idle time
    async_engine = AsyncLLMEngine(engine)
    try:
        deadline = time.monotonic() + 120
        while engine.runner.num_unrun_shapes and time.monotonic() < deadline:
            time.sleep(0.05)
        assert engine.runner.num_unrun_shapes == 0
        params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
        outputs = asyncio.run(collect(async_engine, "after", [1, 2, 3], params))
        assert outputs[-1].finished and len(outputs[-1].outputs[0].token_ids) == 4
        # each step shape's forward, each row count's sampling (one history width here: max_model_len 256),
        # each token size's prompt-logprobs program, each copy size's block copies
        shapes = engine.runner.shapes
        row_counts = {s for _, s in shapes.all_shapes()}
        expected = len(shapes.all_shapes()) + len(row_counts) + len(shapes.token_sizes)
        expected += len(engine.runner.shapes.copy_sizes)
        assert engine.runner.sampling_widths.history_widths == (engine.config.max_model_len,)
        assert engine.metrics()["num_compilations"] == expected
    finally:
        async_engine.shutdown(timeout=5)
