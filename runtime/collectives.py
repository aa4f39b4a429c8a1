"""Collectives across processes as XLA programs: JAX arrays in, JAX arrays out.

Each process holds one block (its local array, on its own device); a collective is a
``jax.jit(shard_map(...))`` over a one-axis mesh of the group's devices, one device per process,
so XLA runs it with its own collectives (gloo on CPU, ICI/DCN on TPU, NCCL on GPU). No transport of
our own. Programs are cached by structure (kind, block shape and dtype, devices, static
arguments), bounded and counted.
"""
from __future__ import annotations

import functools
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from . import stats
from .dtypes import x64

try:
    from jax import shard_map as _shard_map
except ImportError:     # pragma: no cover (older JAX)
    from jax.experimental.shard_map import shard_map as _shard_map
shard_map = _shard_map

AXIS = "g"
MAX_PROGRAMS = 512
OPS = ("sum", "avg", "product", "min", "max", "band", "bor", "bxor", "premul_sum")
_PROGRAMS: dict = {}        # structure -> (jitted fn, input sharding)
_MESHES: dict = {}          # devices -> (Mesh, NamedSharding)
S = stats.S


def clear() -> None:
    _PROGRAMS.clear()


def devices_of(process_ids, local_index: int = 0) -> tuple:
    """The device of each process in ``process_ids`` (its ``local_index``-th device): one device
    per process, the group's mesh."""
    by_proc: dict = {}
    for d in jax.devices():
        by_proc.setdefault(d.process_index, []).append(d)
    out = []
    for p in process_ids:
        ds = sorted(by_proc.get(p, ()), key=lambda d: d.id)
        if local_index >= len(ds):
            raise RuntimeError(f"process {p} has {len(ds)} device(s) of JAX's "
                               f"{jax.default_backend()} backend, not a device {local_index}")
        out.append(ds[local_index])
    return tuple(out)


def mesh_of(devices: tuple):
    """(the one-axis Mesh of ``devices``, the sharding of dim 0 over it), cached."""
    m = _MESHES.get(devices)
    if m is None:
        mesh = Mesh(np.array(devices, dtype=object), (AXIS,))
        m = _MESHES[devices] = (mesh, NamedSharding(mesh, P(AXIS)))
    return m


def _program(key, devices, body):
    """The cached ``jit(shard_map(body))`` of one collective structure."""
    prog = _PROGRAMS.get(key)
    if prog is None:
        if len(_PROGRAMS) >= MAX_PROGRAMS:
            _PROGRAMS.clear()
            S["collective_evictions"] += 1
        mesh, sharding = mesh_of(devices)
        fn = jax.jit(_shard_map(body, mesh=mesh, in_specs=P(AXIS), out_specs=P(AXIS)))
        prog = _PROGRAMS[key] = (fn, sharding, [False])
    return prog


def _run(key, devices, body, x):
    """Run collective ``body`` (a function of this process's block under the mesh axis) on the
    local array ``x`` (a 0-d array runs as shape (1,)); returns this process's block of the
    result."""
    fn, sharding, compiled = _program(key, devices, body)
    local = x.reshape(1) if x.ndim == 0 else x
    shape = (len(devices) * local.shape[0],) + tuple(local.shape[1:])
    t0 = time.perf_counter()
    with x64(True):
        g = jax.make_array_from_single_device_arrays(shape, sharding, [local])
        out = fn(g)
    if not compiled[0]:
        compiled[0] = True
        S["collective_compiles"] += 1
        S["compile_seconds"] += time.perf_counter() - t0
    return out.addressable_data(0)


def _combine(op: str, dtype):
    """The elementwise reduction of ``op`` for values of ``dtype`` (bool: logical)."""
    if dtype == np.bool_:
        return {"sum": jnp.logical_or, "max": jnp.logical_or, "bor": jnp.logical_or,
                "product": jnp.logical_and, "min": jnp.logical_and, "band": jnp.logical_and,
                "bxor": jnp.logical_xor}[op]
    return {"sum": jnp.add, "product": jnp.multiply, "min": jnp.minimum, "max": jnp.maximum,
            "band": jnp.bitwise_and, "bor": jnp.bitwise_or, "bxor": jnp.bitwise_xor}[op]


def check_op(op: str, dtype) -> None:
    """Raise as PyTorch's backends do for a reduction a dtype cannot take."""
    dtype = np.dtype(dtype)
    if op in ("band", "bor", "bxor") and not (jnp.issubdtype(dtype, jnp.integer)
                                            or dtype == np.bool_):
        raise RuntimeError(f"ReduceOp.{op.upper()} needs an integer or bool tensor, got {dtype}")
    if op in ("min", "max") and jnp.issubdtype(dtype, jnp.complexfloating):
        raise RuntimeError(f"ReduceOp.{op.upper()} is not defined for complex tensors ({dtype})")
    if op in ("avg", "premul_sum") and dtype == np.bool_:
        raise RuntimeError(f"ReduceOp.{op.upper()} is not defined for bool tensors")


def _reduce_block(x, op: str, n: int, factor):
    """The reduction of every process's ``x`` (this process's block), under the mesh axis."""
    dt = x.dtype
    if op == "premul_sum":
        x = (x * jnp.asarray(factor, dtype=dt)).astype(dt)
        op = "sum"
    if dt == np.bool_ and op in ("sum", "max", "bor", "min", "product", "band"):
        # XLA's all-reduce of bool is the logical or / and through uint8's max / min.
        y = x.astype(jnp.uint8)
        f = jax.lax.pmax if op in ("sum", "max", "bor") else jax.lax.pmin
        return f(y, AXIS).astype(jnp.bool_)
    if op in ("sum", "avg"):
        s = jax.lax.psum(x, AXIS)
        if op == "avg":
            if jnp.issubdtype(dt, jnp.integer):
                s = jax.lax.div(s, jnp.asarray(n, dt))      # truncation, as integer division
            else:
                s = (s / n).astype(dt)
        return s
    if op == "max":
        return jax.lax.pmax(x, AXIS)
    if op == "min":
        return jax.lax.pmin(x, AXIS)
    # product and bitwise reductions: gather every block, reduce in rank order
    g = jax.lax.all_gather(x, AXIS)
    f = _combine(op, dt)
    return functools.reduce(f, [g[i] for i in range(n)]).astype(dt)


def _alone(x, op: str = "sum", factor=None):
    """A collective of one process: its own value (scaled, for ``premul_sum``), in a new buffer
    (never the input's: the memory planner may donate that one)."""
    if op == "premul_sum":
        return (x * jnp.asarray(factor, dtype=x.dtype)).astype(x.dtype)
    return jnp.copy(x)


def all_reduce(x, devices: tuple, op: str = "sum", factor=None):
    """Every process gets the reduction (``op``, one of ``OPS``) of all processes' ``x``."""
    n = len(devices)
    if n == 1:
        return _alone(x, op, factor)
    key = ("all_reduce", x.shape, x.dtype, devices, op, factor)
    return _run(key, devices, lambda b: _reduce_block(b, op, n, factor), x).reshape(x.shape)


def all_gather(x, devices: tuple):
    """Every process gets ``stack([x of process 0, x of process 1, ...])``."""
    if len(devices) == 1:
        return x[None]
    key = ("all_gather", x.shape, x.dtype, devices)
    out = _run(key, devices, lambda b: jax.lax.all_gather(b, AXIS), x)
    return out.reshape((len(devices),) + x.shape)


def reduce_scatter(x, devices: tuple, op: str = "sum", factor=None):
    """Process i gets block i (of ``x.shape[0] // n`` rows) of the reduction of every ``x``."""
    n = len(devices)
    if n == 1:
        return _alone(x, op, factor)
    key = ("reduce_scatter", x.shape, x.dtype, devices, op, factor)
    return _run(key, devices, lambda b: _reduce_scatter_block(b, op, n, factor), x)


def _reduce_scatter_block(b, op: str, n: int, factor):
    """Block i (of ``b.shape[0] // n`` rows) of the reduction of every process's ``b``, for
    process i, under the mesh axis."""
    if op in ("sum", "avg", "premul_sum") and b.dtype != np.bool_:
        dt = b.dtype
        if op == "premul_sum":
            b = (b * jnp.asarray(factor, dtype=dt)).astype(dt)
        s = jax.lax.psum_scatter(b, AXIS, scatter_dimension=0, tiled=True)
        if op == "avg":
            s = jax.lax.div(s, jnp.asarray(n, dt)) if jnp.issubdtype(dt, jnp.integer) \
                else (s / n).astype(dt)
        return s
    # the others: exchange blocks, then reduce what arrived, in rank order
    k = b.shape[0] // n
    got = jax.lax.all_to_all(b, AXIS, 0, 0, tiled=True).reshape((n, k) + b.shape[1:])
    f = _combine("sum" if op == "avg" else op, b.dtype)
    return functools.reduce(f, [got[i] for i in range(n)]).astype(b.dtype)


def all_to_all(x, devices: tuple):
    """Split ``x`` into n blocks along dim 0; process j's block i goes to process i, in slot j."""
    if len(devices) == 1:
        return _alone(x)
    key = ("all_to_all", x.shape, x.dtype, devices)
    return _run(key, devices, lambda b: jax.lax.all_to_all(b, AXIS, 0, 0, tiled=True), x)


_BITS = {1: jnp.int8, 2: jnp.int16, 4: jnp.int32, 8: jnp.int64}


def broadcast(x, devices: tuple, src: int):
    """Every process gets process ``src``'s ``x`` (bit for bit: -0.0 and NaN payloads too)."""
    if len(devices) == 1:
        return _alone(x)
    key = ("broadcast", x.shape, x.dtype, devices, src)
    return _run(key, devices, lambda b: _broadcast_block(b, src), x).reshape(x.shape)


def _broadcast_block(b, src: int):
    """Process ``src``'s ``b`` (bit for bit), under the mesh axis."""
    me = jax.lax.axis_index(AXIS)
    as_int = _BITS.get(b.dtype.itemsize)
    if as_int is None or jnp.issubdtype(b.dtype, jnp.complexfloating):
        return jax.lax.all_gather(b, AXIS)[src]
    # Everyone else adds zeros: an integer sum of the bit patterns is exact.
    bits = b.astype(jnp.uint8) if b.dtype == np.bool_ else jax.lax.bitcast_convert_type(b, as_int)
    bits = jnp.where(me == src, bits, jnp.zeros_like(bits))
    s = jax.lax.psum(bits, AXIS)
    return s.astype(jnp.bool_) if b.dtype == np.bool_ else jax.lax.bitcast_convert_type(s, b.dtype)


def scatter(x, devices: tuple, src: int):
    """Process i gets block i (of ``x.shape[0] // n`` rows) of process ``src``'s ``x``; the other
    processes' ``x`` (of the same shape) is not read. Bit for bit, as ``broadcast``."""
    n = len(devices)
    if n == 1:
        return _alone(x)
    key = ("scatter", x.shape, x.dtype, devices, src)

    def body(b):
        me = jax.lax.axis_index(AXIS)
        as_int = _BITS.get(b.dtype.itemsize)
        if as_int is None or jnp.issubdtype(b.dtype, jnp.complexfloating):
            k = b.shape[0] // n
            got = jax.lax.all_to_all(b, AXIS, 0, 0, tiled=True)
            return got[src * k:(src + 1) * k]
        bits = b.astype(jnp.uint8) if b.dtype == np.bool_ else jax.lax.bitcast_convert_type(b, as_int)
        bits = jnp.where(me == src, bits, jnp.zeros_like(bits))
        s = jax.lax.psum_scatter(bits, AXIS, scatter_dimension=0, tiled=True)
        return s.astype(jnp.bool_) if b.dtype == np.bool_ else jax.lax.bitcast_convert_type(s, b.dtype)
    return _run(key, devices, body, x)


def permute(x, devices: tuple, pairs: tuple):
    """Process ``dst`` gets process ``src``'s ``x`` for each (src, dst) in ``pairs`` (indices into
    ``devices``); a process that receives nothing gets zeros."""
    key = ("permute", x.shape, x.dtype, devices, pairs)
    return _run(key, devices, lambda b: jax.lax.ppermute(b, AXIS, list(pairs)), x).reshape(x.shape)


def failed_in_xla(e: BaseException) -> bool:
    """Whether ``e`` is a collective failing inside XLA (a peer's connection closed, a timeout in
    its transport), not an error in how it was called: JAX raises those as JaxRuntimeError, or as
    a ValueError whose message starts with the status code ('UNKNOWN: Gloo all-reduce failed')."""
    import re
    return isinstance(e, jax.errors.JaxRuntimeError) or (
        isinstance(e, ValueError) and re.match(r"[A-Z_]+: ", str(e)) is not None)


def ready(arrays) -> bool:
    """Whether every array is computed (or failed: reading it raises)."""
    for a in arrays:
        try:
            if not a.is_ready():
                return False
        except Exception:   # deleted (donated since): computed long ago
            pass
    return True


def block(arrays) -> None:
    """Wait for ``arrays``; raises the error of a collective that failed."""
    for a in arrays:
        try:
            a.block_until_ready()
        except RuntimeError as e:
            if "deleted" in str(e).lower():
                continue
            raise


# NOTE [collectives in programs]: a compiled graph (Dynamo and AOTAutograd) that holds functional
# collectives (``_c10d_functional.*``: tensor parallelism, DTensor) runs as one program over the
# group's processes, a ``jit(shard_map(...))`` like the collectives above, its collectives lowered
# in place by ``in_program``: the graph's other ops are each process's own (its block), and a
# collective is XLA's, between them. ``wait_tensor`` has nothing to wait for inside a program.
IN_PROGRAM = ("all_reduce", "all_reduce_coalesced", "all_gather_into_tensor",
              "all_gather_into_tensor_coalesced", "reduce_scatter_tensor",
              "reduce_scatter_tensor_coalesced", "all_to_all_single", "broadcast", "wait_tensor")


def in_program(name: str, args: tuple, n: int):
    """``_c10d_functional.<name>`` on ``args`` (arrays for its tensors; its group name last) in a
    program under the mesh axis of the group's ``n`` processes (NOTE [collectives in programs])."""
    if name == "wait_tensor":
        return args[0]
    if name in ("all_reduce", "all_reduce_coalesced"):
        op = args[1].lower()
        for x in (args[0] if name == "all_reduce_coalesced" else (args[0],)):
            check_op(op, x.dtype)
        if name == "all_reduce":
            return _reduce_block(args[0], op, n, None)
        return [_reduce_block(x, op, n, None) for x in args[0]]
    if name == "all_gather_into_tensor":
        return _gather_block(args[0])
    if name == "all_gather_into_tensor_coalesced":
        return [_gather_block(x) for x in args[0]]
    if name in ("reduce_scatter_tensor", "reduce_scatter_tensor_coalesced"):
        op = args[1].lower()
        if name == "reduce_scatter_tensor":
            check_op(op, args[0].dtype)
            return _reduce_scatter_block(args[0], op, n, None)
        return [_reduce_scatter_block(x, op, n, None) for x in args[0]]
    if name == "all_to_all_single":      # even splits only (GraphPlan checks)
        return jax.lax.all_to_all(args[0], AXIS, 0, 0, tiled=True)
    if name == "broadcast":
        return _broadcast_block(args[0], args[1])
    raise ValueError(f"no lowering of _c10d_functional.{name} in a program")


def _gather_block(b):
    """Every process's ``b`` concatenated along dim 0 (stacked, for 0-d), under the mesh axis."""
    return jax.lax.all_gather(b, AXIS, tiled=b.ndim > 0)
