"""Register the ``tpu`` device at ``import torch``, cheaply; load deferfuse on first real use.

PyTorch calls every function of the ``torch.backends`` entry-point group while ``import torch``
runs (``TORCH_DEVICE_BACKEND_AUTOLOAD=0`` turns that off); deferfuse's entry point is
``autoload`` below. It must not import JAX or deferfuse itself (about a second), so it does only
what names the device, in a few milliseconds:

- renames PrivateUse1 to ``tpu`` and registers PyTorch's Python device guard and hooks, so
  ``torch.device("tpu")`` parses and ``torch.accelerator.current_accelerator()`` is ``tpu``;
- puts a module at ``torch.tpu`` whose attributes load deferfuse when first read (``is_available``
  answers without it);
- registers a PrivateUse1 backend fallback that loads deferfuse and calls the op again, so a
  factory with ``device="tpu"``, ``.to("tpu")`` and ``torch.load`` of a ``tpu`` checkpoint work
  without ``import deferfuse``;
- makes ``torch.Generator`` a factory that gives a tpu generator for ``device="tpu"``
  (``Generator`` below) and PyTorch's own for every other device, which TorchScript takes as it
  takes ``torch._C.Generator`` (``_script_takes_both_generators``);
- wraps the ``torch.accelerator`` functions that need the device (``synchronize``, the memory
  counters, streams) so that they load deferfuse first when ``tpu`` is the accelerator;
- registers the ``tpu`` process-group backend (and its alias ``tpu_dist``, Ray Train's name) with
  torch.distributed, as the default backend of the ``tpu`` device, whose constructor loads
  deferfuse, so ``init_process_group("tpu")`` or ``init_process_group()`` in a script that never
  imports deferfuse starts JAX's distributed runtime when the group is made (``torch.distributed``
  is already imported by ``import torch``: this costs nothing more).

``import deferfuse`` completes the registration (``complete``): it fills the ``torch.tpu``
module, removes the fallback and restores ``torch.accelerator``'s functions. Without autoload it
does the cheap part itself, so both routes end in the same state, and importing twice is a no-op.

This module is top level, not ``deferfuse._autoload``: importing a submodule runs
``deferfuse/__init__.py`` first, which is the expensive import this avoids.
"""
from __future__ import annotations

import os
import sys
import threading
import types

import torch

NAME = "tpu"
# torch.distributed backend names of the tpu process group: "tpu", and Ray Train's use_tpu=True name.
BACKENDS = (NAME, "tpu_dist")

# torch.accelerator functions that read or change the device's state. current_accelerator and
# is_available answer without deferfuse.
_ACCELERATOR_CALLS = (
    "device_count", "current_device_index", "current_device_idx", "set_device_index",
    "set_device_idx", "current_stream", "set_stream", "synchronize", "device_index",
    "empty_cache", "empty_host_cache", "get_memory_info", "max_memory_allocated",
    "max_memory_reserved", "memory_allocated", "memory_reserved", "memory_stats",
    "reset_accumulated_memory_stats", "reset_peak_memory_stats", "get_device_capability")


class _Loader:
    """What the cheap registration made, and whether deferfuse has completed it (one object,
    ``LOADER``; its state lives here, not in module globals)."""

    def __init__(self):
        self.registered = False   # PrivateUse1 renamed and torch.tpu in place
        self.complete = False     # deferfuse imported and registered
        self.loading = 0          # the thread running deferfuse's registration, or 0
        self.module = None        # the torch.tpu module
        self.fallback_lib = None  # the PrivateUse1 fallback's torch.library.Library
        self.wrapped = {}         # torch.accelerator name -> the original function
        self.job = None           # (rank, world size, coordinator) of a group that loaded deferfuse
        self.hooks_lib = None      # the C++ hooks' library (ctypes), when registered
        self.native_hooks = False  # the C++ hooks (deferfuse/_tpu_hooks.cpp) registered, or Python's

    def load(self, why: str) -> None:
        """Import deferfuse (which calls ``complete``)."""
        if self.complete:
            return
        if self.loading == threading.get_ident():
            raise RuntimeError(
                f"{why} needs the tpu device while deferfuse is still being imported")
        # Another thread importing deferfuse holds Python's import lock: this waits for it.
        try:
            import deferfuse  # noqa: F401  (its device registration calls complete())
        finally:
            if self.loading == threading.get_ident():
                self.loading = 0
        if not self.complete:
            raise RuntimeError(f"import deferfuse did not register the tpu device ({why})")


LOADER = _Loader()


class _LazyDeviceModule(types.ModuleType):
    """``torch.tpu`` before deferfuse is loaded: reading an attribute it lacks loads deferfuse,
    which fills this same module object (code may already hold a reference to it)."""

    def __getattr__(self, name):
        if name.startswith("__") or LOADER.complete or LOADER.loading == threading.get_ident():
            raise AttributeError(f"module 'torch.{NAME}' has no attribute '{name}'")
        LOADER.load(f"torch.{NAME}.{name}")
        return getattr(self, name)


def _fallback(keyset, op, *args, **kwargs):
    """A PrivateUse1 op with no kernel before deferfuse is loaded (a factory with
    ``device="tpu"``, the copy of ``.to("tpu")``): load it, then call the op again."""
    if LOADER.complete:
        # Reached only when deferfuse registered no kernel for this op: PyTorch's own words.
        raise NotImplementedError(
            f"Could not run '{op._schema.name}' with arguments from the '{NAME}' backend")
    LOADER.load(f"{op} on {NAME}")
    return op(*args, **kwargs)


def _lazy_accelerator_call(name: str, orig):
    def call(*args, **kwargs):
        if not LOADER.complete and torch._C._get_accelerator().type == NAME:
            LOADER.load(f"torch.accelerator.{name}")
        current = getattr(torch.accelerator, name)
        return (orig if current is call else current)(*args, **kwargs)
    call.__name__, call.__doc__, call.__qualname__ = orig.__name__, orig.__doc__, orig.__qualname__
    return call


def _create_group(opts, backend_options=None):
    """The tpu process group's constructor before deferfuse is loaded: load deferfuse (which starts
    JAX's distributed runtime; NOTE [distributed start] in runtime/cluster.py), then make the group.

    The default group tells deferfuse its rank and size, for launchers that pass them to
    ``init_process_group`` instead of setting ``RANK``/``WORLD_SIZE`` first (Ray Train, mp.spawn),
    and where torch's store listens: JAX's coordinator then listens on the store's port + 1 when
    ``MASTER_ADDR``/``MASTER_PORT`` are not set (``init_method="tcp://host:port"``)."""
    if not LOADER.complete and not opts.global_ranks_in_group and opts.group_size > 1:
        store = opts.store
        while hasattr(store, "underlying_store"):
            store = store.underlying_store
        host, port = getattr(store, "host", None), getattr(store, "port", None)
        LOADER.job = (opts.group_rank, opts.group_size,
                      f"{host}:{port + 1}" if host and port else None)
    LOADER.load(f"init_process_group('{NAME}')")
    from deferfuse.distributed.group import create
    return create(opts, backend_options)


def register_backends(create) -> None:
    """Register ``create`` as the constructor of the ``tpu`` process-group backends (``BACKENDS``),
    the default backend of the ``tpu`` device (``init_process_group()`` with no name). Called with
    the lazy constructor here and with the real one by deferfuse; the second call replaces it."""
    try:
        import torch.distributed as dist
    except ImportError:         # pragma: no cover (a torch built without distributed)
        return
    if not dist.is_available():
        return
    for name in BACKENDS:
        if name.upper() in dist.Backend._plugins:
            dist.Backend._plugins[name.upper()] = dist.Backend._BackendPlugin(create, True)
        else:
            dist.Backend.register_backend(name, create, extended_api=True, devices=[NAME, "cpu"])
    # register_backend keeps a device's first default; "tpu" is ours whichever name came first.
    dist.Backend.default_device_backend_map[NAME] = NAME


class _GeneratorType(type(torch._C.Generator)):
    """``isinstance(g, torch.Generator)`` holds for every generator, as before the factory."""

    def __instancecheck__(cls, obj):
        return isinstance(obj, torch._C.Generator)

    def __subclasscheck__(cls, sub):
        return issubclass(sub, torch._C.Generator)


class Generator(torch._C.Generator, metaclass=_GeneratorType):
    """``torch.Generator``: PyTorch's own for every device but ``tpu``, for which it is deferfuse's
    (``deferfuse.generator.TpuGenerator``, a subclass of ``torch._C.Generator``; PyTorch's Python
    backend hooks cannot make a device's generator)."""

    def __new__(cls, device=None):
        if device is not None and _is_tpu(device):
            LOADER.load("torch.Generator('tpu')")
            from deferfuse.generator import TpuGenerator
            return TpuGenerator(device)
        return torch._C.Generator() if device is None else torch._C.Generator(device)


def _script_takes_both_generators() -> None:
    """TorchScript with ``torch.Generator`` the factory: both classes are its one Generator type.

    It maps an annotation by ``ann is torch.Generator`` (``torch.jit.annotations.try_ann_to_type``,
    which its C++ also looks up by name), so an annotation that holds PyTorch's own class
    (``torch._C.Generator``, or ``torch.Generator`` read before this module replaced it) failed:
    "Unsupported annotation typing.Optional[torch._C.Generator]"; and it finds the builtin
    ``aten::Generator`` (``torch.Generator()`` in scripted code) by the class's id, so the factory
    was compiled as a class: "Class Generator does not have an __init__ function defined". Both
    modules are imported by ``import torch``: this imports nothing."""
    builtins = sys.modules.get("torch.jit._builtins")
    if builtins is not None:
        # ``torch.Generator(...)`` in scripted code is the builtin ``aten::Generator``, found by
        # the class's id; the table is built on first use (the list), or already (the table).
        if builtins._builtin_table is None:
            builtins._builtin_ops.append((Generator, "aten::Generator"))
        else:
            builtins._builtin_table[id(Generator)] = "aten::Generator"
    ann = sys.modules.get("torch.jit.annotations")
    orig = getattr(ann, "try_ann_to_type", None)
    if orig is None or getattr(orig, "__deferfuse__", False):
        return

    def try_ann_to_type(ann, loc, rcb=None):
        return orig(Generator if ann is torch._C.Generator else ann, loc, rcb)
    try_ann_to_type.__wrapped__ = orig
    try_ann_to_type.__doc__ = orig.__doc__
    try_ann_to_type.__deferfuse__ = True
    ann.try_ann_to_type = try_ann_to_type


def _is_tpu(device) -> bool:
    if isinstance(device, torch.device):
        return device.type == NAME
    if isinstance(device, str):
        return device.split(":")[0] == NAME
    return False


def _native_guard_and_hooks():
    """PyTorch's Python device guard and hooks, with methods that run no Python bytecode.

    C++ calls them from noexcept code (a device guard's destructor, while a tensor is freed), and
    a Python method runs the signal handlers pending at its first bytecode: a KeyboardInterrupt
    raised there aborted the interpreter ("terminate called without an active exception"). A
    built-in callable (``itertools.repeat(v).__next__``) runs none (NOTE [interrupt safety] in
    runtime/interrupts.py)."""
    import functools
    import itertools
    import operator
    kind = torch._C._autograd.DeviceType.PrivateUse1
    true = itertools.repeat(True).__next__

    class DeviceGuard(torch._C._acc.DeviceGuard):
        type_ = itertools.repeat(kind).__next__

    class Hooks(torch._C._acc.PrivateUse1Hooks):
        is_available = true
        is_built = true
        has_primary_context = functools.partial(operator.is_not, None)   # (dev_id) -> True

    return DeviceGuard(), Hooks()


def _register_native_hooks() -> bool:
    """Register deferfuse's C++ PrivateUse1 hooks (NOTE [pinned memory] in deferfuse/_tpu_hooks.cpp:
    they give a pinned-memory allocator, which PyTorch's Python hooks cannot) when the library is
    built for the torch that runs; False leaves PyTorch's Python hooks to be registered. Found
    without importing deferfuse, loaded with ctypes (a few milliseconds)."""
    import glob
    import importlib.util
    spec = importlib.util.find_spec("deferfuse")
    if spec is None or not spec.submodule_search_locations:
        return False
    found = [p for d in spec.submodule_search_locations
             for p in glob.glob(os.path.join(d, "_tpu_hooks*.so"))]
    if not found:
        return False
    import ctypes
    try:
        lib = ctypes.CDLL(found[0])
    except OSError:
        return False
    lib.deferfuse_hooks_torch_version.restype = ctypes.c_char_p
    if lib.deferfuse_hooks_torch_version().decode() != torch.__version__:
        return False        # built against another torch: its class layout may differ
    if lib.deferfuse_register_hooks() != 1:
        return False
    LOADER.hooks_lib = lib      # the plain tensor hands it its storage resize (deferfuse/plain.py)
    return True


def register() -> types.ModuleType:
    """The cheap registration (idempotent); returns the ``torch.tpu`` module object."""
    if LOADER.registered:
        return LOADER.module
    from torch.utils.backend_registration import _setup_privateuseone_for_python_backend
    current = torch._C._get_privateuse1_backend_name()
    if current not in ("privateuseone", NAME):
        raise RuntimeError(
            f"deferfuse cannot register the '{NAME}' device: PyTorch's PrivateUse1 backend is "
            f"already '{current}' (another device plugin); one process can have one")
    module = _LazyDeviceModule(f"torch.{NAME}")
    module.__doc__ = "The tpu device (deferfuse), loaded on first use."
    module.is_available = lambda: True      # JAX always has a device (its CPU backend at least)
    module._is_in_bad_fork = lambda: False
    # NOTE: the order matters (rename, methods, module, hooks, guard); PyTorch's helper has it.
    guard, hooks = _native_guard_and_hooks()
    # First: PrivateUse1's hooks can be registered once, and PyTorch's helper registers Python's
    # (it then leaves them unregistered, finding ours).
    LOADER.native_hooks = _register_native_hooks()
    _setup_privateuseone_for_python_backend(NAME, backend_module=module, hook=hooks,
                                            device_guard=guard)
    lib = torch.library.Library("_", "IMPL")
    lib.fallback(_fallback, "PrivateUse1", with_keyset=True)
    acc = torch.accelerator
    for name in _ACCELERATOR_CALLS:
        orig = getattr(acc, name, None)
        if orig is not None:
            LOADER.wrapped[name] = orig
            setattr(acc, name, _lazy_accelerator_call(name, orig))
    register_backends(_create_group)
    torch.Generator = Generator
    _script_takes_both_generators()
    LOADER.module, LOADER.fallback_lib, LOADER.registered = module, lib, True
    return module


def begin() -> types.ModuleType:
    """Called by deferfuse's device registration before it registers kernels: registers the
    device if autoload did not, undoes the lazy parts (the fallback, the torch.accelerator
    wrappers) and returns the ``torch.tpu`` module for deferfuse to fill."""
    module = register()
    LOADER.loading = threading.get_ident()
    for name, orig in LOADER.wrapped.items():
        setattr(torch.accelerator, name, orig)
    LOADER.wrapped.clear()
    if LOADER.fallback_lib is not None:
        # Safe inside the fallback itself (measured: the running call completes), and it frees
        # PrivateUse1's one backend-fallback slot for code that registers its own.
        LOADER.fallback_lib._destroy()
        LOADER.fallback_lib = None
    return module


def complete(full: types.ModuleType) -> None:
    """Called by deferfuse once its registration is done: ``full``'s functions become
    ``torch.tpu``'s."""
    module = LOADER.module
    for k, v in vars(full).items():
        if k not in ("__name__", "__loader__", "__spec__", "__package__"):
            setattr(module, k, v)
    LOADER.complete, LOADER.loading = True, 0


def autoload() -> None:
    """The ``torch.backends`` entry point: register ``tpu`` without importing JAX."""
    if "deferfuse" in sys.modules and LOADER.complete:
        return
    register()
