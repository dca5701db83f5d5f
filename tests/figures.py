"""Figures a test shows at the end of the run, in pytest's terminal summary: CI runs pytest without -s, so
anything a test prints itself is swallowed. The hook that prints them is conftest.py's pytest_terminal_summary."""

from __future__ import annotations

FIGURES: list[tuple[str, str]] = []  # (title, text), in the order the tests recorded them


def record(title: str, text: str) -> None:
    """Show `text` (one or more lines) under `title` in the run's summary."""
    FIGURES.append((title, text))
