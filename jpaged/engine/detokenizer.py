"""Incremental detokenisation with stop strings: stream text deltas that never split a character.

Byte-level tokenizers split one Thai, Chinese or emoji character over several tokens, and decoding a partial
character yields U+FFFD. As vLLM's detokenize_incrementally does, we decode a short window of tokens
[prefix_offset:] and emit only what it adds over [prefix_offset:read_offset], holding everything back while the
window ends in an incomplete character. Decoding from a few tokens back (not from the new token alone) keeps
tokenizers that drop a word's leading space at the start of a decode (SentencePiece) correct.

Stop strings are searched in the accumulated text, so they are found across token boundaries. Without
include_stop_str_in_output, the longest tail of the text that could still grow into a stop string is held back
from the stream until it cannot, so text after which a stop string is cut never reaches the client.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from jpaged.engine.tokenizer import Tokenizer
from jpaged.sampling_params import SamplingParams

PROMPT_CONTEXT_TOKENS = 5  # prompt tokens decoded with the first outputs (vLLM's initial offset)
REPLACEMENT_CHAR = "\ufffd"  # what decode makes of an incomplete UTF-8 sequence


def decoder_for(tokenizer: Tokenizer, params: SamplingParams) -> Callable[[list[int]], str]:
    """`tokenizer.decode` with the params' options and no clean-up. For transformers' Rust-backed tokenizers
    that is exactly the Rust tokenizer's own decode, called directly: it skips transformers' Python per call, and
    streaming decodes twice per token."""
    skip = params.skip_special_tokens
    if _is_plain_tokenizers_backend(tokenizer):
        decode = tokenizer.backend_tokenizer.decode
        return lambda token_ids: decode(token_ids, skip_special_tokens=skip)
    return lambda token_ids: tokenizer.decode(
        token_ids, skip_special_tokens=skip, clean_up_tokenization_spaces=False
    )


def _is_plain_tokenizers_backend(tokenizer: Tokenizer) -> bool:
    """Whether `decode(..., clean_up_tokenization_spaces=False)` only calls the Rust tokenizer (a transformers
    TokenizersBackend whose class overrides neither decode step)."""
    try:
        from transformers.tokenization_utils_base import PreTrainedTokenizerBase
        from transformers.tokenization_utils_tokenizers import TokenizersBackend
    except ImportError:
        return False
    cls = type(tokenizer)
    return (
        isinstance(tokenizer, TokenizersBackend)
        and cls.decode is PreTrainedTokenizerBase.decode
        and cls._decode is TokenizersBackend._decode
    )


def decode_output(
    tokenizer: Tokenizer,
    prompt_token_ids: Sequence[int],
    output_token_ids: Sequence[int],
    params: SamplingParams,
) -> str:
    """In one decode, the text an IncrementalDetokenizer without stop strings holds once finished: the output
    decoded after the same prompt context, minus an incomplete final character. For outputs nobody reads before
    they end, it saves two decodes per token."""
    if not params.detokenize:
        return ""
    decode = decoder_for(tokenizer, params)
    context = list(prompt_token_ids[-PROMPT_CONTEXT_TOKENS:])
    return decode([*context, *output_token_ids])[len(decode(context)) :].rstrip(REPLACEMENT_CHAR)


class IncrementalDetokenizer:
    """One sequence's output text. `add_tokens` returns the delta to stream; deltas concatenate to `text`."""

    def __init__(self, tokenizer: Tokenizer, prompt_token_ids: Sequence[int], params: SamplingParams) -> None:
        self._decode = decoder_for(tokenizer, params)
        self._params = params
        self._max_stop_len = max((len(s) for s in params.stop_strings), default=0)
        self._token_ids = list(prompt_token_ids[-PROMPT_CONTEXT_TOKENS:])
        self._prefix_offset = 0
        self._read_offset = len(self._token_ids)
        self._num_streamed = 0  # characters of `text` already returned as deltas
        self.text = ""  # output text so far, cut at a matched stop string
        self.stop_reason: str | None = None  # the stop string that ended the sequence
        self.finished = False

    def add_tokens(self, token_ids: Sequence[int]) -> str:
        """Take newly generated tokens; return the text now safe to stream ("" after the sequence finished)."""
        if self.finished or not self._params.detokenize:
            return ""
        self._token_ids.extend(token_ids)
        pending = self._pending_text()
        if pending and not pending.endswith(
            REPLACEMENT_CHAR
        ):  # else wait: the window ends inside a character
            self._prefix_offset, self._read_offset = self._read_offset, len(self._token_ids)
            self._append(pending)
        return self._release()

    def finish(self) -> str:
        """The sequence ended for another reason (EOS, stop token, length): release the held-back text.

        An incomplete character at the very end is dropped, as vLLM never emits it either.
        """
        if not self.finished and self._params.detokenize:
            self._append(self._pending_text().rstrip(REPLACEMENT_CHAR))
        self.finished = True
        return self._release()

    def _pending_text(self) -> str:
        """What the tokens after read_offset add to the text, decoded in context from prefix_offset."""
        prefix = self._decode(self._token_ids[self._prefix_offset : self._read_offset])
        window = self._decode(self._token_ids[self._prefix_offset :])
        return window[len(prefix) :]

    def _append(self, new_text: str) -> None:
        self.text += new_text
        if new_text and self._max_stop_len:
            self._cut_at_stop_string(len(new_text))

    def _cut_at_stop_string(self, num_new_chars: int) -> None:
        """Find the earliest stop string touching the new text; cut the text there and finish."""
        start = max(0, len(self.text) - num_new_chars - self._max_stop_len + 1)
        matches = [(i, s) for s in self._params.stop_strings if (i := self.text.find(s, start)) >= 0]
        if not matches:
            return
        index, stop = min(matches, key=lambda m: m[0])
        self.text = self.text[: index + len(stop) if self._params.include_stop_str_in_output else index]
        self.stop_reason = stop
        self.finished = True

    def _num_held_back(self) -> int:
        """Length of the longest tail of `text` that is a proper prefix of some stop string."""
        if self.finished or self._params.include_stop_str_in_output:
            return 0
        for length in range(min(self._max_stop_len - 1, len(self.text)), 0, -1):
            tail = self.text[-length:]
            if any(s.startswith(tail) for s in self._params.stop_strings):
                return length
        return 0

    def _release(self) -> str:
        end = len(self.text) - self._num_held_back()
        delta = self.text[self._num_streamed : end]
        self._num_streamed = end
        return delta
