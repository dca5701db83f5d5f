"""Driving an LLMEngine by hand in tests: add requests, step until done, collect the final outputs."""

from __future__ import annotations

from jpaged.engine.llm_engine import LLMEngine
from jpaged.outputs import RequestOutput


def run_requests(engine: LLMEngine, requests: dict[str, tuple[object, object]]) -> dict[str, RequestOutput]:
    """`requests` maps request id -> (prompt, params); returns each request's finished output."""
    for request_id, (prompt, params) in requests.items():
        engine.add_request(request_id, prompt, params)
    done = {}
    while engine.has_unfinished():
        for output in engine.step():
            if output.finished:
                done[output.request_id] = output
    return done
