"""Hypothesis strategies shared by the property tests."""

from __future__ import annotations

from hypothesis import strategies as st


def mostly(value: object, *others: object) -> st.SearchStrategy:
    """`value` nine times in ten, else one of `others`: the usual case, with every exception."""
    return st.sampled_from((value,) * 9 * len(others) + others)
