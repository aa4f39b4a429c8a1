"""Point-to-point messages of the ``tpu`` process group (``send``, ``recv``): ``PointToPoint`` is
the part of ``ProcessGroupTPU`` (group.py) that posts and matches them.

NOTE [p2p matching]: a ``send`` and its ``recv`` run as one XLA program between the two processes,
so both must call it at once, in the same order as every other program they share. gloo and NCCL
let ranks post sends and receives in any order (both ranks ``isend`` first, then ``irecv``; a
``batch_isend_irecv`` ring), so a send or recv on tpu tensors is only posted (a send keeps its
value: JAX arrays never change) and runs when this rank waits on one of its requests
(``dist.send``/``recv`` wait at once). Waiting takes rounds: for each pair of ranks this rank has
posted to, in increasing order of the pair (so no two ranks wait on each other in a cycle), both
ranks publish what they posted to the other in the coordination service; each direction's sends
and receives are matched in posting order (shapes and dtypes must agree) and the matched messages
run, lower rank's first. Rounds repeat until the awaited request has run. Two ranks that each wait
on a request the other cannot match (both blocking ``send`` first) raise a ``DistributedError``
instead of hanging, as does a request no round completes within the timeout.
"""
from __future__ import annotations

import json
import time

import torch
from torch._C._distributed_c10d import Work

from ..scheduler.policy import Sync
from ..engine import engine
from ..dispatch import user_frame
from ..runtime import collectives as xc
from ..runtime import stats
from ..runtime.cluster import CLUSTER
from ..runtime.dtypes import to_np_dtype
from .arrays import describe, read_array, write_array
from .coord import COORD

S = stats.S


class _P2P:
    """A posted send or recv on a tpu tensor, waiting for its peer (NOTE [p2p matching])."""
    __slots__ = ("kind", "peer", "tensor", "array", "desc", "line", "done")

    def __init__(self, kind, peer, tensor, array, line):
        self.kind, self.peer, self.tensor, self.array, self.line = kind, peer, tensor, array, line
        self.desc = describe(tensor)
        self.done = False


class _P2PWork(Work):
    """The request of a posted send or recv: waiting on it runs the rounds that complete it."""

    def __init__(self, group, ops, source=-1):
        super().__init__()
        self._group, self._ops, self._source = group, ops, source

    def wait(self, timeout=None):
        for op in self._ops:
            self._group._p2p_complete(op)
        return True

    def is_completed(self):
        # Completing takes the peer's part: a poll waits for it (a loop polling a request that
        # never ran would spin forever).
        return self.wait()

    def is_success(self):
        return True

    def result(self):
        return [op.tensor for op in self._ops]

    def source_rank(self):
        return self._source

    def get_future(self):
        self.wait()
        f = torch.futures.Future()
        f.set_result(self.result())
        return f


class PointToPoint:
    """``send``/``recv`` of ``ProcessGroupTPU`` (NOTE [p2p matching]): the group's ``_split``,
    ``_execute``, ``_devices``, ``_gloo``, ``_ranks``, ``_gname``, ``_timeout``, ``_p2p_seq`` and
    ``_p2p_pending`` are the state these methods use."""

    def _post(self, kind: str, tensors, peer: int):
        if not 0 <= peer < self.size() or peer == self.rank():
            raise ValueError(f"{kind}: invalid peer rank {peer} for a group of {self.size()} "
                             f"processes (this process is rank {self.rank()})")
        if engine.state.trace.nodes:
            engine.sync(Sync.COLLECTIVE, op=kind)
        line = user_frame()
        ops = [_P2P(kind, self._ranks[peer], t, read_array(t) if kind == "send" else None, line)
               for t in tensors]
        self._p2p_pending.extend(ops)
        return ops

    def _p2p_complete(self, op) -> None:
        """Run rounds until ``op`` has run (NOTE [p2p matching])."""
        last_progress = time.monotonic()
        while not op.done:
            if not self._p2p_pending:
                raise RuntimeError("internal error: a p2p request is neither done nor posted")
            me = CLUSTER.rank
            progress = False
            for peer in sorted({o.peer for o in self._p2p_pending}):
                progress |= self._p2p_round(me, peer, op)
            now = time.monotonic()
            if progress:
                last_progress = now
            elif now - last_progress > self._timeout:
                raise COORD.fail(
                    f"{op.kind} of {op.desc} {'to' if op.kind == 'send' else 'from'} rank "
                    f"{op.peer} (at {op.line}) did not complete within {self._timeout:.0f} s "
                    "(the timeout): its peer never posted the matching request")

    def _p2p_round(self, me: int, peer: int, waited) -> bool:
        """One round with ``peer`` (a global rank): exchange what each posted to the other, run
        the matched messages; returns whether any ran."""
        lo, hi = min(me, peer), max(me, peer)
        mine = [o for o in self._p2p_pending if o.peer == peer]
        sends = [o for o in mine if o.kind == "send"]
        recvs = [o for o in mine if o.kind == "recv"]
        waiting = waited in mine
        scope = f"{self._gname}/p2p/{lo}-{hi}"
        seq = self._p2p_seq.get(scope, 0)
        self._p2p_seq[scope] = seq + 1
        what = f"send/recv (round #{seq} between ranks {lo} and {hi} of group {self._gname})"
        desc = json.dumps({"s": [o.desc for o in sends], "r": [o.desc for o in recvs],
                           "w": f"{waited.kind} {waited.desc}" if waiting else "",
                           "at": [o.line for o in mine]})
        if COORD.client is None:
            raise RuntimeError("send/recv on tpu tensors needs JAX's distributed runtime (a "
                               "group of several processes)")
        t1 = time.perf_counter()
        got = COORD.gather(scope, seq, me, [lo, hi], desc, waited.line if waiting else "", what,
                           self._timeout)
        S["collective_check_seconds"] += time.perf_counter() - t1
        theirs = json.loads(got[peer][0])
        out = list(zip(sends, theirs["r"]))      # me -> peer, matched in posting order
        into = list(zip(recvs, theirs["s"]))     # peer -> me
        bad = [(o, d) for o, d in out + into if o.desc != d]
        if bad or (not out and not into and waiting and theirs["w"]):
            def posted(r, info):
                ops = [f"send {d} to {hi if r == lo else lo}" for d in info["s"]] + \
                      [f"recv {d} from {hi if r == lo else lo}" for d in info["r"]]
                w = f", waiting on its {info['w']}" if info["w"] else ""
                return (f"  rank {r}: posted {', '.join(ops) or 'nothing'}{w} (at "
                        f"{', '.join(dict.fromkeys(info['at']))})")
            both = "\n".join(posted(r, json.loads(got[r][0])) for r in (lo, hi))
            why = ("a send and its recv differ in shape or dtype" if bad else
                   "each waits on a request the other has not matched, and neither can post more")
            raise COORD.fail(f"ranks disagree on {what}: {why}; a send's recv must be posted "
                             f"with the same shape and dtype, in the same order:\n{both}")
        if not out and not into:
            return False
        lo_first = (out + into) if me == lo else (into + out)
        for o, _ in lo_first:
            self._p2p_run(o, me, lo, hi, what)
        done = {id(o) for o, _ in lo_first}
        self._p2p_pending = [o for o in self._p2p_pending if id(o) not in done]
        return True

    def _p2p_run(self, o, me, lo, hi, what) -> None:
        """One message of a round: a permute between ``lo`` and ``hi`` (global ranks)."""
        src_is_lo = (o.kind == "send") == (me == lo)
        pair = ((0, 1),) if src_is_lo else ((1, 0),)

        def run(devices):
            if o.kind == "send":
                x = o.array
            else:
                import jax.numpy as jnp
                x = jnp.zeros(tuple(o.tensor.shape), to_np_dtype(o.tensor.dtype),
                              device=devices[0 if me == lo else 1])
            a = xc.permute(x, devices, pair)
            if o.kind == "recv":
                write_array(o.tensor, a)
            return [a]
        t0 = time.perf_counter()
        self._execute("send/recv", [o.tensor], run, self._devices(o.tensor._s.device, (lo, hi)),
                      [o.peer], what)
        o.done, o.array = True, None
        S["collective_seconds"] += time.perf_counter() - t0

    def send(self, tensors, dstRank, tag=0):
        if self._split(tensors) == "cpu":
            return self._gloo.send(tensors, dstRank, tag)
        return _P2PWork(self, self._post("send", tensors, dstRank))

    def recv(self, tensors, srcRank, tag=0):
        if self._split(tensors) == "cpu":
            return self._gloo.recv(tensors, srcRank, tag)
        return _P2PWork(self, self._post("recv", tensors, srcRank), source=srcRank)

    def recv_anysource(self, tensors, tag=0):
        if self._split(tensors) == "cpu":
            return self._gloo.recv_anysource(tensors, tag)
        raise RuntimeError("recv without a source rank is not supported for tpu tensors (each "
                           "send and its recv run as one XLA program between two processes): "
                           "give src=")
