"""Writing systems are told apart by Unicode's Script property: Thai (its vowel and tone marks included), Latin,
CJK (Han, kana, Hangul together) and the rest, with spaces, digits and punctuation joining the run before them."""

from __future__ import annotations

from jpaged.benchmarks.text_scripts import script_of, script_runs, tokens_by_script


def test_each_character_has_its_script():
    assert [script_of(c) for c in "aéสี你かカ한ЖΩ"] == [
        "Latin", "Latin", "Thai", "Thai", "CJK", "CJK", "CJK", "CJK", "Cyrillic", "Greek",
    ]  # fmt: skip
    assert [script_of(c) for c in " 7,!"] == [None] * 4
    assert script_of("ሀ") == "Other"  # Ethiopic: not one of the named scripts


def test_mixed_text_splits_into_runs_with_neutral_characters_attached_before():
    text = "(1) Hello สวัสดีครับ, 你好 world!"
    assert script_runs(text) == [
        ("Latin", "(1) Hello "),
        ("Thai", "สวัสดีครับ, "),
        ("CJK", "你好 "),
        ("Latin", "world!"),
    ]
    assert "".join(run for _, run in script_runs(text)) == text
    assert script_runs("42 ...") == [("Common", "42 ...")]
    assert script_runs("") == []


def test_tokens_and_characters_are_summed_per_script(default_tokenizer):
    def count(run: str) -> int:
        return len(default_tokenizer.encode(run, add_special_tokens=False))

    english, thai = "The weather is nice today.", "วันนี้อากาศดีมาก"
    totals = tokens_by_script([english, thai, english], count)
    assert totals["Latin"] == (2 * count(english), 2 * len(english))
    assert totals["Thai"] == (count(thai), len(thai))
    thai_rate = totals["Thai"][0] / totals["Thai"][1]
    latin_rate = totals["Latin"][0] / totals["Latin"][1]
    assert thai_rate > 3 * latin_rate  # SmolLM2's tokenizer was trained on English
