"""A thinking model's reasoning apart from its answer: `<think>...</think>` (Qwen3, DeepSeek-R1).

qwen3: the reply thinks only if it opens with <think>; deepseek_r1: the template opens the block, so everything
before </think> is reasoning (and all of it while no </think> came). The streaming side re-reads the whole text
at every delta and holds back what could be the start of a tag, so a tag split across deltas is never sent.
"""

from __future__ import annotations

from dataclasses import dataclass

from jpaged_server.tool_parsers import held_back

START, END = "<think>", "</think>"


@dataclass(frozen=True, slots=True)
class ThinkFormat:
    opens_in_prompt: bool  # deepseek_r1: <think> is the template's; the reply starts inside the block

    def split(self, text: str, final: bool) -> tuple[str, str]:
        """(reasoning, content) of the text so far, leaving out what could still be the start of a tag."""
        rest = text.lstrip()
        if not final and START.startswith(rest):
            return "", ""  # maybe an opening <think>
        if rest.startswith(START):
            rest = rest[len(START) :]
        elif not self.opens_in_prompt:
            return "", text
        end = rest.find(END)
        if end >= 0:
            return rest[:end], rest[end + len(END) :]
        return (rest if final else rest[: len(rest) - held_back(rest, END)]), ""

    def parse(self, text: str) -> tuple[str | None, str]:
        reasoning, content = self.split(text, final=True)
        return reasoning.strip() or None, content


REASONING_PARSERS = {"qwen3": ThinkFormat(False), "deepseek_r1": ThinkFormat(True)}


class StreamingReasoningParser:
    def __init__(self, format: ThinkFormat) -> None:
        self.format = format
        self._text = ""
        self._sent = ("", "")

    def feed(self, delta_text: str) -> tuple[str, str]:
        """The new (reasoning, content) after one more delta of the reply."""
        self._text += delta_text
        return self._advance(final=False)

    def finish(self) -> tuple[str, str]:
        return self._advance(final=True)

    def _advance(self, final: bool) -> tuple[str, str]:
        reasoning, content = self.format.split(self._text, final)
        sent_reasoning, sent_content = self._sent
        new = (
            reasoning[len(sent_reasoning) :] if reasoning.startswith(sent_reasoning) else "",
            content[len(sent_content) :] if content.startswith(sent_content) else "",
        )
        self._sent = (sent_reasoning + new[0], sent_content + new[1])
        return new
