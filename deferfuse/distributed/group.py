"""The ``tpu`` process group: torch.distributed's collectives on tpu tensors, run as XLA collectives
(runtime/collectives.py) across the processes of the job; CPU tensors go to a gloo group it owns,
as NCCL groups leave CPU tensors to gloo.

Every collective on tpu tensors follows the same steps (``_collective``): in defer mode it is a sync
point (the pending trace is dispatched, reason ``collective``, cut at the same op on every rank);
the ranks agree on it (NOTE [collective check] in coord.py); the inputs' JAX arrays go to one XLA
program over the group's devices; its results become the values of the output tensors; and, unless
``DEFERFUSE_DIST_WAIT=async``, the caller waits for them, so a rank that fails meanwhile is named
in a ``DistributedError`` here rather than in an XLA error at some later read. The collectives
themselves are ``Collectives``' methods (collective_ops.py); ``send`` and ``recv`` are
``PointToPoint``'s (p2p.py: NOTE [p2p matching]).
"""
from __future__ import annotations

import functools
import time
from datetime import timedelta

import torch
from torch._C._distributed_c10d import PrefixStore, ProcessGroup, ProcessGroupGloo

from ..scheduler.policy import Sync
from ..engine import engine
from ..config import config
from ..dispatch import user_frame
from ..runtime import collectives as xc
from ..runtime import stats
from ..runtime.cluster import CLUSTER
from ..tensor import TpuTensor, as_tpu
from .arrays import describe
from .collective_ops import Collectives
from .coord import COORD
from .p2p import PointToPoint

S = stats.S
_DEFAULT_TIMEOUT = timedelta(minutes=30)    # torch's default_pg_timeout: not a choice the user made


class ProcessGroupTPU(PointToPoint, Collectives, ProcessGroup):
    """A process group of ``tpu`` tensors on JAX's distributed runtime (see the module's doc)."""

    def __init__(self, store, rank: int, size: int, timeout: timedelta, name: str,
                 global_ranks: list):
        super().__init__(rank, size)
        self._ranks = list(global_ranks) or list(range(size))
        self._gname = str(name)
        self._seq = 0
        self._p2p_seq: dict = {}
        self._p2p_pending: list = []    # posted sends and recvs, in posting order
        self._devs: dict = {}
        self._timeout = (config.dist_timeout if timeout == _DEFAULT_TIMEOUT
                         else timeout.total_seconds())
        self._gloo = ProcessGroupGloo(PrefixStore("gloo/", store), rank, size,
                                      timedelta(seconds=self._timeout))
        # Registered for both devices: the group's name lives on its backends (functional
        # collectives, DeviceMesh), and init_process_group(device_id=tpu) asks the tpu one. The
        # collectives themselves are this class's methods: gloo only ever sees CPU tensors.
        for device in ("cpu", "tpu"):
            self._register_backend(torch.device(device), ProcessGroup.BackendType.GLOO,
                                   self._gloo)

    def getBackendName(self):
        return "tpu"

    def __repr__(self):
        return f"ProcessGroupTPU(rank={self.rank()}, size={self.size()}, ranks={self._ranks})"

    # --- the common path -----------------------------------------------------------------------
    def _devices(self, index: int, ranks=None) -> tuple:
        key = (index, ranks)
        d = self._devs.get(key)
        if d is None:
            d = self._devs[key] = xc.devices_of(ranks or self._ranks, index)
        return d

    def _split(self, tensors):
        """'tpu' if every tensor is a tpu tensor, 'cpu' if none is; else raise as PyTorch does for
        tensors on two devices."""
        tpu = [type(t) is TpuTensor for t in tensors]
        if all(tpu):
            return "tpu"
        if not any(tpu):
            return "cpu"
        other = next(t for t, k in zip(tensors, tpu) if not k)
        raise RuntimeError("Expected all tensors of a collective on one device, found tpu and "
                           f"{other.device}; move the {other.device} tensors with .to('tpu')")

    def _collective(self, kind: str, detail: str, tensors, run, scope=None, peers=None,
                    shapes=None, check=True):
        """Steps shared by every collective on tpu tensors (see the module's doc). ``run(devices)``
        does the JAX part, writes the outputs and returns the arrays it made. ``check=False``:
        the caller had the ranks agree already (a compiled graph: ``SpmdGraph.agree``)."""
        t0 = time.perf_counter()
        dev = tensors[0]._s.device if tensors else 0
        if any(t._s.device != dev for t in tensors):
            raise RuntimeError(f"a collective takes tensors on one tpu device, got tpu:{dev} and "
                               f"tpu:{next(t._s.device for t in tensors if t._s.device != dev)}")
        trace = ""
        trace_now = engine.state.trace
        if trace_now.nodes:
            # Shown when ranks disagree: whether the ops each recorded before it differ too.
            trace = (f" (after a recorded trace of {len(trace_now.nodes)} ops, structure "
                     f"{trace_now.h & 0xffffffff:08x})")
            engine.sync(Sync.COLLECTIVE, op=kind)
        ranks = peers or self._ranks
        me = CLUSTER.rank
        if scope is None:
            seq, self._seq = self._seq, self._seq + 1
            scope = self._gname
        else:
            seq = self._p2p_seq.get(scope, 0)
            self._p2p_seq[scope] = seq + 1
        what = f"{kind} (collective #{seq} of group {self._gname})"
        if check and len(ranks) > 1 and COORD.client is not None and (
                config.dist_check or kind == "barrier"):
            desc = (f"{kind}({detail}) " + (shapes or " ".join(describe(t) for t in tensors))
                    + f" tpu:{dev}")
            t1 = time.perf_counter()
            COORD.exchange(scope, seq, me, ranks, desc, user_frame() + trace, what,
                           self._timeout)
            S["collective_check_seconds"] += time.perf_counter() - t1
        others = [r for r in ranks if r != me]
        self._execute(kind, tensors, run, self._devices(dev, None if peers is None
                                                        else tuple(peers)), others, what)
        S["collective_seconds"] += time.perf_counter() - t0

    def _execute(self, kind, tensors, run, devices, others, what) -> None:
        """Run ``run(devices)`` (the JAX part of a collective) and, unless
        ``DEFERFUSE_DIST_WAIT=async``, wait for its arrays, naming a failed peer."""
        try:
            with xc.x64(True):
                arrays = run(devices)
        except Exception as e:
            if xc.failed_in_xla(e):     # CPU runs small programs at once: failures show here
                raise COORD.explain(e, others, what) from e
            raise
        S["collectives"][kind] += 1
        S["collective_bytes"] += sum(t.numel() * t.element_size() for t in tensors)
        if arrays and config.dist_wait == "block":
            t1 = time.perf_counter()
            COORD.wait(lambda: xc.ready(arrays), others, what, self._timeout)
            try:
                xc.block(arrays)
            except Exception as e:
                raise COORD.explain(e, others, what) from e
            S["collective_wait_seconds"] += time.perf_counter() - t1


def _tpu_tree(a):
    """Tensor arguments as ``TpuTensor``s (``tensor.as_tpu``: a plain tpu tensor's is over the
    same Storage, so what a collective writes into it is the plain tensor's value), in lists too."""
    if type(a) is list:
        return [_tpu_tree(x) for x in a]
    return as_tpu(a)


def _taking_plain(method):
    """NOTE [mixed arguments] in plain.py, for the collectives: they read ``_s`` and ``_chain``,
    so plain tpu tensors come in as the ``TpuTensor``s over their storages."""
    @functools.wraps(method)
    def run(self, *args, **kwargs):
        return method(self, *[_tpu_tree(a) for a in args], **kwargs)
    return run


def plain_collectives() -> None:
    """Wrap every collective of ``ProcessGroupTPU`` with ``_taking_plain`` (plain.install)."""
    for name in ("allreduce", "allreduce_coalesced", "broadcast", "reduce", "all_gather_single",
                 "all_gather_single_coalesced", "allgather", "allgather_coalesced", "gather",
                 "reduce_scatter_single", "reduce_scatter_single_coalesced", "reduce_scatter",
                 "scatter", "alltoall_base", "alltoall", "send", "recv", "recv_anysource"):
        m = getattr(ProcessGroupTPU, name)     # Collectives' methods; send/recv: PointToPoint's
        if not hasattr(m, "__wrapped__"):
            setattr(ProcessGroupTPU, name, _taking_plain(m))


def create(opts, backend_options=None):
    """The ``tpu`` backend's constructor (``dist.Backend.register_backend(..., extended_api=True)``)."""
    size = opts.group_size
    if size > 1 and CLUSTER.client is None:
        why = CLUSTER.error or (
            "deferfuse starts it at import from torchrun's RANK/WORLD_SIZE/MASTER_ADDR/"
            "MASTER_PORT, and they were not set then")
        raise RuntimeError(
            f"the tpu process group of {size} processes needs JAX's distributed runtime: {why}. "
            "Launch with torchrun (or set those variables before importing deferfuse); see "
            "docs/distributed.md")
    if not opts.global_ranks_in_group and size > 1 and opts.group_rank != CLUSTER.rank:
        raise RuntimeError(f"torch rank {opts.group_rank} runs in JAX process {CLUSTER.rank}: "
                           "JAX's distributed runtime was started with other process ids than "
                           "torch's ranks")
    COORD.start(config.dist_timeout)
    return ProcessGroupTPU(opts.store, opts.group_rank, size, opts.timeout, opts.group_id,
                           list(opts.global_ranks_in_group))
