"""Bytes of live device buffers and their peak, counted by the runtime itself."""
from __future__ import annotations

from ..scheduler import records

allocated = 0
peak = 0


def account(delta: int) -> None:
    global allocated, peak
    allocated += delta
    if allocated > peak:
        peak = allocated


def reset_peak() -> None:
    global peak
    peak = allocated


records._account[0] = account
