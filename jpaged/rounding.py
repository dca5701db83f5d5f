"""Integer rounding shared by every layer (block counts, table widths, panels): plain Python, no JAX."""

from __future__ import annotations


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) for a >= 0, b > 0: how many b-sized pieces hold a."""
    return -(-a // b)
