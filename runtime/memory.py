"""The runtime's own count of device buffers: bytes and buffers live now, their peaks, what was
allocated and freed in all, and out-of-memory errors (``COUNTERS``).

NOTE [memory counters]: a buffer is counted from the moment a value is bound to its device array
until the array is dropped (a donated input stops counting once the program that took it has run);
while a fused region runs, its XLA temporaries count towards the peak too (``transient``). The
counts cover every ``tpu`` device of the process together. ``torch.tpu.memory_stats()`` reports
them under CUDA's caching allocator's keys (deferfuse/device_info.py), with CUDA's split into a
large pool (buffers over 1 MiB) and a small one.
"""
from __future__ import annotations

from ..scheduler import records

LARGE = 1 << 20         # CUDA's caching allocator: a block over 1 MiB comes from its large pool
POOLS = ("all", "large_pool", "small_pool")


class Counters:
    """Bytes and buffers, in all and in the large pool: current, peak, and freed since
    ``reset_accumulated`` (``cur0``: current then; allocated = current - cur0 + freed). The small
    pool's are the difference, but for its peaks. Updated for every buffer bound or dropped, so
    plain attributes, the large pool's only touched for large buffers."""

    __slots__ = ("cur", "peak", "freed", "cur0", "n", "npeak", "nfreed", "n0",
                 "lcur", "lpeak", "lfreed", "lcur0", "ln", "lnpeak", "lnfreed", "ln0",
                 "speak", "snpeak", "ooms")

    def __init__(self):
        for k in self.__slots__:
            setattr(self, k, 0)

    @property
    def allocated(self) -> int:
        return self.cur

    def account(self, nbytes: int, n: int) -> None:
        """One buffer of ``nbytes`` allocated (``n`` = 1) or freed (``n`` = -1)."""
        if nbytes > LARGE:
            self.add(n * nbytes, n, n * nbytes, n)
        elif n > 0:
            cur = self.cur = self.cur + nbytes
            k = self.n = self.n + 1
            if cur > self.peak:
                self.peak = cur
            if k > self.npeak:
                self.npeak = k
            cur -= self.lcur
            if cur > self.speak:
                self.speak = cur
            k -= self.ln
            if k > self.snpeak:
                self.snpeak = k
        else:
            self.cur -= nbytes
            self.freed += nbytes
            self.n -= 1
            self.nfreed += 1

    def add(self, nbytes: int, n: int, large_bytes: int, large_n: int) -> None:
        """``n`` buffers of ``nbytes`` in all allocated (``n`` > 0) or freed (``n`` < 0), of which
        ``large_n`` of ``large_bytes`` are over ``LARGE``."""
        self.cur += nbytes
        self.n += n
        self.lcur += large_bytes
        self.ln += large_n
        if n > 0:
            self.peak = max(self.peak, self.cur)
            self.npeak = max(self.npeak, self.n)
            self.lpeak = max(self.lpeak, self.lcur)
            self.lnpeak = max(self.lnpeak, self.ln)
            self.speak = max(self.speak, self.cur - self.lcur)
            self.snpeak = max(self.snpeak, self.n - self.ln)
        else:
            self.freed -= nbytes
            self.nfreed -= n
            self.lfreed -= large_bytes
            self.lnfreed -= large_n

    def transient(self, nbytes: int) -> None:
        """A region is about to run: it needs ``nbytes`` beyond what is allocated (its XLA
        temporaries and the outputs that do not reuse donated inputs) until it returns."""
        if self.cur + nbytes > self.peak:
            self.peak = self.cur + nbytes

    def series(self) -> tuple:
        """(bytes, buffers): each a list per pool in ``POOLS`` of [current, peak, allocated,
        freed]."""
        b = [[self.cur, self.peak, self.cur - self.cur0 + self.freed, self.freed],
             [self.lcur, self.lpeak, self.lcur - self.lcur0 + self.lfreed, self.lfreed]]
        n = [[self.n, self.npeak, self.n - self.n0 + self.nfreed, self.nfreed],
             [self.ln, self.lnpeak, self.ln - self.ln0 + self.lnfreed, self.lnfreed]]
        for s, small_peak in ((b, self.speak), (n, self.snpeak)):
            s.append([s[0][0] - s[1][0], small_peak, s[0][2] - s[1][2], s[0][3] - s[1][3]])
        return b, n

    def reset_peak(self) -> None:
        self.peak, self.npeak, self.lpeak, self.lnpeak = self.cur, self.n, self.lcur, self.ln
        self.speak, self.snpeak = self.cur - self.lcur, self.n - self.ln

    def reset_accumulated(self) -> None:
        self.cur0, self.n0, self.lcur0, self.ln0 = self.cur, self.n, self.lcur, self.ln
        self.freed = self.nfreed = self.lfreed = self.lnfreed = self.ooms = 0


COUNTERS = Counters()
records._account[0] = COUNTERS.account
