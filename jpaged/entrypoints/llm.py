"""The offline Python API: `LLM(...).generate(...)`, `LLM.chat(...)` and the one-call `jpaged.generate(...)`."""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Sequence
from pathlib import Path

from tqdm.auto import tqdm

from jpaged.config import EngineConfig
from jpaged.engine.pooling_engine import engine_for
from jpaged.engine.tokenizer import apply_chat_template
from jpaged.entrypoints.arrays import GeneratedArrays, pack_outputs, prompt_rows
from jpaged.entrypoints.prompts import EnginePrompt, PromptType, as_prompt_list
from jpaged.lora_request import LoRARequest
from jpaged.models.config import ModelConfig
from jpaged.models.llama import CausalLM, as_params
from jpaged.models.loader import LoadedModel, ModelSource
from jpaged.outputs import RequestOutput
from jpaged.pooling_params import EmbeddingRequestOutput, PoolingParams
from jpaged.sampling_params import (
    BeamSearchParams,
    RequestOutputKind,
    SamplingParams,
    StructuredOutputsParams,
)


class LLM:
    """An engine for offline batches: every prompt goes in at once and continuous batching does the rest."""

    def __init__(
        self, model: str | None = None, *, _loaded: LoadedModel | None = None, **engine_args
    ) -> None:
        self.engine = engine_for(EngineConfig(model=model, **engine_args), model=_loaded)
        self._ids = itertools.count()

    @classmethod
    def from_params(cls, params: dict, model_config: ModelConfig, tokenizer, **engine_args) -> LLM:
        """An engine over weights already in memory (a CausalLM state dict of host or device arrays, e.g. a
        trainer's), with nothing written to disk."""
        loaded = LoadedModel(model_config, params, tokenizer, ModelSource("params", Path()), 0.0)
        return cls(_loaded=loaded, **engine_args)

    @classmethod
    def from_flax(cls, module: CausalLM, tokenizer, **engine_args) -> LLM:
        """An engine over a user's own `jpaged.models.llama.CausalLM` (its weights as they are, not copied)."""
        if not isinstance(module, CausalLM):
            raise ValueError(
                f"module must be a jpaged.models.llama.CausalLM, got {type(module).__name__}: build the model "
                "with CausalLM(config) or pass its state dict to LLM.from_params"
            )
        return cls.from_params(as_params(module), module.config, tokenizer, **engine_args)

    def update_weights(self, weights) -> None:
        """Swap the weights in place between generate calls (a CausalLM, its nnx.State or its state dict); see
        LLMEngine.update_weights."""
        self.engine.update_weights(weights)

    def add_lora(self, lora_request: LoRARequest, weights=None) -> bool:
        """Register an adapter ahead of its first request (LLMEngine.add_lora): from its PEFT directory, or given
        as `weights` in the engine's own layout (a trainer's, with no file)."""
        return self.engine.add_lora(lora_request, weights)

    def update_lora(self, name: str, weights) -> None:
        """Swap LoRA adapter `name`'s matrices in place between generate calls (PEFT-named arrays of its shapes,
        e.g. `peft.get_peft_model_state_dict` of a trainer's model, or arrays in the engine's own layout, a JAX
        trainer's: models/lora_weights.adapter_from_layout): nothing recompiles. See LLMEngine.update_lora."""
        self.engine.update_lora(name, weights)

    def sleep(self, level: int = 1) -> None:
        """Give the device memory back between generate calls; see LLMEngine.sleep."""
        self.engine.sleep(level)

    def wake_up(self) -> None:
        self.engine.wake_up()

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool = True,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Outputs in the order of `prompts`: a str, token ids, vLLM's {"prompt": str} or
        {"prompt_token_ids": [...]}, a list mixing them, or a [B, T] token array (see prompts.py); each through
        `lora_request`'s adapter, or its own where it is a list (None: the base model).

        Only final outputs are read, so every request runs as FINAL_ONLY (on a copy of its params)."""
        prompts = as_prompt_list(prompts)
        if lora_request is None or isinstance(lora_request, LoRARequest):
            loras = [lora_request] * len(prompts)
        else:
            loras = list(lora_request)
            if len(loras) != len(prompts):
                raise ValueError(f"lora_request has {len(loras)} entries for {len(prompts)} prompts")
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params = [_final_only(sampling_params or SamplingParams())] * len(prompts)
        else:
            params = list(sampling_params)
            if len(params) != len(prompts):
                raise ValueError(f"sampling_params has {len(params)} entries for {len(prompts)} prompts")
            finals: dict[int, SamplingParams] = {}  # one copy per distinct params object
            for p in params:
                if id(p) not in finals:
                    finals[id(p)] = _final_only(p)
            params = [finals[id(p)] for p in params]
        return self._add_and_run(prompts, params, use_tqdm, loras)

    def generate_arrays(
        self,
        token_ids,
        lengths=None,
        sampling_params: SamplingParams | None = None,
        *,
        return_logprobs: bool = False,
        pad_token_id: int = 0,
        lora_request: LoRARequest | None = None,
    ) -> GeneratedArrays:
        """`generate` with arrays in and out: prompts from a `[B, T]` array (row i's first `lengths[i]` tokens)
        or a list of 1-D arrays; outputs as padded `[B, max_tokens]` device arrays, with the sampled tokens'
        logprobs (of the raw logits, as vLLM's) when `return_logprobs`."""
        params = sampling_params or SamplingParams()
        if params.n != 1:
            raise ValueError(f"n must be 1 for generate_arrays (one output row per prompt), got {params.n}")
        if params.max_tokens is None:
            raise ValueError("max_tokens must be set for generate_arrays: it is the outputs' width")
        if return_logprobs and params.logprobs is None:
            params = params.clone()
            params.logprobs = 0  # the sampled token's own logprob
        outputs = self.generate(
            prompt_rows(token_ids, lengths), params, use_tqdm=False, lora_request=lora_request
        )
        return pack_outputs(outputs, params.max_tokens, pad_token_id, return_logprobs)

    def beam_search(
        self,
        prompts: PromptType | Sequence[PromptType],
        beam_width: int,
        max_tokens: int,
        length_penalty: float = 1.0,
        ignore_eos: bool = False,
        *,
        structured_outputs: StructuredOutputsParams | None = None,
        use_tqdm: bool = False,
    ) -> list[RequestOutput]:
        """Per prompt, its beam_width best beams, best first, as the outputs (token ids with the EOS if one ended
        it, text, cumulative logprob) of one RequestOutput. Scored as transformers' beam search with
        `length_penalty` and early_stopping=False; the beams share their prompt's KV blocks. Under
        `structured_outputs` every beam follows the grammar (transformers' constrained beam search)."""
        params = BeamSearchParams(beam_width, max_tokens, length_penalty, ignore_eos, structured_outputs)
        prompts = as_prompt_list(prompts)
        return self._add_and_run(prompts, [params] * len(prompts), use_tqdm)

    def chat(
        self,
        messages: list[dict] | list[list[dict]],
        sampling_params: SamplingParams | None = None,
        *,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        use_tqdm: bool = True,
        **template_kwargs,
    ) -> list[RequestOutput]:
        """Apply the model's chat template to one conversation or a list of them, then generate."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [
            apply_chat_template(
                self.tokenizer,
                conversation,
                add_generation_prompt=add_generation_prompt,
                chat_template=chat_template,
                **template_kwargs,
            )
            for conversation in conversations
        ]
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def embed(
        self,
        prompts: PromptType | Sequence[PromptType],
        pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
        *,
        truncate_prompt_tokens: int | None = None,
        use_tqdm: bool = True,
    ) -> list[EmbeddingRequestOutput]:
        """One embedding per prompt, in order (`output.outputs.embedding`, a list of floats), from an engine made
        with runner="pooling", convert="embed"; prompts in generate's forms. Pooled as the model's
        sentence-transformers config says (else its last token, normalised: vLLM's default)."""
        if not self.engine.config.is_pooling:
            raise ValueError(
                "LLM.embed needs a pooling model: LLM(model, runner='pooling', convert='embed') "
                "(`jpaged serve MODEL --runner pooling --convert embed`)"
            )
        prompts = as_prompt_list(prompts)
        if pooling_params is None or isinstance(pooling_params, PoolingParams):
            params = [pooling_params or PoolingParams()] * len(prompts)
        else:
            params = list(pooling_params)
            if len(params) != len(prompts):
                raise ValueError(f"pooling_params has {len(params)} entries for {len(prompts)} prompts")
        if truncate_prompt_tokens is not None:
            params = [dataclasses.replace(p, truncate_prompt_tokens=truncate_prompt_tokens) for p in params]
        return self._add_and_run(prompts, params, use_tqdm)

    def metrics(self) -> dict[str, float]:
        return self.engine.metrics()

    def _add_and_run(
        self,
        prompts: list[EnginePrompt],
        params: list[SamplingParams] | list[BeamSearchParams] | list[PoolingParams],
        use_tqdm: bool,
        loras: list[LoRARequest | None] | None = None,
    ) -> list[RequestOutput] | list[EmbeddingRequestOutput]:
        for p in params:  # offline, a grammar that does not compile is the caller's ValueError, up front
            if getattr(p, "structured_outputs", None) is not None:
                self.engine.constrained.compile(p.structured_outputs)
        ids = []
        try:
            for prompt, p, lora in zip(prompts, params, loras or [None] * len(prompts), strict=True):
                ids.append(f"offline-{next(self._ids)}")
                self.engine.add_request(
                    ids[-1], prompt.prompt, p, cache_salt=prompt.cache_salt, lora_request=lora
                )
            return self._run(ids, use_tqdm)
        except BaseException:
            for request_id in ids:  # a bad prompt or an interrupt must not leave requests holding blocks
                self.engine.abort_request(request_id)
            raise

    def _run(self, request_ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        finished: dict[str, RequestOutput] = {}
        with tqdm(total=len(request_ids), desc="generating", disable=not use_tqdm) as bar:
            while self.engine.has_unfinished():
                for output in self.engine.step():
                    if output.finished:
                        finished[output.request_id] = output
                        bar.update(1)
        return [finished[i] for i in request_ids]


def _final_only(params: SamplingParams) -> SamplingParams:
    if params.output_kind is RequestOutputKind.FINAL_ONLY:
        return params
    params = params.clone()
    params.output_kind = RequestOutputKind.FINAL_ONLY
    return params


_default_llms: dict[tuple, LLM] = {}


def generate(
    prompts: PromptType | Sequence[PromptType], model: str | None = None, **sampling_kwargs
) -> list[RequestOutput]:
    """One call for research code: loads (and keeps) an engine for `model`, generates, returns outputs.

    The engine compiles only the step shapes it meets (no serving warm-up), which suits a few calls."""
    llm = _default_llms.get((model,))
    if llm is None:
        llm = _default_llms[(model,)] = LLM(model, enforce_eager=True)
    return llm.generate(prompts, SamplingParams(**sampling_kwargs), use_tqdm=False)
