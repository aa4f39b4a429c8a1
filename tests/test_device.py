"""The tpu device as PyTorch code sees it: registration, torch.tpu, transfers, errors."""
import copy
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

import deferfuse
from util import assert_same


def test_device_registered():
    assert torch.device("tpu").type == "tpu"
    assert torch.accelerator.current_accelerator() == torch.device("tpu")
    assert torch.tpu.is_available()
    assert torch.tpu.device_count() >= 1
    assert torch.tpu.current_device() == 0
    torch.tpu.set_device(0)
    assert deferfuse.platform() in ("tpu", "gpu", "cpu")


def test_set_device_out_of_range():
    with pytest.raises(RuntimeError, match="does not exist"):
        torch.tpu.set_device(torch.tpu.device_count())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16,
                                   torch.int64, torch.int32, torch.int8, torch.uint8, torch.bool])
def test_roundtrip_dtypes(dtype):
    x = (torch.randn(4, 5) * 10).to(dtype)
    t = x.to("tpu")
    assert t.dtype == dtype and t.device.type == "tpu"
    assert_same(t, x)
    assert torch.equal(t.cpu(), x)


def test_to_variants():
    x = torch.randn(3, 3)
    assert_same(x.to("tpu", torch.float64), x.to(torch.float64))
    assert_same(x.tpu(), x)
    assert_same(x.to("tpu").to(torch.int32), x.to(torch.int32))
    assert x.to("tpu").to("cpu").device.type == "cpu"
    assert_same(x.to("tpu:0"), x)


def test_copy_from_host_replaces_the_value():
    """A host tensor copied over a whole tpu tensor (``x.to("tpu")``, ``t.copy_(cpu)``) becomes
    its value with no op recorded; views, earlier reads and later writes behave as on CPU."""
    x = torch.arange(6.0).reshape(2, 3)
    deferfuse.sync()
    before = deferfuse.metrics()["ops_recorded"]
    z = x.to("tpu")
    deferfuse.sync()
    assert deferfuse.metrics()["ops_recorded"] == before
    x.add_(100)                         # the tpu copy does not share the host memory
    assert_same(z, torch.arange(6.0).reshape(2, 3))

    def program(dev):
        a = torch.ones(2, 3, device=dev)
        v = a.view(3, 2)                # a view of a, written through a below
        b = a * 2                       # reads the old value of a
        a.copy_(torch.full((2, 3), 7.0))
        c = a + b
        part = torch.zeros(2, 3, device=dev)
        part[0].copy_(torch.tensor([1.0, 2.0, 3.0]))   # a view: a recorded copy
        wide = torch.zeros(2, 3, dtype=torch.float64, device=dev)
        wide.copy_(torch.ones(2, 3))                      # another dtype: a recorded copy
        return v, b, c, part, wide

    for got, want in zip(program("tpu"), program("cpu")):
        assert_same(got, want)


def test_direct_transfer_and_its_fallback():
    from deferfuse.runtime import transfer
    x = torch.randn(3, 4)
    assert_same(x.to("tpu"), x)
    assert transfer._put[0], "JAX's direct transfer was not taken on this JAX"
    saved = transfer._put[0]
    try:
        transfer._put[0] = lambda a, device: 1 / 0      # a JAX whose internals changed
        assert_same(x.to("tpu"), x)
        assert transfer._put[0] is False               # device_put from then on
        assert_same((x * 2).to("tpu"), x * 2)
    finally:
        transfer._put[0] = saved


def test_item_tolist_repr():
    x = torch.tensor([[1.5, 2.0], [3.0, 4.25]])
    t = x.to("tpu")
    assert t[1, 1].item() == 4.25
    assert t.tolist() == x.tolist()
    r = repr(t)
    assert "device='tpu:0'" in r and "4.2500" in r
    assert f"{t.sum():.2f}" == f"{x.sum():.2f}"
    assert repr(t.int()).startswith("tensor([[1, 2]")


def test_numpy_raises_like_cuda():
    with pytest.raises(TypeError, match=r"\.cpu\(\)"):
        torch.ones(2, device="tpu").numpy()


def test_factories():
    cases = {
        "zeros": lambda d: torch.zeros(2, 3, device=d),
        "ones": lambda d: torch.ones(2, 3, device=d, dtype=torch.int64),
        "full": lambda d: torch.full((2,), 7, device=d),
        "full_float": lambda d: torch.full((2, 2), 0.25, device=d),
        "arange": lambda d: torch.arange(10, device=d),
        "arange_float": lambda d: torch.arange(0, 1, 0.1, device=d),
        "linspace": lambda d: torch.linspace(-1, 1, 7, device=d),
        "eye": lambda d: torch.eye(3, 4, device=d),
        "tensor": lambda d: torch.tensor([[1, 2], [3, 4]], device=d),
        "tensor_float": lambda d: torch.tensor([1.5, -2.0], device=d),
        "zeros_like": lambda d: torch.zeros_like(torch.ones(2, 2, device=d)),
        "ones_like": lambda d: torch.ones_like(torch.ones(2, 2, device=d), dtype=torch.int32),
        "full_like": lambda d: torch.full_like(torch.ones(2, device=d), 3.5),
    }
    for name, f in cases.items():
        assert_same(f("tpu"), f("cpu"), msg=name)
    e = torch.empty(3, 4, device="tpu")
    assert e.shape == (3, 4) and e.dtype == torch.float32 and e.device.type == "tpu"
    assert torch.empty_like(e).shape == (3, 4)


@pytest.mark.parametrize("f", ["rand", "randn", "randint"])
def test_random_factories_seeded(f):
    make = {"rand": lambda: torch.rand(1000, device="tpu"),
            "randn": lambda: torch.randn(1000, device="tpu"),
            "randint": lambda: torch.randint(0, 10, (1000,), device="tpu")}[f]
    torch.manual_seed(3)
    a = make().cpu()
    torch.manual_seed(3)
    b = make().cpu()
    c = make().cpu()
    assert torch.equal(a, b) and not torch.equal(b, c)
    want = {"rand": torch.float32, "randn": torch.float32, "randint": torch.int64}[f]
    assert a.dtype == want


def test_rng_state_roundtrip():
    torch.tpu.manual_seed(5)
    s = torch.tpu.get_rng_state()
    a = torch.randn(10, device="tpu").cpu()
    torch.tpu.set_rng_state(s)
    b = torch.randn(10, device="tpu").cpu()
    assert torch.equal(a, b)
    torch.tpu.manual_seed_all(5)
    assert torch.equal(torch.randn(10, device="tpu").cpu(), a)


def test_mixed_devices_raise():
    with pytest.raises(RuntimeError, match="Expected all tensors to be on the same device"):
        torch.ones(3, device="tpu") + torch.ones(3)
    # 0-dim CPU tensors mix with any device, as in PyTorch
    assert_same(torch.ones(3, device="tpu") * torch.tensor(2.0), torch.ones(3) * 2)


@pytest.mark.slow_params("strict")   # long: defer only in the default run
def test_cpu_index_tensors():
    # Indexing takes CPU index tensors, as on CUDA (SAM's relative positions index with one):
    # x[i], its backward (index_put_ with the saved CPU indices), x[i] = v and index_put_
    x = torch.randn(5, 3)
    i = torch.tensor([[0, 4], [2, 2]])
    v = torch.randn(2, 2, 3)
    xt = x.to("tpu").requires_grad_()
    xc = x.clone().requires_grad_()
    got, want = (xt * 2)[i], (xc * 2)[i]
    assert_same(got, want)
    got.sum().backward()
    want.sum().backward()
    assert_same(xt.grad, xc.grad)
    for acc in (False, True):
        zt, zc = torch.zeros(5, 3, device="tpu"), torch.zeros(5, 3)
        zt.index_put_((i,), v.to("tpu"), accumulate=acc)
        zc.index_put_((i,), v, accumulate=acc)
        assert_same(zt, zc)
    zt[i[0]] = v[0].to("tpu")
    zc[i[0]] = v[0]
    assert_same(zt, zc)
    m, j = torch.tensor([True, False, True, False, True]), torch.tensor([0, 2, 1])
    assert_same(x.to("tpu")[m, j], x[m, j])
    # values on CPU still raise PyTorch's error (its type, not a subclass)
    with pytest.raises(RuntimeError, match="Expected all tensors to be on the same device") as e:
        zt[i] = v
    assert type(e.value) is RuntimeError


def test_save_load(tmp_path):
    # Checkpoints come back where they were saved, as on CUDA (tests/test_checkpoints.py)
    m = torch.nn.Linear(3, 2).to("tpu")
    path = tmp_path / "m.pt"
    torch.save({"model": m.state_dict(), "t": torch.arange(4, device="tpu")}, path)
    ck = torch.load(path)                      # weights_only=True default
    ck2 = torch.load(path, map_location="cpu")
    for k, v in m.state_dict().items():
        assert ck["model"][k].device.type == "tpu"
        assert torch.equal(ck["model"][k].cpu(), v.cpu())
        assert ck2["model"][k].device.type == "cpu"
        assert torch.equal(ck2["model"][k], v.cpu())
    assert_same(ck["t"], torch.arange(4))
    m2 = torch.nn.Linear(3, 2).to("tpu")
    m2.load_state_dict(ck["model"])
    assert torch.equal(m2.weight.cpu(), m.weight.cpu())


@pytest.mark.parametrize("where", ["tpu", "tpu:0", "device", "dict"])
def test_load_with_map_location_tpu(tmp_path, where):
    # map_location=device is how device-agnostic code loads a checkpoint; it made a storage on tpu
    # for every tensor and crashed the interpreter (PrivateUse1 has no allocator for Python).
    m = torch.nn.Linear(3, 2)
    path = tmp_path / "m.pt"
    p = torch.nn.Parameter(torch.randn(2))
    torch.save({"model": m.state_dict(), "t": [torch.arange(4), (p, p)], "step": 7}, path)
    loc = {"tpu": "tpu", "tpu:0": "tpu:0", "device": torch.device("tpu"),
           "dict": {"cpu": "tpu"}}[where]
    ck = torch.load(path, map_location=loc, weights_only=False)
    for k, v in m.state_dict().items():
        assert ck["model"][k].device.type == "tpu"
        assert_same(ck["model"][k], v)
    assert type(ck["model"]) is type(m.state_dict())
    assert ck["model"]._metadata == m.state_dict()._metadata     # load_state_dict's versions
    assert_same(ck["t"][0], torch.arange(4))
    q, q2 = ck["t"][1]
    assert q is q2 and isinstance(q, torch.nn.Parameter) and q.requires_grad
    assert_same(q.detach(), p.detach())
    assert ck["step"] == 7
    m2 = torch.nn.Linear(3, 2).to("tpu")
    m2.load_state_dict(ck["model"])
    assert_same(m2.weight.detach(), m.weight.detach())
    # a whole module saved with torch.save(model) comes back on tpu too
    torch.save(m, path)
    m3 = torch.load(path, map_location="tpu", weights_only=False)
    assert m3.weight.device.type == "tpu" and isinstance(m3.weight, torch.nn.Parameter)


def test_storage_on_tpu_raises_instead_of_crashing():
    for make in (lambda: torch.UntypedStorage(4, device="tpu"),
                 lambda: torch.UntypedStorage(4).to(device="tpu"),
                 lambda: torch.ones(2).untyped_storage().to(device="tpu")):
        with pytest.raises(RuntimeError, match="no PyTorch storage"):
            make()
    assert torch.UntypedStorage(4).device.type == "cpu"


def test_module_to_and_deepcopy():
    import copy
    m = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4)).to("tpu")
    assert all(p.device.type == "tpu" for p in m.parameters())
    assert all(isinstance(p, torch.nn.Parameter) for p in m.parameters())
    assert all(b.device.type == "tpu" for b in m.buffers())
    m2 = copy.deepcopy(m)
    assert torch.equal(m2[0].weight.cpu(), m[0].weight.cpu())
    with torch.no_grad():
        m2[0].weight.add_(1)
    assert not torch.equal(m2[0].weight.cpu(), m[0].weight.cpu())
    assert m.to("cpu")[0].weight.device.type == "cpu"


def test_memory_stats():
    import gc
    gc.collect()            # earlier tests' garbage, freed in the middle, would skew the count
    deferfuse.sync()
    torch.tpu.reset_peak_memory_stats()
    before = torch.tpu.memory_allocated()
    x = torch.ones(1024, 1024, device="tpu")
    x.sum().item()
    assert torch.tpu.memory_allocated() >= before + 4 * 2**20
    assert torch.tpu.max_memory_allocated() >= torch.tpu.memory_allocated()
    del x
    assert torch.tpu.memory_allocated() < before + 4 * 2**20


def test_synchronize():
    x = torch.ones(10, device="tpu") * 3
    torch.tpu.synchronize()
    torch.accelerator.synchronize()
    assert x.sum().item() == 30


def test_data_assignment():
    p = torch.nn.Parameter(torch.zeros(3, device="tpu"))
    p.data = torch.ones(3, device="tpu")
    assert torch.equal(p.cpu(), torch.ones(3))
    assert torch.equal(p.data.cpu(), torch.ones(3))
    d = p.data
    d.add_(1)                      # .data aliases the parameter, as on CPU
    assert torch.equal(p.detach().cpu(), torch.full((3,), 2.0))


@pytest.mark.modes("strict")
def test_env_mode_and_bad_mode():
    with pytest.raises(ValueError, match="defer, strict, debug"):
        with deferfuse.mode("fast"):
            pass
    # Every mode name parses as the variable's value (in process); one subprocess shows the
    # variable read at import (each subprocess costs seconds of import).
    from deferfuse.config import SETTINGS
    assert [SETTINGS["mode"].parse(m) for m in (" Strict", "debug", "DEFER")] == \
        ["strict", "debug", "defer"]
    code = "import deferfuse; print(deferfuse.current_mode())"
    out = subprocess.run([sys.executable, "-c", code], env={**os.environ, "TORCHTPU_MODE": "debug"},
                         capture_output=True, text=True, check=True).stdout.strip()
    assert out == "debug"
    bad = subprocess.run([sys.executable, "-c", code], env={**os.environ, "TORCHTPU_MODE": "nope"},
                         capture_output=True, text=True)
    assert bad.returncode != 0 and "ValueError" in bad.stderr


def test_modes_nest():
    with deferfuse.mode("strict"):
        assert deferfuse.current_mode() == "strict"
        with deferfuse.mode("debug"):
            assert deferfuse.current_mode() == "debug"
            with deferfuse.mode():
                assert deferfuse.current_mode() == "defer"
            assert deferfuse.current_mode() == "debug"
        assert deferfuse.current_mode() == "strict"


@pytest.mark.modes("strict")
def test_import_runtime_under_other_name_fails():
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    for pkg in ("runtime", "scheduler"):
        r = subprocess.run([sys.executable, "-c", f"import {pkg}"], cwd=root, capture_output=True, text=True)
        assert r.returncode != 0 and "deferfuse" in r.stderr and "ImportError" in r.stderr


@pytest.mark.modes("strict")
def test_gc_threshold():
    """NOTE [gc threshold]: import raises Python's default young-generation threshold for defer
    mode (strict and debug keep it); a threshold the program set is kept, and 0 leaves it alone."""
    import gc
    from deferfuse.engine import engine as state
    old, old_state = gc.get_threshold(), (state.young_gc, state.raised_gc)
    try:
        gc.set_threshold(700, 10, 10)
        state.young_gc = state.raised_gc = 0
        deferfuse._tune_gc(20000)
        assert (state.young_gc, state.raised_gc) == (700, 20000)
        assert gc.get_threshold() == (700, 10, 10)             # this test runs in strict mode
        with deferfuse.mode("defer"):
            assert gc.get_threshold() == (20000, 10, 10)
            with deferfuse.mode("debug"):
                assert gc.get_threshold() == (700, 10, 10)
            assert gc.get_threshold() == (20000, 10, 10)
        assert gc.get_threshold() == (700, 10, 10)
        gc.set_threshold(1234, 5, 6)                         # the program's own: kept
        with deferfuse.mode("defer"):
            assert gc.get_threshold() == (1234, 5, 6)
        state.young_gc = state.raised_gc = 0
        gc.set_threshold(700, 10, 10)
        deferfuse._tune_gc(0)
        assert state.young_gc == 0
        with deferfuse.mode("defer"):
            assert gc.get_threshold() == (700, 10, 10)
    finally:
        gc.set_threshold(*old)
        state.young_gc, state.raised_gc = old_state
    code = "import gc, deferfuse; print(gc.get_threshold())"
    out = subprocess.run([sys.executable, "-c", code],
                         env={**os.environ, "DEFERFUSE_GC_THRESHOLD": "5000"},
                         capture_output=True, text=True, check=True).stdout.strip()
    assert out == "(5000, 10, 10)"


@pytest.mark.modes("defer")
def test_cyclic_garbage_collected_at_sync():
    """NOTE [gc threshold]: with the raised threshold, reference cycles that hold tpu tensors are
    still collected at the next sync once 700 objects were added, as Python's default would."""
    import gc
    import weakref
    from deferfuse.engine import engine as state
    old, old_young = gc.get_threshold(), state.young_gc
    x = torch.ones(3).to("tpu")

    def make_cycles(n):
        refs = []
        for _ in range(n):
            c = [x.detach()]        # a new tensor, nothing recorded
            c.append(c)
            refs.append(weakref.ref(c[0]))
        return refs
    (x + 1).sum()
    deferfuse.sync()                # compiled once here: no compile below allocates
    try:
        gc.collect()
        gc.set_threshold(20000, 10, 10)
        for young, alive in ((0, True), (700, False)):
            state.young_gc = young
            refs = make_cycles(800)
            (x + 1).sum()           # something pending, so that the sync runs a trace
            deferfuse.sync()
            assert any(r() is not None for r in refs) == alive
            gc.collect()
    finally:
        gc.set_threshold(*old)
        state.young_gc = old_young


@pytest.mark.slow_params("strict")   # long: defer only in the default run
def test_tied_parameters_stay_tied():
    # A wrapper subclass is not "shallow-copy compatible" with a CPU tensor, so Module._apply gave
    # each module its own new Parameter and tied embeddings trained as two (CUDA keeps one).
    torch.manual_seed(0)
    emb, head = torch.nn.Embedding(10, 4), torch.nn.Linear(4, 10, bias=False)
    head.weight = emb.weight
    m = torch.nn.Sequential(emb, torch.nn.Tanh(), head)
    mt = copy.deepcopy(m).to("tpu")
    assert mt[0].weight is mt[2].weight
    assert [p.device.type for p in mt.parameters()] == ["tpu"]
    opts = [torch.optim.SGD(x.parameters(), lr=0.5) for x in (m, mt)]
    idx = torch.tensor([[1, 2, 3], [4, 5, 1]])
    for _ in range(3):
        for model, opt, dev in ((m, opts[0], "cpu"), (mt, opts[1], "tpu")):
            opt.zero_grad()
            F.cross_entropy(model(idx.to(dev)).flatten(0, 1), idx.flatten().to(dev)).backward()
            opt.step()
    assert_same(mt[0].weight.detach(), m[0].weight.detach(), atol=1e-5, rtol=1e-5)
    # a module converted on its own, and parameters that are not tied, are untouched
    lin = torch.nn.Linear(3, 3).to("tpu")
    assert lin.weight is not lin.bias and lin.weight.device.type == "tpu"


def test_pin_memory_and_dataloader_pinning():
    # With tpu the accelerator, pin_memory() asked its hooks for a pinned allocator (which a Python
    # backend cannot register) and raised: DataLoader(pin_memory=True) failed on its first batch.
    # deferfuse's C++ hooks give a pinned allocator (NOTE [pinned memory]); without them
    # pin_memory() copies.
    import deferfuse_autoload
    x = torch.randn(3, 4)
    p = x.pin_memory()
    assert p.device.type == "cpu" and torch.equal(p, x) and p.data_ptr() != x.data_ptr()
    assert p.is_pinned() == deferfuse_autoload.LOADER.native_hooks and not x.is_pinned()
    ds = torch.utils.data.TensorDataset(torch.randn(10, 4), torch.arange(10))
    got = [(xb.to("tpu", non_blocking=True), yb.to("tpu"))
           for xb, yb in torch.utils.data.DataLoader(ds, batch_size=4, pin_memory=True)]
    assert_same(torch.cat([g[0] for g in got]), ds.tensors[0])
    assert_same(torch.cat([g[1] for g in got]), ds.tensors[1])


def test_accelerator_memory_counters():
    # torch.accelerator's counters asked for a C++ DeviceAllocator (an internal assert): they read
    # the runtime's own counters, as torch.tpu's do.
    x = torch.ones(1000, device="tpu")
    deferfuse.sync()
    acc = torch.accelerator
    assert acc.memory_allocated() == torch.tpu.memory_allocated() >= x.numel() * 4
    assert acc.memory_reserved(0) == acc.memory_allocated("tpu")
    assert acc.max_memory_allocated() >= acc.memory_allocated()
    assert acc.memory_stats()["allocated_bytes.all.current"] == acc.memory_allocated()
    acc.reset_peak_memory_stats()
    assert acc.max_memory_allocated() == acc.memory_allocated()
    acc.empty_cache()


def test_sparse_layouts_raise_not_implemented():
    # A CPU fallback that returned a sparse tensor failed converting it (a TypeError about numpy).
    for make in (lambda: torch.ones(2, 2, device="tpu").to_sparse(),
                 lambda: torch.ones(2, 2).to_sparse().to("tpu")):
        with pytest.raises(NotImplementedError, match="dense"):
            make()


def test_mem_get_info():
    # torch.cuda.mem_get_info's counterpart (scripts size batches with it), and torch.accelerator's
    # get_memory_info, which hit PyTorch's internal assert for a Python backend.
    free, total = torch.tpu.mem_get_info()
    assert 0 < free <= total
    assert torch.accelerator.get_memory_info()[1] == total == torch.tpu.mem_get_info("tpu:0")[1]


# --- the device contract frameworks read (torch.cuda's, issue 32) -------------------------------

def _jax_device(i=0):
    return deferfuse.runtime.platform.jax_devices()[i]


def test_get_device_properties():
    """TorchTitan reads ``get_device_properties(i).total_memory`` and ``get_device_name``; other
    code reads ``name``, ``major``/``minor`` and ``multi_processor_count``, as on torch.cuda."""
    d = _jax_device()
    p = torch.tpu.get_device_properties(0)
    assert torch.get_device_module("tpu").get_device_properties("tpu:0").name == p.name
    assert p.name == d.device_kind == torch.tpu.get_device_name() == torch.tpu.get_device_name(0)
    stats = d.memory_stats() or {}
    if stats.get("bytes_limit"):
        assert p.total_memory == stats["bytes_limit"]
    else:       # XLA's CPU backend: the host's memory
        assert p.total_memory == os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    assert torch.tpu.mem_get_info(0)[1] == p.total_memory
    assert isinstance(p.multi_processor_count, int) and p.multi_processor_count >= 1
    if d.platform == "cpu":
        assert p.multi_processor_count == len(os.sched_getaffinity(0))
        assert (p.major, p.minor) == (0, 0)
    assert torch.tpu.get_device_capability() == torch.tpu.get_device_capability(0) == (p.major,
                                                                                     p.minor)
    assert f"total_memory={p.total_memory // 2**20}MB" in repr(p)
    caps = torch.accelerator.get_device_capability()
    assert {torch.float32, torch.bfloat16, torch.int64, torch.bool} <= caps["supported_dtypes"]
    with pytest.raises(ValueError, match="Expected a tpu device, but got: cpu"):
        torch.tpu.get_device_properties("cpu")


# CUDA's caching allocator's statistics (torch.cuda.memory_stats), every key PyTorch documents.
_CUDA_STATS = [f"{s}.{p}.{m}" for s in ("allocation", "segment", "active", "inactive_split",
                                        "allocated_bytes", "reserved_bytes", "active_bytes",
                                        "inactive_split_bytes", "requested_bytes")
               for p in ("all", "large_pool", "small_pool")
               for m in ("current", "peak", "allocated", "freed")]
_CUDA_STATS += [f"{s}.{m}" for s in ("oversize_allocations", "oversize_segments")
                for m in ("current", "peak", "allocated", "freed")]
_CUDA_STATS += ["num_alloc_retries", "num_ooms", "num_sync_all_streams", "num_device_alloc",
                "num_device_free", "max_split_size"]


def test_memory_stats_has_cudas_keys_with_the_runtimes_counts():
    import gc
    gc.collect()
    deferfuse.sync()
    s0 = torch.tpu.memory_stats()
    assert set(_CUDA_STATS) <= set(s0) and list(s0) == sorted(s0)
    assert all(isinstance(v, int) for v in s0.values())
    torch.tpu.reset_peak_memory_stats()
    x = torch.ones(1024, 1024, device="tpu")      # 4 MiB: the large pool
    y = torch.ones(10, device="tpu")               # 40 bytes: the small pool
    deferfuse.sync()
    s = torch.tpu.memory_stats("tpu:0")
    assert s["allocated_bytes.all.current"] == torch.tpu.memory_allocated() >= s0[
        "allocated_bytes.all.current"] + 4 * 2**20 + 40
    assert s["allocated_bytes.large_pool.current"] >= s0["allocated_bytes.large_pool.current"] + 4 * 2**20
    assert s["allocated_bytes.small_pool.current"] >= s0["allocated_bytes.small_pool.current"] + 40
    assert s["allocation.all.current"] >= s0["allocation.all.current"] + 2
    assert s["allocation.all.allocated"] >= s0["allocation.all.allocated"] + 2
    for pool in ("all", "large_pool", "small_pool"):
        cur = s[f"allocated_bytes.{pool}.current"]
        assert cur - s0[f"allocated_bytes.{pool}.current"] == (
            s[f"allocated_bytes.{pool}.allocated"] - s0[f"allocated_bytes.{pool}.allocated"]
            - s[f"allocated_bytes.{pool}.freed"] + s0[f"allocated_bytes.{pool}.freed"])
        # nothing cached, nothing split: every live buffer is active and reserved (TorchTitan
        # reads these peaks)
        for k in ("active_bytes", "reserved_bytes", "requested_bytes"):
            assert s[f"{k}.{pool}.current"] == cur and s[f"{k}.{pool}.peak"] == s[
                f"allocated_bytes.{pool}.peak"]
        assert s[f"allocated_bytes.{pool}.peak"] >= cur
    assert s["allocated_bytes.all.current"] == (s["allocated_bytes.large_pool.current"]
                                               + s["allocated_bytes.small_pool.current"])
    assert s["num_alloc_retries"] == s["num_ooms"] == s["inactive_split_bytes.all.current"] == 0
    assert torch.tpu.memory_stats_as_nested_dict()["active_bytes"]["all"]["peak"] == s[
        "active_bytes.all.peak"]
    del x
    s2 = torch.tpu.memory_stats()
    assert s2["allocated_bytes.all.current"] <= s["allocated_bytes.all.current"] - 4 * 2**20
    assert s2["allocated_bytes.all.freed"] >= s["allocated_bytes.all.freed"] + 4 * 2**20
    assert s2["active_bytes.all.peak"] == s["active_bytes.all.peak"]
    torch.tpu.reset_peak_memory_stats()
    s3 = torch.tpu.memory_stats()
    assert s3["active_bytes.all.peak"] == s3["active_bytes.all.current"] < s["active_bytes.all.peak"]
    assert s3["allocation.all.peak"] == s3["allocation.all.current"]
    torch.accelerator.reset_accumulated_memory_stats()
    s4 = torch.tpu.memory_stats()
    assert s4["allocated_bytes.all.allocated"] == s4["allocated_bytes.all.freed"] == 0
    assert s4["allocated_bytes.all.current"] == s3["allocated_bytes.all.current"]
    assert torch.accelerator.memory_stats()["reserved_bytes.all.peak"] == s4["reserved_bytes.all.peak"]
    del y


_BAD_INDEX_CALLS = {     # x: a tpu tensor
    "ones": lambda i, x: torch.ones(2, device=f"tpu:{i}"),
    "empty": lambda i, x: torch.empty(2, device=f"tpu:{i}"),
    "tensor": lambda i, x: torch.tensor([1.0], device=f"tpu:{i}"),
    "randn_device": lambda i, x: torch.randn(2, device=torch.device("tpu", i)),
    "arange": lambda i, x: torch.arange(3, device=f"tpu:{i}"),
    "cpu_to": lambda i, x: torch.ones(2).to(f"tpu:{i}"),
    "tpu_to": lambda i, x: x.to(f"tpu:{i}"),
    "tpu_method": lambda i, x: torch.ones(2).tpu(i),
    "new_ones": lambda i, x: x.new_ones(3, device=f"tpu:{i}"),
    "zeros_like": lambda i, x: torch.zeros_like(x, device=f"tpu:{i}"),
    "empty_like": lambda i, x: torch.empty_like(x, device=f"tpu:{i}"),
    "module_to": lambda i, x: torch.nn.Linear(2, 2).to(f"tpu:{i}"),
    "set_device": lambda i, x: torch.tpu.set_device(i),
    "device_ctx": lambda i, x: torch.tpu.device(i).__enter__(),
    "accelerator_set_device_index": lambda i, x: torch.accelerator.set_device_index(i),
    "mem_get_info": lambda i, x: torch.tpu.mem_get_info(i),
    "memory_stats": lambda i, x: torch.tpu.memory_stats(f"tpu:{i}"),
    "get_device_properties": lambda i, x: torch.tpu.get_device_properties(i),
}


def test_a_bad_device_index_raises_at_the_call():
    """As CUDA's "invalid device ordinal" (a RuntimeError naming the device), at the call, in
    every mode, with nothing recorded: the pending trace still runs, with CPU's values."""
    n = torch.tpu.device_count()
    x = torch.arange(4.0, device="tpu") * 2       # pending in defer mode
    trace = deferfuse.engine.engine.state.trace
    recorded = len(trace.nodes)
    for name, call in _BAD_INDEX_CALLS.items():
        with pytest.raises(RuntimeError, match=rf"invalid device ordinal: tpu:{n} does not exist: "
                                               rf"this machine has {n} tpu device"):
            call(n, x)
        assert len(trace.nodes) == recorded, name
    assert torch.tpu.current_device() == torch.accelerator.current_device_index() == 0
    assert_same(x + 1, torch.arange(4.0) * 2 + 1)


def test_a_device_argument_places_the_result_there():
    """``new_*`` and ``*_like`` with ``device=`` another device, and ``.to("meta")``, give their
    result on that device, as on CPU (they were left on tpu, or moved to CPU)."""
    xc = torch.arange(6.0).reshape(2, 3).t()
    x = xc.to("tpu")
    calls = {"new_ones": lambda a, d: a.new_ones(2, device=d),
             "new_empty": lambda a, d: a.new_empty((2, 2), device=d),
             "new_tensor": lambda a, d: a.new_tensor([1.0], device=d),
             "zeros_like": lambda a, d: torch.zeros_like(a, device=d),
             "full_like": lambda a, d: torch.full_like(a, 2, dtype=torch.int64, device=d),
             "empty_like": lambda a, d: torch.empty_like(a, device=d),
             "rand_like": lambda a, d: torch.rand_like(a, device=d),
             "to": lambda a, d: a.to(d)}
    for dev in ("cpu", "meta"):
        for name, f in calls.items():
            torch.manual_seed(1)
            w = f(xc, dev)
            torch.manual_seed(1)
            g = f(x, dev)
            assert type(g) is torch.Tensor and g.device == w.device, (dev, name)
            assert (g.dtype, g.shape, g.stride()) == (w.dtype, w.shape, w.stride()), (dev, name)
            if dev == "cpu" and "empty" not in name:
                assert torch.equal(g, w), name
