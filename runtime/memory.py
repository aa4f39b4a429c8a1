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


def transient(nbytes: int) -> None:
    """A region is about to run: it needs ``nbytes`` beyond what is allocated (its XLA temporaries
    and the outputs that do not reuse donated inputs) until it returns."""
    global peak
    if allocated + nbytes > peak:
        peak = allocated + nbytes


def reset_peak() -> None:
    global peak
    peak = allocated


records._account[0] = account
