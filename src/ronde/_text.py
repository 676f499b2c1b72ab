"""Small text helpers shared by the error messages of every layer."""

from __future__ import annotations

from typing import Iterable


def ranks_text(ranks: Iterable[int]) -> str:
    """``"0, 2, 3"``: ranks as error messages and reports name them."""
    return ", ".join(map(str, ranks))
