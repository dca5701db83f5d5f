"""Request and response bodies of the OpenAI-compatible API, with vLLM's extra fields.

Request models accept what vLLM accepts: a field they do not declare is kept aside (pydantic's extras) for
request_fields.py to ignore and report, or to refuse when it would change the output; `null` stands for a field's
default wherever one is declared, as OpenAI's spec allows. Response models mirror OpenAI's (and vLLM's extras,
present only when asked for); a streamed chat delta carries only the keys that changed.
"""

from __future__ import annotations

import time
from typing import Annotated, Any, ClassVar, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictInt,
    StrictStr,
    field_validator,
    model_serializer,
    model_validator,
)

TokenIds = list[StrictInt]


MAX_STOP_STRINGS = 128  # each is looked for in every new piece of text: bounded, as OpenAI bounds it (at 4)


class RequestModel(BaseModel):
    # NaN and infinity (Python's json reads them) are no number a client means: a 400 naming the field.
    model_config = ConfigDict(extra="allow", allow_inf_nan=False, populate_by_name=True)

    @model_validator(mode="before")
    @classmethod
    def _null_means_default(cls, data: Any) -> Any:
        """`"stream": null` is OpenAI's "not given" (vllm bench serve sends `logprobs: null`): a field with a
        default takes it, and an undeclared one is not there at all. A required field stays required."""
        if not isinstance(data, dict):
            return data
        fields = cls.model_fields
        return {
            key: value
            for key, value in data.items()
            if value is not None or (key in fields and fields[key].is_required())
        }

    @field_validator("*")
    @classmethod
    def _check_unicode(cls, value: Any) -> Any:
        """JSON may escape half a UTF-16 surrogate pair ("\\ud800"), which is no character: the tokenizer (or any
        UTF-8 encoder) fails on it, so it is a 400 naming the field."""
        _check_unicode(value)
        return value


def _check_unicode(value: Any) -> None:
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            raise ValueError(
                "holds an unpaired UTF-16 surrogate (\\ud800-\\udfff), which is no character"
            ) from None
    elif isinstance(value, list):
        for item in value:
            _check_unicode(item)
    elif isinstance(value, dict):
        for key, item in value.items():
            _check_unicode(key)
            _check_unicode(item)


class StreamOptions(RequestModel):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's: usage so far in every chunk (guidellm asks for it)


class JsonSchemaFormat(RequestModel):
    name: str
    description: str | None = None
    json_schema: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(RequestModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")  # json_object with a schema (instructor's)


class StructuredOutputsRequest(RequestModel):
    """vLLM's `structured_outputs`: exactly one of these (jpaged.sampling_params.StructuredOutputsParams)."""

    json_: dict[str, Any] | str | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None


class SamplingRequest(RequestModel):
    """Fields both generation endpoints share; `None` means OpenAI's (or vLLM's) default."""

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int | None = None
    stop: str | Annotated[list[str], Field(max_length=MAX_STOP_STRINGS)] | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    # vLLM's extras
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    stop_token_ids: TokenIds | None = None
    bad_words: list[str] | None = None
    allowed_token_ids: TokenIds | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    use_beam_search: bool = False
    priority: int = 0
    cache_salt: str | None = None
    request_id: str | None = None  # the response's id (after its prefix), as vLLM uses it
    return_token_ids: bool = False  # the prompt's and each choice's token ids beside the text
    prompt_logprobs: int | None = None
    truncate_prompt_tokens: Annotated[int, Field(ge=-1)] | None = (
        None  # keep the prompt's last k; -1: max_model_len
    )
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsRequest | None = None
    # vLLM's older spelling of structured_outputs, one field a kind
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None


class CompletionRequest(SamplingRequest):
    prompt: StrictStr | list[StrictStr] | TokenIds | list[TokenIds]
    echo: bool = False
    logprobs: int | None = None
    best_of: int | None = None  # sample best_of, return the n of highest cumulative logprob
    add_special_tokens: bool = True  # vLLM's default for raw prompts (a chat template writes its own BOS)
    length_penalty: float = 1.0  # beam search only: scores are cumulative_logprob / length ** length_penalty


class TextContentPart(RequestModel):
    type: Literal["text"]
    text: str


class FunctionCall(RequestModel):
    name: str
    arguments: str  # JSON text


class ToolCallMessage(RequestModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(RequestModel):
    role: Literal[
        "system", "developer", "user", "assistant", "tool", "function"
    ]  # function: legacy tool reply
    content: str | list[TextContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallMessage] | None = None  # an assistant's earlier calls
    tool_call_id: str | None = None  # a tool's reply names the call it answers
    reasoning: str | None = None  # an earlier reply's thinking, as this server returned it
    reasoning_content: str | None = None
    function_call: FunctionCall | None = None  # an assistant's earlier call, in the legacy functions shape
    # What the openai client writes back when an earlier response message is appended to the conversation;
    # accepted only while empty, as audio is not supported.
    refusal: None = None
    annotations: Annotated[list[Any], Field(max_length=0)] | None = None
    audio: None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "\n".join(part.text for part in self.content)
        return self.content or ""


class FunctionDefinition(RequestModel):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ChatTool(RequestModel):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class NamedFunction(RequestModel):
    name: str


class NamedToolChoice(RequestModel):
    type: Literal["function"] = "function"
    function: NamedFunction


class ChatCompletionRequest(SamplingRequest):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    tools: list[ChatTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    functions: list[FunctionDefinition] | None = None  # the legacy form of tools
    function_call: Literal["none", "auto"] | NamedFunction | None = None  # the legacy form of tool_choice
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    modalities: list[Literal["text"]] | None = None  # text is all this server writes
    reasoning_effort: str | None = None  # handed to the chat template, which models that think read
    add_generation_prompt: bool = True
    continue_final_message: bool = False  # the reply continues the last (assistant) message
    add_special_tokens: bool = False  # the template writes its own BOS; True adds the tokenizer's too
    echo: bool = False  # the reply starts with the last message's content when that is the assistant's
    include_reasoning: bool = True
    chat_template_kwargs: dict[str, Any] | None = None


class TokenizeCompletionRequest(RequestModel):
    model: str | None = None
    prompt: str
    add_special_tokens: bool = True


class TokenizeChatRequest(RequestModel):
    model: str | None = None
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    chat_template_kwargs: dict[str, Any] | None = None


TokenizeRequest = TokenizeCompletionRequest | TokenizeChatRequest


class DetokenizeRequest(RequestModel):
    model: str | None = None
    tokens: TokenIds


# ---- responses ----


def _now() -> int:
    return int(time.time())


class OmitsUnset(BaseModel):
    """A response whose `OPTIONAL` keys appear only when set: OpenAI's optional keys, and vLLM's extras that a
    request asks for (return_token_ids, prompt_logprobs)."""

    OPTIONAL: ClassVar[tuple[str, ...]] = ()

    @model_serializer(mode="wrap")
    def _only_present(self, handler) -> dict:
        return {
            key: value
            for key, value in handler(self).items()
            if value is not None or key not in self.OPTIONAL
        }


class PromptTokensDetails(BaseModel):
    cached_tokens: int  # prompt tokens served from the prefix cache


class UsageInfo(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None


class PromptLogprob(BaseModel):
    """vLLM's prompt_logprobs entry: per prompt position, token id -> this."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


PromptLogprobs = list[dict[int, PromptLogprob] | None]


class CompletionLogprobs(BaseModel):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class CompletionChoice(OmitsUnset):
    OPTIONAL = ("prompt_logprobs", "prompt_token_ids", "token_ids")

    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    prompt_logprobs: PromptLogprobs | None = None
    prompt_token_ids: list[int] | None = None
    token_ids: list[int] | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob] | None = None


class FunctionCallOut(OmitsUnset):
    OPTIONAL = ("name", "arguments")

    name: str | None = None
    arguments: str | None = None


class ToolCallOut(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCallOut


class AssistantMessage(OmitsUnset):
    """`reasoning` (and `reasoning_content`, its older name) and `tool_calls` appear only when there are some;
    `function_call` only in answer to the legacy `functions`."""

    OPTIONAL = ("reasoning", "reasoning_content", "tool_calls", "function_call")

    role: Literal["assistant"] = "assistant"
    content: str | None
    reasoning: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[ToolCallOut] | None = None
    function_call: FunctionCallOut | None = None


class ChatChoice(OmitsUnset):
    OPTIONAL = ("token_ids",)

    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None


class ChatCompletionResponse(OmitsUnset):
    OPTIONAL = ("prompt_logprobs", "prompt_token_ids")

    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo
    prompt_logprobs: PromptLogprobs | None = None
    prompt_token_ids: list[int] | None = None


class DeltaToolCall(OmitsUnset):
    OPTIONAL = ("id", "type")

    index: int
    id: str | None = None  # id, type and name in a call's first delta only
    type: Literal["function"] | None = None
    function: FunctionCallOut


class DeltaMessage(OmitsUnset):
    OPTIONAL = ("role", "content", "reasoning", "reasoning_content", "tool_calls", "function_call")

    role: Literal["assistant"] | None = None
    content: str | None = None
    reasoning: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None
    function_call: FunctionCallOut | None = None

    def is_empty(self) -> bool:
        return not (self.role or self.content or self.reasoning or self.tool_calls or self.function_call)


class ChatStreamChoice(OmitsUnset):
    OPTIONAL = ("token_ids",)

    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None


class ChatCompletionChunk(OmitsUnset):
    OPTIONAL = ("prompt_token_ids",)

    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[ChatStreamChoice]
    usage: UsageInfo | None = None
    prompt_token_ids: list[int] | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=_now)
    owned_by: str = "jpaged"
    root: str  # the model's path; an adapter's directory
    parent: str | None = None  # an adapter's base model
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
