"""``torch.Generator("tpu")``: a generator of the tpu device, a (seed, offset) pair on the host.

PyTorch makes a device's generator through ``PrivateUse1HooksInterface.getNewGenerator``, which
its Python backend hooks cannot provide (the hooks PyTorch lets Python implement are
``is_available``, ``is_built`` and ``has_primary_context``). So a tpu generator is a Python
subclass of ``torch._C.Generator`` (a real ``torch.Generator``: PyTorch's argument parser takes it
for ``generator=``, and the same object reaches the tpu kernels), and ``torch.Generator`` is a
factory (``deferfuse_autoload.Generator``) that makes one for a tpu device. Its state is CUDA's:
16 bytes, the seed then the offset, each 8 bytes little-endian (NOTE [rng offsets] in
runtime/prng.py says how ops draw from it).
"""
from __future__ import annotations

import os
import threading
import weakref

import torch

_U64 = (1 << 64) - 1
# CUDA's default seed (default_rng_seed_val): a device generator nobody seeded starts here.
DEFAULT_SEED = 67280421310721


def increment(n: int) -> int:
    """The offset a draw of ``n`` values advances a generator by (a multiple of 4, as CUDA's)."""
    return max(4, (n + 3) // 4 * 4)


def _check_state(state) -> tuple:
    if not isinstance(state, torch.Tensor) or state.device.type != "cpu" \
            or state.dtype != torch.uint8 or state.layout != torch.strided:
        raise TypeError("RNG state must be a torch.ByteTensor")
    if state.numel() != 16:
        raise RuntimeError("RNG state is wrong size")
    b = bytes(state.contiguous().view(-1).tolist())
    seed = int.from_bytes(b[:8], "little")
    offset = int.from_bytes(b[8:], "little")
    if offset % 4:
        raise RuntimeError("offset must be a multiple of 4")
    return seed, offset


class TpuGenerator(torch._C.Generator):
    """The generator of one tpu device (``torch.Generator("tpu")``, or a device's default one)."""
    _live: weakref.WeakValueDictionary = weakref.WeakValueDictionary()   # C++ object -> generator

    def __new__(cls, device="tpu"):
        d = torch.device(device)
        if d.type != "tpu":
            raise RuntimeError(f"a tpu generator needs a tpu device, got {d}")
        # The C++ object underneath is a CPU generator that tpu ops never read.
        self = super().__new__(cls, "cpu")
        if d.index is None:
            d = torch.device("tpu", torch.tpu.current_device())
        self._tpu_device = d
        self._seed = DEFAULT_SEED
        self._offset = 0
        self._lock = threading.Lock()       # two threads never draw the same offset (CUDA's mutex)
        # A kernel receives the generator re-wrapped by PyTorch (a plain torch._C.Generator on
        # the same C++ object): this finds the tpu generator again.
        TpuGenerator._live[self._cdata] = self
        if not _DTENSOR.hooked:
            _DTENSOR.hook()
        return self

    @classmethod
    def of(cls, gen):
        """The tpu generator ``gen`` is (itself, or PyTorch's re-wrapping of one), else ``gen``."""
        if gen is None or gen.__class__ is cls:
            return gen
        return cls._live.get(gen._cdata, gen)

    def __init__(self, device="tpu"):
        pass

    # --- torch.Generator's methods -------------------------------------------------------------
    @property
    def device(self) -> torch.device:
        return self._tpu_device

    def manual_seed(self, seed) -> "TpuGenerator":
        self._seed = int(seed) & _U64
        self._offset = 0
        return self

    def seed(self) -> int:
        """A non-deterministic seed (from the OS, as CUDA's), set and returned."""
        s = int.from_bytes(os.urandom(8), "little") & ((1 << 63) - 1)
        self.manual_seed(s)
        return s

    def initial_seed(self) -> int:
        return self._seed

    def get_state(self) -> torch.Tensor:
        b = self._seed.to_bytes(8, "little") + self._offset.to_bytes(8, "little")
        return torch.tensor(list(b), dtype=torch.uint8)

    def set_state(self, new_state) -> "TpuGenerator":
        self._seed, self._offset = _check_state(new_state)
        return self

    def get_offset(self) -> int:
        return self._offset

    def set_offset(self, offset) -> "TpuGenerator":
        offset = int(offset)
        if offset % 4:
            raise RuntimeError("offset must be a multiple of 4")
        self._offset = offset & _U64
        return self

    def clone_state(self) -> "TpuGenerator":
        g = TpuGenerator(self._tpu_device)
        g._seed, g._offset = self._seed, self._offset
        return g

    def graphsafe_get_state(self) -> "TpuGenerator":
        return self.clone_state()

    def graphsafe_set_state(self, state) -> "TpuGenerator":
        self._seed, self._offset = state._seed, state._offset
        return self

    def __reduce__(self):
        return _rebuild, (str(self._tpu_device), self._seed, self._offset)

    def __deepcopy__(self, memo):
        return self.clone_state()

    def __repr__(self) -> str:
        return f"<torch.Generator object on {self._tpu_device}>"

    # --- what a random op takes ------------------------------------------------------------------
    def take(self, n: int) -> tuple:
        """(seed as int64, offset) for a draw of ``n`` values, and the offset moves past it."""
        with self._lock:
            off = self._offset
            self._offset = (off + increment(n)) & _U64
            s = self._seed
        return (s - (1 << 64) if s >= 1 << 63 else s,
                off - (1 << 64) if off >= 1 << 63 else off)


def _rebuild(device, seed, offset):
    g = TpuGenerator(device)
    g._seed, g._offset = seed, offset
    return g


class Rng:
    """The default generator of each tpu device (``torch.tpu.default_generators``)."""

    def __init__(self):
        self.gens: dict = {}
        self.seed = DEFAULT_SEED    # for a device whose generator is made later

    def generator(self, dev: int) -> TpuGenerator:
        g = self.gens.get(dev)
        if g is None:
            g = self.gens[dev] = TpuGenerator(torch.device("tpu", dev)).manual_seed(self.seed)
        return g

    def draw(self, gen, dev: int, n: int) -> tuple:
        """The (seed, offset) scalars of an op on ``dev`` drawing ``n`` values from ``gen`` (None:
        the device's default generator)."""
        if gen is None:
            g = self.gens.get(dev)
            return (g if g is not None else self.generator(dev)).take(n)
        tg = TpuGenerator.of(gen)
        if tg.__class__ is TpuGenerator:
            return tg.take(n)
        if gen.device.type != "cpu":
            raise RuntimeError(f"Expected a 'tpu' device type for generator but found "
                               f"'{gen.device.type}'")
        # NOTE [generators]: a CPU generator (accepted, unlike CUDA) seeds this one op: one draw
        # from it, which advances it as a draw would, is the seed of a fresh stream.
        return int(torch.randint(0, 2 ** 63 - 1, (), generator=gen)), 0

    def manual_seed(self, seed: int, dev: int) -> None:
        self.generator(dev).manual_seed(seed)

    def manual_seed_all(self, seed: int) -> None:
        self.seed = int(seed) & _U64
        for g in self.gens.values():
            g.manual_seed(seed)


class _DTensorRng:
    """NOTE [generators in DTensor]: DTensor's random ops take ``generator=``, and its
    ``OffsetBasedRNGTracker._distribute_region`` reads and writes that generator's 16-byte state
    (``get_state``/``set_state``) around the op. But DTensor's ``__torch_dispatch__`` receives the
    generator as PyTorch re-wraps it on the way through C++, a plain ``torch._C.Generator`` on the
    CPU generator underneath a tpu one (PyTorch only keeps the Python object of a generator it
    made itself), whose state is CPU's 5056 bytes: DTensor failed an assertion. So once a tpu
    generator exists, the tracker's ``_distribute_region`` is given the tpu generator back (at
    once if DTensor is loaded, else when it loads: importing it costs about a second)."""

    __slots__ = ("hooked",)
    MODULE = "torch.distributed.tensor._random"

    def __init__(self):
        self.hooked = False

    def hook(self) -> None:
        import sys
        self.hooked = True
        mod = sys.modules.get(self.MODULE)
        if mod is not None:
            self.patch(mod)
        else:
            sys.meta_path.insert(0, _AfterImport(self.MODULE, self.patch))

    @staticmethod
    def patch(mod) -> None:
        cls = getattr(mod, "OffsetBasedRNGTracker", None)
        orig = getattr(cls, "_distribute_region", None)
        if orig is None or getattr(orig, "__deferfuse__", False):
            return

        def _distribute_region(self, spec, generator=None):
            return orig(self, spec, generator=TpuGenerator.of(generator))
        _distribute_region.__wrapped__ = orig
        _distribute_region.__doc__ = orig.__doc__
        _distribute_region.__deferfuse__ = True
        cls._distribute_region = _distribute_region


class _AfterImport:
    """A ``sys.meta_path`` finder that calls ``then(module)`` once ``name`` is imported, then
    leaves ``sys.meta_path``."""

    def __init__(self, name: str, then):
        self.name, self.then = name, then

    def find_spec(self, fullname, path, target=None):
        if fullname != self.name:
            return None
        import importlib.util
        import sys
        if self in sys.meta_path:
            sys.meta_path.remove(self)
        spec = importlib.util.find_spec(fullname)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        loader, then = spec.loader, self.then

        class Loader:
            def create_module(self, spec):
                return loader.create_module(spec)

            def exec_module(self, module):
                loader.exec_module(module)
                module.__loader__ = module.__spec__.loader = loader     # as if never here
                then(module)
        spec.loader = Loader()
        return spec


_DTENSOR = _DTensorRng()
