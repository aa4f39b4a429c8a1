"""Make ``tpu`` a PyTorch device: PrivateUse1 renamed, device guard and hooks, ``torch.tpu``.

The device itself (PrivateUse1 renamed, PyTorch's experimental
``_setup_privateuseone_for_python_backend`` with its device guard, without which the first
``backward()`` through a tpu tensor aborts the interpreter) is registered by the top-level
``deferfuse_autoload`` module, at ``import torch`` through the ``torch.backends`` entry point or
here; ``register`` then fills ``torch.tpu`` and registers the kernels.
"""
from __future__ import annotations

import functools
import sys
import threading
import types

import torch

from . import cxxext, device_info, plain
from .config import config
from .engine import engine, user_error
from .runtime import platform
from .scheduler.policy import Cut, CutPolicy, Sync
from .tensor import _DEVICES

_lib = None


def _device_count() -> int:
    return len(platform.jax_devices())


def _set_device(device) -> None:
    """``torch.tpu.set_device``: the calling thread's current device (as CUDA's, per thread)."""
    engine.state.device = device_info.index(device)
    if plain.PLAIN is not None:     # the C++ guard's current device (NOTE [plain device guard])
        plain.PLAIN.ext.set_device(engine.state.device)


_idx = device_info.index


def _synchronize(device=None) -> None:
    engine.sync(Sync.SYNCHRONIZE)
    from .runtime import execute
    execute.wait_all()


def _manual_seed(seed) -> None:
    """``torch.tpu.manual_seed``: the current device's generator (as CUDA's)."""
    engine.rng.manual_seed(int(seed), engine.state.device)


def _manual_seed_all(seed) -> None:
    engine.rng.manual_seed_all(int(seed))


def _get_rng_state(device="tpu") -> torch.Tensor:
    """The 16-byte state of the device's generator: seed then offset (CUDA's layout)."""
    return engine.rng.generator(_idx(device)).get_state()


def _set_rng_state(new_state, device="tpu") -> None:
    engine.rng.generator(_idx(device)).set_state(new_state)


def _seed() -> int:
    return engine.rng.generator(engine.state.device).seed()


def _seed_all() -> int:
    s = _seed()
    _manual_seed_all(s)
    return s


def _initial_seed() -> int:
    return engine.rng.generator(engine.state.device).initial_seed()


class _DefaultGenerators:
    """``torch.tpu.default_generators``: each device's generator, made on first use (counting the
    devices starts JAX, which must wait until a distributed job has initialised it)."""

    def __len__(self):
        return _device_count()

    def __getitem__(self, i):
        return tuple(self)[i]

    def __iter__(self):
        return iter([engine.rng.generator(i) for i in range(_device_count())])


class _DeviceCtx:
    """``torch.tpu.device(i)``: a context that makes tpu:i current."""

    def __init__(self, device):
        self.idx = _idx(device)

    def __enter__(self):
        self.prev = engine.state.device
        _set_device(self.idx)

    def __exit__(self, *exc):
        engine.state.device = self.prev


def _make_module() -> types.ModuleType:
    m = types.ModuleType("torch.tpu")
    m.__doc__ = "The tpu device (deferfuse): the calls PyTorch code commonly makes on torch.cuda."
    m.is_available = lambda: True
    m.is_initialized = lambda: True
    m._initialized = True       # torch.utils.checkpoint saves the device's RNG state only then
    m._is_in_bad_fork = lambda: False
    m.device_count = _device_count
    m.current_device = lambda: engine.state.device
    m.set_device = _set_device
    m.device = _DeviceCtx
    m.synchronize = _synchronize
    m.manual_seed = _manual_seed
    m.manual_seed_all = _manual_seed_all
    m.seed = _seed
    m.seed_all = _seed_all
    m.initial_seed = _initial_seed
    m.default_generators = _DefaultGenerators()
    m.get_rng_state = _get_rng_state
    m.set_rng_state = _set_rng_state
    m.get_rng_state_all = lambda: [_get_rng_state(f"tpu:{i}") for i in range(_device_count())]
    m.set_rng_state_all = lambda states: [_set_rng_state(s, f"tpu:{i}") for i, s in enumerate(states)]
    d = device_info
    m.memory_allocated = d.memory_allocated
    m.max_memory_allocated = d.max_memory_allocated
    m.reset_peak_memory_stats = d.reset_peak_memory_stats
    m.reset_max_memory_allocated = d.reset_peak_memory_stats
    m.reset_accumulated_memory_stats = d.reset_accumulated_memory_stats
    m.memory_stats = d.memory_stats
    m.memory_stats_as_nested_dict = d.memory_stats_as_nested_dict
    m.memory_reserved = d.memory_allocated        # nothing is cached: reserved is allocated
    m.max_memory_reserved = d.max_memory_allocated
    m.mem_get_info = d.mem_get_info
    m.empty_cache = lambda: None
    m.get_device_properties = d.get_device_properties
    m.get_device_name = d.get_device_name
    m.get_device_capability = d.get_device_capability
    m.is_bf16_supported = lambda *a, **k: True
    m.get_amp_supported_dtype = lambda: [torch.bfloat16, torch.float16]
    m._lazy_init = lambda: None
    m.memory = _memory_module(m)
    from . import streams
    streams.install(m)
    return m


def _memory_module(m) -> types.ModuleType:
    """``torch.tpu.memory``, as ``torch.cuda.memory``: the counters, and the memory-history calls
    a profiler makes (TorchTitan's memory snapshot). XLA keeps no allocation history: recording is
    accepted and the snapshot is empty (no segments, no traces)."""
    mem = types.ModuleType("torch.tpu.memory")
    for name in ("memory_allocated", "max_memory_allocated", "memory_reserved",
                 "max_memory_reserved", "memory_stats", "memory_stats_as_nested_dict",
                 "reset_peak_memory_stats", "reset_accumulated_memory_stats", "mem_get_info",
                 "empty_cache"):
        setattr(mem, name, getattr(m, name))
    mem._record_memory_history = lambda *a, **k: None
    mem._snapshot = lambda device=None: {"segments": [], "device_traces": [[]]}

    def _dump_snapshot(filename="dump_snapshot.pickle"):
        import pickle
        with open(filename, "wb") as f:
            pickle.dump(mem._snapshot(), f)
    mem._dump_snapshot = _dump_snapshot
    return mem


def _patch_default_dtype() -> None:
    """NOTE [default dtype]: an op's output dtype can follow the default dtype (a factory with no
    dtype, an integer tensor divided, ``sqrt`` of one), but op keys hold the arguments, not the
    default dtype: the entries and programs made under one default would answer for another
    (``torch.zeros(2, device="tpu")`` after ``torch.set_default_dtype(torch.float64)`` was float32
    when float32's entry came first). Changing the default is rare and happens between steps, so a
    change syncs and drops the in-process caches, as ``deferfuse.clear_caches()`` does; the
    entries kept on disk hold the default dtype in their key (NOTE [entries on disk])."""
    orig = torch.set_default_dtype
    if getattr(orig, "_deferfuse", False):
        return

    def set_default_dtype(d):
        before = torch.get_default_dtype()
        orig(d)
        if torch.get_default_dtype() != before:
            from . import clear_caches
            clear_caches()
    set_default_dtype.__doc__ = orig.__doc__
    set_default_dtype.__wrapped__ = orig
    set_default_dtype._deferfuse = True
    torch.set_default_dtype = set_default_dtype


def _patch_accelerator() -> None:
    # The Python device guard cannot implement synchronizeDevice, so torch.accelerator.synchronize
    # would raise "Backend doesn't support synchronizing all streams". Route it to ours.
    acc = torch.accelerator
    orig = acc.synchronize

    def synchronize(device=None):
        if device is None or torch.device(device).type == "tpu":
            return _synchronize(device)
        return orig(device)
    synchronize.__doc__ = orig.__doc__
    acc.synchronize = synchronize
    # Its memory counters ask for a C++ DeviceAllocator (an internal assert for a Python backend),
    # its device index and capability for the device guard, which a Python backend's does not
    # keep: with tpu the accelerator they are ours. Nothing is cached, so reserved is allocated.
    d = device_info
    for name, ours in (("memory_allocated", d.memory_allocated),
                       ("max_memory_allocated", d.max_memory_allocated),
                       ("memory_reserved", d.memory_allocated),
                       ("max_memory_reserved", d.max_memory_allocated),
                       ("reset_peak_memory_stats", d.reset_peak_memory_stats),
                       ("reset_accumulated_memory_stats", d.reset_accumulated_memory_stats),
                       ("memory_stats", d.memory_stats),
                       ("get_memory_info", d.mem_get_info),
                       ("get_device_capability", d.accelerator_capability),
                       ("set_device_index", _set_device),
                       ("set_device_idx", _set_device)):
        if hasattr(acc, name):
            setattr(acc, name, _on_tpu_or(getattr(acc, name), ours))
    for name in ("current_device_index", "current_device_idx"):
        if hasattr(acc, name):
            setattr(acc, name, _on_tpu_or(getattr(acc, name), lambda: engine.state.device,
                                          takes_device=False))
    if hasattr(acc, "empty_cache"):
        acc.empty_cache = _on_tpu_or(acc.empty_cache, lambda: None, takes_device=False)
    # the host (pinned) allocator it empties is one a Python backend has not got: a segfault
    if hasattr(acc, "empty_host_cache"):
        acc.empty_host_cache = _on_tpu_or(acc.empty_host_cache, lambda: None, takes_device=False)


def _on_tpu_or(orig, ours, takes_device=True):
    """``orig`` (a torch.accelerator function) calling ``ours`` when tpu is the accelerator."""
    def fn(*args):
        dev = args[0] if args else None
        if torch.accelerator.current_accelerator().type == "tpu" and (
                dev is None or isinstance(dev, int) or torch.device(dev).type == "tpu"):
            return ours(*args) if takes_device else ours()
        return orig(*args)
    fn.__name__, fn.__doc__ = orig.__name__, orig.__doc__
    return fn


def _keep_tied_parameters() -> None:
    """``module.to("tpu")`` keeps a parameter that several modules share (tied input and output
    embeddings) one parameter, as on CUDA. PyTorch converts a parameter in place (``param.data =``)
    only when the new tensor's type is compatible with the old one, which a wrapper subclass is
    not; otherwise each module's slot gets a new Parameter of its own, so tied weights came apart
    and trained as two. After the conversion, the slots that shared one parameter share again the
    parameter the first of them got (the others' copies are dropped)."""
    orig = torch.nn.Module._apply
    if getattr(orig, "_deferfuse", False):
        return

    def _apply(self, fn, recurse=True):
        if getattr(_APPLYING, "on", False):
            return orig(self, fn, recurse)
        slots: dict = {}
        for mod in (self.modules() if recurse else (self,)):
            for name, p in mod._parameters.items():
                if p is not None:
                    slots.setdefault(id(p), []).append((mod, name))
        _APPLYING.on = True
        try:
            out = orig(self, fn, recurse)
        finally:
            _APPLYING.on = False
        for group in slots.values():
            if len(group) > 1:
                mod, name = group[0]
                p = mod._parameters[name]
                for mod, name in group[1:]:
                    mod._parameters[name] = p
        return out
    _apply._deferfuse = True
    _apply.__doc__ = orig.__doc__
    torch.nn.Module._apply = _apply


_APPLYING = threading.local()


def _wrap_autograd() -> None:
    """``torch.autograd.backward`` (which ``loss.backward()`` calls) and ``torch.autograd.grad``:

    - NOTE [backward cut]: when what they differentiate is on tpu, first dispatch the pending
      trace, which holds the forward pass, and do not wait for it: the device computes the forward
      pass while Python records the backward pass and the optimizer step. When ``loss.item()``
      then reads the loss, it is computed already, or nearly; the read dispatches what is pending
      (the backward pass and the optimizer step) and waits for none of it (dispatch.to_cpu). With
      needed first alone, the forward pass started only at the read, and the host waited for it
      there. A loop that never syncs is cut at every backward() the same way, into one region per
      step (the last step's backward pass and update with this step's forward pass), compiled
      once. The cuts depend on the program only, never on timing. On XLA's CPU backend too:
      there the forward pass computes on the cores Python records on, and a step that reads its
      loss every time gains little (paired in one process, quick sizes, two runs: MLP -4% and
      +9%, convnet +4%, GPT +1% and -2%, Llama +1%), but a loop that reads it every 10 steps ran 20%
      faster (``bench/`` workload ``gpt_train_log10``): without the cut its steps were recorded
      with the device idle and computed only at the read. ``DEFERFUSE_BACKWARD_CUT=0`` turns it
      off. Not after a compiled forward graph: NOTE [no backward cut for graphs] in
      compiled.py.
    - NOTE [backward thread]: run the backward pass on the calling thread, as PyTorch does for CPU
      tensors (``torch.autograd.set_multithreading_enabled(False)``). For an accelerator PyTorch
      hands it to a device thread of its own and blocks the caller; every op of the backward pass is
      Python (our __torch_dispatch__), so the hand-off bought nothing and cost a thread switch and
      the GIL moving between threads (measured, quick sizes, paired in one process: training steps
      5-15% faster in defer mode, about 12% in strict). ``DEFERFUSE_BACKWARD_THREAD=1`` restores the
      device thread.
    - raise the error of a backward op that failed (NOTE [errors in backward] in route.py)."""
    import torch.autograd as autograd
    from . import compiled
    tpu = plain.is_tpu

    def on_tpu(ts) -> bool:
        return tpu(ts) or isinstance(ts, (tuple, list)) and any(tpu(t) for t in ts)

    def wrap(orig, first):
        @functools.wraps(orig)
        def fn(*args, **kwargs):
            if torch.compiler.is_compiling():
                return orig(*args, **kwargs)
            # Held until backward() returns: a handler's exception inside the autograd engine
            # aborted the interpreter (NOTE [interrupt safety] in runtime/interrupts.py).
            engine.interrupts.install()
            with engine.interrupts:
                return run(*args, **kwargs)

        def run(*args, **kwargs):
            ts = engine.state
            roots = args[0] if args else kwargs.get(first)
            nodes = ts.trace.nodes
            if (nodes and ts.mode == "defer" and on_tpu(roots) and CutPolicy.cut_at_backward(
                    len(nodes), compiled.graph_kinds(nodes), config.backward_cut)):
                engine.sync(Cut.BACKWARD)
            errors = ts.backward_errors
            errors.clear()
            hooks = []
            try:
                if config.backward_thread:
                    # The device thread records into this thread's trace, in its mode (NOTE
                    # [threads]): it adopts this thread's state before the first node runs.
                    for r in (roots if isinstance(roots, (tuple, list)) else (roots,)):
                        if isinstance(r, torch.Tensor) and r.grad_fn is not None:
                            hooks.append(r.grad_fn.register_prehook(
                                lambda grads, ts=ts: setattr(engine.local, "ts", ts)))
                    out = orig(*args, **kwargs)
                else:
                    with autograd.set_multithreading_enabled(False):
                        out = orig(*args, **kwargs)
            except Exception:
                if not errors:
                    raise
            finally:
                for h in hooks:
                    h.remove()
            if errors:
                e = errors[0]
                errors.clear()
                raise user_error(e) from None   # the op's own error (NOTE [errors in backward])
            return out
        fn._deferfuse = True
        return fn

    for name, first in (("backward", "tensors"), ("grad", "outputs")):
        orig = getattr(autograd, name)
        if not getattr(orig, "_deferfuse", False):
            setattr(autograd, name, wrap(orig, first))
    # Dynamo's rule maps (by object) built before this (torch._dynamo imported first) name the
    # originals: it skipped the wrappers, breaking a traced backward off its graph. Rebuilt lazily.
    rules = sys.modules.get("torch._dynamo.trace_rules")
    if rules is not None and hasattr(rules, "clear_lru_cache"):
        rules.clear_lru_cache()


def _pin_memory(self, device=None):
    """``Tensor.pin_memory()`` (and ``DataLoader(pin_memory=True)``) with ``tpu`` the accelerator,
    when deferfuse's C++ hooks are not built (NOTE [pinned memory] in deferfuse/_tpu_hooks.cpp):
    PyTorch asks the accelerator's hooks for a pinned-memory allocator, which PyTorch's Python
    hooks cannot provide, so it raised. Transfers to JAX need no pinned memory: this is an ordinary CPU
    copy (``is_pinned()`` stays False). Pinning for another device goes on as before."""
    target = torch.device(device) if device is not None else torch.accelerator.current_accelerator()
    if target is not None and target.type == "tpu":
        return self.clone()
    return torch.ops.aten._pin_memory.default._op_dk(
        torch._C.DispatchKey.CompositeExplicitAutograd, self, device)


def _ctc_loss_cpu_lengths(log_probs, targets, input_lengths, target_lengths, blank=0,
                          reduction=1, zero_infinity=False):
    """``F.ctc_loss`` with lengths given as CPU tensors, as CUDA takes them: its kernel reads them
    as lists of ints. PyTorch's composite for tensor subclasses instead divides the tpu loss by the
    CPU target lengths, a device mismatch; lengths on CPU go through the int-list overload here."""
    if input_lengths.device.type == "cpu" and target_lengths.device.type == "cpu":
        return torch.ops.aten.ctc_loss.IntList(log_probs, targets, input_lengths.tolist(),
                                               target_lengths.tolist(), blank, reduction,
                                               zero_infinity)
    return torch.ops.aten.ctc_loss.Tensor._op_dk(torch._C.DispatchKey.CompositeImplicitAutograd,
                                                 log_probs, targets, input_lengths, target_lengths,
                                                 blank, reduction, zero_infinity)


# NOTE [whole composites]: a few aten ops have a CPU kernel and, for every other device, a
# CompositeImplicitAutograd one (``silu_backward``, ``mish_backward``). With no kernel of ours,
# PyTorch decomposes them above Python dispatch, so on tpu SiLU's backward ran as eight ops, each
# rounding a half-precision result, where CPU's kernel computes in float32 and rounds once: every
# SiLU/SwiGLU model's bfloat16 gradients differed from CPU's
# (tests/test_half.py::test_silu_and_mish_backward_run_whole).
# An AutogradPrivateUse1 kernel sends them whole to the lowering, below autograd; when a gradient
# of the op itself is wanted (create_graph=True) the composite runs, differentiable as before.
WHOLE_COMPOSITES = ("silu_backward", "mish_backward")
_below_autograd = torch._C._AutoDispatchBelowAutograd


def _whole(op):
    composite = torch._C.DispatchKey.CompositeImplicitAutograd

    def kernel(*args, **kwargs):
        if torch.is_grad_enabled() and any(isinstance(a, torch.Tensor) and a.requires_grad
                                           for a in args):
            return op._op_dk(composite, *args, **kwargs)
        with _below_autograd():
            return op(*args, **kwargs)
    return kernel


def register() -> None:
    global _lib
    import deferfuse_autoload
    from . import distributed
    cxxext.require()            # NOTE [tensor representation]: before anything registers
    distributed.register()      # before the first device lookup (NOTE [distributed start])

    # PrivateUse1 renamed, torch.tpu, hooks and guard: done by the autoload entry point at
    # import torch, or now; either way the lazy parts are removed here.
    deferfuse_autoload.begin()
    _DEVICES.extend(torch.device("tpu", i) for i in range(_device_count()))
    _patch_accelerator()
    _patch_default_dtype()
    _keep_tied_parameters()
    _wrap_autograd()
    from . import (amp, attention, compiled, composed, datadep, flex, linear, quantized, rnn,
                   serialization)
    compiled.register()
    amp.register()
    serialization.register()
    attention.register()
    flex.register()
    quantized.register()
    linear.register()
    composed.register()
    datadep.register()
    rnn.register()

    # Factories with device="tpu" and no tpu tensor argument reach the PrivateUse1 key directly
    # (no Python dispatch): give those kernels.
    # Each held: NOTE [interrupt safety] (runtime/interrupts.py).
    held = engine.interrupts.around
    _lib = torch.library.Library("aten", "IMPL")
    # The plain tensor (NOTE [plain router] in plain.py): C++ empty and view kernels and a
    # fallback into the op path; the kernels below that take tpu tensors go through it too.
    dispatch = plain.install().route
    # one_hot is composite: without a backend kernel PyTorch decomposes it above Python dispatch,
    # skipping its range check on PrivateUse1. This kernel routes aten.one_hot whole
    # (composed._h_one_hot).
    _lib.impl("one_hot", lambda *a, **k: dispatch(torch.ops.aten.one_hot.default, a, k), "PrivateUse1")
    _lib.impl("ctc_loss.Tensor", held(_ctc_loss_cpu_lengths), "AutogradPrivateUse1")
    for name in WHOLE_COMPOSITES:      # NOTE [whole composites]
        _lib.impl(name, held(_whole(getattr(torch.ops.aten, name).default)), "AutogradPrivateUse1")
    if not deferfuse_autoload.LOADER.native_hooks:     # theirs pins (NOTE [pinned memory])
        _lib.impl("_pin_memory", _pin_memory, "CPU")
    # Lowered factories (no tensor argument) run as ops of their own, never through the
    # CompositeExplicitAutograd path that allocates an empty tensor and resizes it.
    from .runtime.lowering import LOWERINGS
    in_cxx = []
    for o in LOWERINGS:
        args = o._schema.arguments
        if any("Tensor" in str(a.type) for a in args) or not any(a.name == "device" for a in args):
            continue
        if o._schema.name.startswith("aten::empty"):
            continue
        name = o._schema.name.split("::")[1] + ("." + o._overloadname if o._overloadname != "default" else "")
        if plain.KERNEL and not LOWERINGS[o].rng \
                and not any(a.name == "generator" for a in args):
            # NOTE [C++ factories] in _tpu_tensor.cpp: through the C++ fallback, whose recording
            # kernel keys the call on its device= argument (a kernel hit, no Python frame)
            in_cxx.append(name)
            continue
        _lib.impl(name, (lambda op: lambda *a, **k: dispatch(op, a, k))(o), "PrivateUse1")
    if in_cxx:
        plain.PLAIN.ext.route_whole(in_cxx)
    # NOTE [whole ops] in plain.py: after every PrivateUse1 kernel
    plain.route_whole(("linear", *WHOLE_COMPOSITES))
    deferfuse_autoload.complete(_make_module())
