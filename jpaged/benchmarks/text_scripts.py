"""Which writing system each part of a text is in, from Unicode's Script property (the `regex` module's
\\p{Script=...}): a tokenizer trained mostly on English text spends several times more tokens on a Thai character
than on a Latin one, so sizing from English traffic undercounts other languages."""

from __future__ import annotations

from collections.abc import Callable

import regex

# Scripts reported by name; Han, Hiragana, Katakana and Hangul together as CJK. Any other script is "Other".
_SCRIPTS = {
    "Latin": "Latin",
    "Thai": "Thai",
    "Han": "CJK",
    "Hiragana": "CJK",
    "Katakana": "CJK",
    "Hangul": "CJK",
    "Cyrillic": "Cyrillic",
    "Greek": "Greek",
    "Arabic": "Arabic",
    "Hebrew": "Hebrew",
    "Devanagari": "Devanagari",
}
_NAMED = [(regex.compile(rf"\p{{Script={script}}}"), label) for script, label in _SCRIPTS.items()]
_NEUTRAL = regex.compile(r"[\p{Script=Common}\p{Script=Inherited}]")  # spaces, digits, punctuation, marks


def script_of(char: str) -> str | None:
    """The script label of one character; None for the script-neutral ones (Common, Inherited)."""
    if _NEUTRAL.match(char):
        return None
    return next((label for pattern, label in _NAMED if pattern.match(char)), "Other")


def script_runs(text: str) -> list[tuple[str, str]]:
    """The text as (script label, run) in order: neutral characters join the run before them (leading ones the
    first run); a text of neutral characters only is one "Common" run."""
    runs: list[list] = []
    leading = ""
    for char in text:
        label = script_of(char)
        if label is None:
            if runs:
                runs[-1][1] += char
            else:
                leading += char
        elif runs and runs[-1][0] == label:
            runs[-1][1] += char
        else:
            runs.append([label, char])
    if not runs:
        return [("Common", leading)] if leading else []
    runs[0][1] = leading + runs[0][1]
    return [(label, run) for label, run in runs]


def tokens_by_script(texts: list[str], count_tokens: Callable[[str], int]) -> dict[str, tuple[int, int]]:
    """script label -> (tokens, characters) over the texts, each run tokenised on its own."""
    totals: dict[str, list[int]] = {}
    for text in texts:
        for label, run in script_runs(text):
            entry = totals.setdefault(label, [0, 0])
            entry[0] += count_tokens(run)
            entry[1] += len(run)
    return {label: (tokens, chars) for label, (tokens, chars) in totals.items()}
