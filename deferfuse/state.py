"""Mode, the pending trace, RNG state: the module state the dispatcher consults on every op."""
from __future__ import annotations

import gc
import sys

import jax
import torch

from .config import config
from .runtime import execute, flush, stats
from .runtime.dtypes import x64
from .runtime.transfer import devices, materialize_empty

MODE = config.mode          # the current mode; changed only through deferfuse.mode()
_stack: list = []
# NOTE [gc threshold] (deferfuse/__init__.py): Python's young-generation threshold before deferfuse
# raised it, and the raised one (0, 0: left alone). Raised in defer mode only.
YOUNG_GC = 0
RAISED_GC = 0


def set_mode(m: str) -> None:
    global MODE
    if MODE == "defer" and m != "defer":
        sync("mode exit")
    MODE = m
    if YOUNG_GC:
        t = gc.get_threshold()
        want = RAISED_GC if m == "defer" else YOUNG_GC
        if t[0] != want and t[0] in (YOUNG_GC, RAISED_GC):     # not one the program set since
            gc.set_threshold(want, *t[1:])


def run_node(entry, ins, scalars, dev):
    if MODE == "defer":
        return trace.record(entry, ins, scalars)
    for v in ins:
        if v is not None and v.array is None:
            if v.node is not None:
                sync("mode exit")
            else:
                materialize_empty(v, dev)
    return execute.run_op(entry, ins, scalars, MODE == "debug")


_ASYNC_CUTS = flush.ASYNC_CUTS


def backward_cut() -> bool:
    """Whether NOTE [backward cut] (deferfuse/device.py) applies (``DEFERFUSE_BACKWARD_CUT``, on by
    default; older settings said ``auto``, which now means on)."""
    return bool(config.backward_cut)


def sync(reason: str, op: str | None = None, want=None, later: bool = False) -> None:
    """Run the pending trace now (a sync point), recording why and from which line. ``want``: the
    one pending Value the caller reads (``.item()``, ``.cpu()``), when that is all it needs (see
    NOTE [needed first] in runtime/flush.py); ``later``: the caller reads a value computed before
    the trace, so the host waits for none of it, and its index checks are read at the next sync."""
    if not trace.nodes:
        if reason not in _ASYNC_CUTS:
            flush.check_flags(later=want is None and not later)
        return
    from .dispatch import user_frame
    src = user_frame()
    stats.S["syncs"][reason] += 1
    stats.S["sync_sites"][(reason, src)] += 1
    if config.debug >= 1:
        print(f"[deferfuse] sync: {reason}{' (' + op + ')' if op else ''} at {src}, "
              f"{len(trace.nodes)} ops", file=sys.stderr)
    trace.flush(reason, src, want, later)
    if YOUNG_GC and gc.get_count()[0] > YOUNG_GC:
        # The trace is gone: collect what Python's own threshold would have by now (cyclic
        # garbage holding device buffers must not wait for the raised one).
        gc.collect(0)
    if reason not in _ASYNC_CUTS:
        # Values are read now: report an out-of-range index recorded in what just ran (in what
        # the read waited for, when it read one value).
        flush.check_flags(later=want is None and not later)


# --- RNG: one PRNG key per device, held in a Storage so defer threads it through regions --------
_rng: dict = {}
_seed = [0]


def rng_storage(dev: int):
    st = _rng.get(dev)
    if st is None:
        st = _rng[dev] = _new_key(_seed[0], dev)
    return st


def _new_key(seed: int, dev: int):
    from .scheduler.records import Value
    from .tensor import Storage
    import numpy as np
    with x64(True):
        k = jax.device_put(jax.random.PRNGKey(seed & 0xFFFFFFFFFFFFFFFF), devices()[dev])
    return Storage(Value((2,), np.dtype(np.uint32), 8, array=k), dev, torch.int64)


def generator_key(gen, dev: int):
    """A fresh key Value for one op that was given ``generator=`` (NOTE [generators] in
    dispatch.py): a 63-bit seed drawn from the generator, which advances it as a draw would."""
    if gen.device.type != "cpu":
        raise RuntimeError(f"expected a CPU torch.Generator for a tpu op, got one on {gen.device}")
    seed = int(torch.randint(0, 2 ** 63 - 1, (), generator=gen))
    return _new_key(seed, dev).val


def manual_seed(seed: int) -> None:
    sync("manual_seed")
    _seed[0] = int(seed)
    for d in list(_rng) or [0]:
        _rng[d] = _new_key(int(seed), d)


def rng_state(dev: int) -> torch.Tensor:
    st = rng_storage(dev)
    if st.val.array is None:
        sync("rng state")
    import numpy as np
    return torch.from_numpy(np.asarray(jax.device_get(st.val.array)).astype(np.int64))


def set_rng_state(state: torch.Tensor, dev: int) -> None:
    from .scheduler.records import Value
    from .tensor import Storage
    import numpy as np
    sync("rng state")
    a = state.detach().cpu().numpy().astype(np.uint32)
    if a.shape != (2,):
        raise RuntimeError(f"expected an RNG state of 2 elements from torch.tpu.get_rng_state(), got shape {tuple(a.shape)}")
    with x64(True):
        k = jax.device_put(a, devices()[dev])
    _rng[dev] = Storage(Value((2,), np.dtype(np.uint32), 8, array=k), dev, torch.int64)


from .record import Trace  # noqa: E402

trace = Trace()
