"""Agreement and failure detection between the processes of a job, through JAX's coordination
service (a key-value store in rank 0's process that every process reaches).

NOTE [collective check]: XLA's CPU collectives (gloo) have no defence against ranks that disagree:
a collective whose sizes differ between ranks aborted the process ("Received data size doesn't
match expected size"), and one a rank never reaches waited forever. So before each collective every
rank publishes a description of it (kind, reduction, shapes, dtypes, the user's line) under the
collective's sequence number in its group, and reads every other rank's. A different description,
a rank that raised, exited or stopped sending heartbeats, or the timeout, becomes a
``DistributedError`` naming the ranks, on every rank, before anything reaches XLA. It costs one
write and one read per other rank in the coordination service. Cut and compile decisions depend on
counts only, never on time (NOTE [backward cut] in device.py), so ranks that run the same program
always agree. ``DEFERFUSE_DIST_CHECK=0`` turns the check off (barriers still meet here).

NOTE [rank failures]: a rank whose program raises publishes the error before it exits (an
excepthook); every rank publishes that it exited and sends a heartbeat every second (NOTE [orderly
exit] in runtime/cluster.py). A rank waiting for others looks at these between one-second waits: a
failure or exit names the rank at once, a heartbeat that stopped for ``dead_after`` seconds (10, or
half the timeout if less) names a killed or frozen rank, and the timeout names the ranks that never
arrived. If rank 0, which hosts the coordination service, is killed, the others end with JAX's own
fatal error, which says that the leader task died.
"""
from __future__ import annotations

import sys
import time

import torch.distributed as dist

from ..runtime.cluster import CLUSTER

BLOCK = 64          # collectives per key directory; old directories are deleted as a whole


class DistributedError(dist.DistBackendError):
    """A collective could not run: ranks disagree on it, or a rank failed, exited, died or did not
    arrive within the timeout. It names the ranks."""


class Coordinator:
    """This process's side of the agreement: published failures, and the exchange before each
    collective (NOTE [collective check], NOTE [rank failures]). Heartbeats and the orderly exit
    are the cluster's (runtime/cluster.py)."""

    def __init__(self):
        self.client = None
        self.rank = 0
        self.started = False
        self.timeout = 60.0
        self._hook_prev = None

    def start(self, timeout: float) -> None:
        """Publish this rank's failures from now on (once; a job of one process needs none)."""
        self.timeout = timeout
        if self.started or CLUSTER.client is None:
            return
        self.started = True
        self.client, self.rank = CLUSTER.client, CLUSTER.rank
        self._hook_prev = sys.excepthook
        sys.excepthook = self._excepthook

    def _excepthook(self, typ, value, tb) -> None:
        try:
            if not isinstance(value, DistributedError):
                where = ""
                last = tb
                while last is not None and last.tb_next is not None:
                    last = last.tb_next
                if last is not None:
                    where = f" at {last.tb_frame.f_code.co_filename}:{last.tb_lineno}"
                self.publish_failure(f"{typ.__name__}: {value}{where}")
        finally:
            (self._hook_prev or sys.__excepthook__)(typ, value, tb)

    def publish_failure(self, what: str) -> None:
        """Tell the other ranks that this one failed (they raise at their next wait)."""
        try:
            self.client.key_value_set(f"df/failed/{self.rank}", what[:2000], allow_overwrite=True)
        except Exception:
            pass

    def problems(self, ranks, now: float) -> str | None:
        """A sentence about the ranks in ``ranks`` that failed, exited or died, or None."""
        said = []
        try:
            failed = CLUSTER.ranks_with("failed")
            exited = CLUSTER.ranks_with("exited")
        except Exception as e:
            return f"the coordination service (in rank 0's process) is unreachable: {e}"
        for r in ranks:
            if r in failed:
                said.append(f"rank {r} failed: {failed[r]}")
            elif r in exited:
                said.append(f"rank {r} exited (its program ended) before reaching this collective")
        for r in CLUSTER.dead([r for r in ranks if r not in failed and r not in exited], now):
            said.append(f"rank {r} stopped sending heartbeats {CLUSTER.dead_after:.0f} s ago "
                        "(killed, or frozen)")
        return "; ".join(said) or None

    def fail(self, message: str) -> DistributedError:
        return DistributedError(f"[rank {self.rank}] {message}")

    # --- the exchange before a collective ------------------------------------------------------
    def exchange(self, scope: str, seq: int, me: int, ranks: list, desc: str, line: str,
                 what: str, timeout: float) -> None:
        """Publish ``desc`` (this rank's description of collective ``seq`` in ``scope``) and wait
        for every rank in ``ranks`` (global ranks; ``me`` is ours) to publish theirs; raise a
        ``DistributedError`` if any differs, failed, exited, died or is not there in time."""
        got = self.gather(scope, seq, me, ranks, desc, line, what, timeout)
        if any(d != desc for d, _ in got.values()):
            lines = "\n".join(f"  rank {r}: {d} at {ln}" for r, (d, ln) in sorted(got.items()))
            raise self.fail(f"ranks disagree on {what}: each rank must call the same collectives "
                            f"in the same order, with the same shapes and dtypes:\n{lines}")

    def gather(self, scope: str, seq: int, me: int, ranks: list, desc: str, line: str,
               what: str, timeout: float) -> dict:
        """Publish ``desc`` for step ``seq`` of ``scope`` and return every rank's {rank: (desc,
        line)} once all have published; raise a ``DistributedError`` if one failed, exited, died
        or is not there in time."""
        c = self.client
        base = f"df/c/{scope}/{seq // BLOCK}/{seq}/"
        c.key_value_set(base + str(me), f"{desc}\x1f{line}")
        got = {me: (desc, line)}
        deadline = time.monotonic() + timeout
        waiting = [r for r in ranks if r != me]
        for r in waiting:
            while True:
                now = time.monotonic()
                try:
                    v = c.blocking_key_value_get(base + str(r), int(min(1.0, max(deadline - now, 0.001)) * 1000))
                    break
                except Exception as e:
                    if "DEADLINE_EXCEEDED" not in str(e) and "timed out" not in str(e).lower():
                        raise self.fail(f"{what}: the coordination service (in rank 0's process) "
                                        f"is unreachable: {e}") from None
                now = time.monotonic()
                missing = [x for x in waiting if x not in got]
                p = self.problems(missing, now)
                if p is not None:
                    raise self.fail(f"{what} cannot run: {p}")
                if now >= deadline:
                    raise self.fail(
                        f"{what}: rank(s) {', '.join(map(str, missing))} did not reach it within "
                        f"{timeout:.0f} s (the timeout: init_process_group(timeout=...) or "
                        "DEFERFUSE_DIST_TIMEOUT); they are alive but elsewhere in the program, or "
                        "still compiling (raise the timeout for a model that compiles for longer)")
            d, _, ln = v.partition("\x1f")
            got[r] = (d, ln)
        if seq % BLOCK == 0 and seq >= 2 * BLOCK and me == min(ranks):
            # Every rank has published collective seq, so all are past the directory before last.
            try:
                c.key_value_delete(f"df/c/{scope}/{seq // BLOCK - 2}/")
            except Exception:
                pass
        return got

    def wait(self, ready, ranks: list, what: str, timeout: float) -> None:
        """Wait until ``ready()`` (a collective's results are computed), checking the other ranks
        every second and raising a ``DistributedError`` on a failure or the timeout."""
        if ready():
            return
        start = time.monotonic()
        deadline = start + timeout
        nap, next_check = 2e-5, start + 1.0
        while not ready():
            time.sleep(nap)
            nap = min(nap * 2, 5e-3)
            now = time.monotonic()
            if now >= next_check and self.client is not None:
                next_check = now + 1.0
                p = self.problems(ranks, now)
                if p is not None:
                    raise self.fail(f"{what} cannot complete: {p}")
            if now >= deadline:
                raise self.fail(f"{what} did not complete within {timeout:.0f} s (the "
                                "timeout: init_process_group(timeout=...) or DEFERFUSE_DIST_TIMEOUT)")

    def explain(self, error: Exception, ranks: list, what: str) -> DistributedError:
        """A collective failed inside XLA (a peer's connection closed): name the rank, waiting up
        to ``dead_after`` seconds for its failure, exit or silence to show."""
        if self.client is None:
            return self.fail(f"{what} failed: {error}")
        deadline = time.monotonic() + CLUSTER.dead_after + 2
        while True:
            now = time.monotonic()
            p = self.problems(ranks, now)
            if p is not None:
                return self.fail(f"{what} failed: {p} ({type(error).__name__}: {error})")
            if now >= deadline:
                return self.fail(f"{what} failed: {error}")
            time.sleep(0.2)


COORD = Coordinator()
