"""PoolingEngine: a decoder model run as an embedding model (vLLM's `--runner pooling --convert embed`).

The generation engine's loading, KV sizing, block manager and scheduler (chunked prefill under the token budget,
preemption), with the pooling runner's step: each scheduled prompt chunk comes back pooled (runner/pooling.py),
its request's PooledPrompt adds it up (core/pooling.py), and a request whose prompt is all computed finishes in
that step with its embedding, its blocks freed. Nothing is sampled and nothing decodes. A pooling engine serves
only pooling requests; prefix caching is off (a chunk must never start past tokens it has not pooled), and so is
async scheduling (every step's results finish requests)."""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Callable, Sequence

import numpy as np

from jpaged.config import EngineConfig
from jpaged.core.pooling import PooledPrompt
from jpaged.core.sequence import Request
from jpaged.engine.llm_engine import LLMEngine
from jpaged.lora_request import LoRARequest
from jpaged.models.loader import LoadedModel
from jpaged.models.sentence_transformers_config import PoolerConfig, pooler_config_for
from jpaged.pooling_params import EmbeddingOutput, EmbeddingRequestOutput, PoolingParams
from jpaged.runner.pooling_runner import PoolingRunner
from jpaged.runner.step_batch import StepSchedule
from jpaged.sampling_params import SamplingParams

# What a pooling request's sequence carries as sampling params: the scheduler reads n (one sequence) and the
# engine max_tokens (room for nothing past the prompt); nothing is sampled.
_NO_SAMPLING = SamplingParams(max_tokens=1)


def engine_for(config: EngineConfig, model: LoadedModel | None = None) -> LLMEngine:
    """The engine `config` asks for: a PoolingEngine for runner 'pooling' / convert 'embed', else an LLMEngine."""
    return (PoolingEngine if config.is_pooling else LLMEngine)(config, model=model)


class PoolingEngine(LLMEngine):
    """`add_request(id, prompt, PoolingParams)`, then `step()` until `has_unfinished()` is False; each request's
    one output (an EmbeddingRequestOutput) comes from the step that computes its prompt's last token."""

    pooler: PoolerConfig

    def __init__(
        self, config: EngineConfig | None = None, *, model: LoadedModel | None = None, **engine_args
    ):
        config = config or EngineConfig(**engine_args)
        config = dataclasses.replace(
            config, runner="pooling", convert="embed", enable_prefix_caching=False, async_scheduling=False
        )
        self._pooled: dict[str, tuple[PooledPrompt, PoolingParams]] = {}
        super().__init__(config, model=model)

    def _runner_class(self) -> Callable[..., PoolingRunner]:
        source = self.model.source
        self.pooler = pooler_config_for(source.path if source.kind == "hf" else None)
        return functools.partial(PoolingRunner, pooling=self.pooler.pooling_type)

    # ---- requests ----

    def add_request(
        self,
        request_id: str,
        prompt: str | Sequence[int],
        params: PoolingParams | None = None,
        *,
        priority: int = 0,
        cache_salt: str | None = None,
        lora_request: LoRARequest | None = None,
    ) -> Request:
        """Queue a pooling request (a str is tokenised with the tokenizer's special tokens, as vLLM's embedding
        requests are). ValueError for sampling params or an adapter: this engine serves embeddings only."""
        del cache_salt  # no prefix caching here
        if lora_request is not None:
            raise ValueError(
                "lora_request: a pooling model serves no LoRA adapters (enable_lora is generation's)"
            )
        params = params or PoolingParams()
        if not isinstance(params, PoolingParams):
            raise ValueError(
                "this engine runs a pooling model (runner 'pooling'): it serves embeddings only, "
                f"not generation ({type(params).__name__})"
            )
        text, token_ids = self._new_prompt(request_id, prompt, add_special_tokens=True)
        token_ids = self.check_request(token_ids, params)
        request = Request(request_id, text, token_ids, _NO_SAMPLING, 0, time.time(), priority)
        seq = self._new_seq(request, list(token_ids), index=0)
        self._pooled[request_id] = (PooledPrompt(self.pooler.pooling_type, len(token_ids)), params)
        self.scheduler.add(seq)
        self.requests[request_id] = request
        return request

    def check_request(self, token_ids: list[int], params: PoolingParams) -> list[int]:
        """The prompt as it will run (its last truncate_prompt_tokens tokens; -1: the last max_model_len), checked
        with the params against this model: a ValueError naming what is wrong (for a server to check every input
        before it queues any)."""
        keep = params.truncate_prompt_tokens
        if keep is not None:
            token_ids = token_ids[-(self.max_model_len if keep == -1 else keep) :]
        self._check_prompt(token_ids)
        self.pooler.check_dimensions(params.dimensions, self.model_config.hidden_size)
        return token_ids

    def _check_prompt(self, token_ids: list[int]) -> None:
        if not token_ids:
            raise ValueError("prompt is empty: it must hold at least one token")
        if len(token_ids) > self.max_model_len:
            raise ValueError(
                f"prompt is {len(token_ids)} tokens long, but max_model_len is {self.max_model_len} "
                "(truncate_prompt_tokens keeps its last tokens)"
            )
        vocab_size = self.model_config.vocab_size
        bad = [t for t in token_ids if not 0 <= t < vocab_size]
        if bad:
            raise ValueError(f"prompt token ids {bad[:5]} are outside the vocabulary [0, {vocab_size})")

    def abort_request(self, request_id: str) -> None:
        """Stop a request now, its blocks freed; it has no output (an embedding is all or nothing)."""
        request = self.requests.pop(request_id, None)
        self._pooled.pop(request_id, None)
        if request is not None:
            for seq in request.seqs:
                self.scheduler.finish(seq)

    # ---- the loop ----

    def step(self) -> list[EmbeddingRequestOutput]:
        """Run one step of prompt chunks; returns the outputs of the requests whose prompts it finished."""
        outputs, self._held = self._held, []
        plan = self.scheduler.schedule()
        self.runner.swap(plan.swap_out, plan.swap_in)
        self.runner.copy_blocks(plan.copies)  # none: nothing forks, no prefix is shared
        seqs, num_new_tokens = plan.seqs, plan.num_new_tokens
        if not seqs:
            return outputs
        schedule = StepSchedule(
            [seq.token_ids for seq in seqs],
            [seq.num_computed_tokens for seq in seqs],
            num_new_tokens,
            self.blocks.block_tables([seq.seq_id for seq in seqs]),
            sample_rows=[],
            pending_rows=[-1] * len(seqs),
        )
        pooled = np.asarray(self.runner.pool(self.runner.prepare(schedule)))
        now = time.time()
        for seq, num_new, chunk in zip(seqs, num_new_tokens, pooled, strict=False):
            request = seq.request
            state, params = self._pooled[request.request_id]
            state.add_chunk(seq.num_computed_tokens, num_new, chunk)
            seq.num_computed_tokens += num_new
            if not state.done:
                continue
            self.scheduler.finish(seq)
            seq.finish_reason = "stop"
            self.counters.prompt_tokens += state.num_tokens
            normalize = self.pooler.normalize if params.normalize is None else params.normalize
            vector = state.vector(params.dimensions, normalize)
            output = EmbeddingRequestOutput(
                request.request_id,
                EmbeddingOutput(vector.tolist()),
                request.prompt_token_ids,
                prompt=request.prompt,
                metrics={"arrival_time": request.arrival_time, "finished_time": now},
            )
            outputs.append(output)
            del self.requests[request.request_id], self._pooled[request.request_id]
        return outputs
