"""Factories with a ``device=`` (``torch.full``/``arange``/``ones``/``zeros`` ...) and casts on a
tensor's own device (``x.float()``, ``x.to(dtype, device=x.device)``) as C++ kernel hits on the
plain tpu tensor (NOTE [C++ factories] in deferfuse/_tpu_tensor.cpp; docs/cxx-plan.md, Session 7
(cxx15)): hf_generate's most frequent routed ops. Every result equals CPU eager (dtypes, shapes,
values); the counts say what the kernel took and what the router ran. A cast to another device,
to CPU, from CPU, or a factory whose device has no index still goes to the router (and is right).

Run with ``make test-cxx``."""
import pytest
import torch

import deferfuse
from deferfuse import plain
from util import assert_same

if not plain.KERNEL:
    pytest.skip("the C++ recording kernel is off (DEFERFUSE_CXX_KERNEL=0)", allow_module_level=True)

EXT = plain.PLAIN.ext
_KEYS = ("hits", "passed", "unkeyed")


def _counted(fn):
    """``fn()``, with the kernel's counters and the router's calls per op meanwhile."""
    k0, r0 = EXT.kernel_stats(), EXT.route_stats()
    out = fn()
    k1, r1 = EXT.kernel_stats(), EXT.route_stats()
    return (out, {k: k1[k] - k0[k] for k in _KEYS},
            {op: n - r0.get(op, 0) for op, n in r1.items() if n != r0.get(op, 0)})


def _factories(dev, n, fill, flag):
    """The factories hf_generate and models call, each on ``dev``; ``fill`` and ``flag`` are
    Python numbers / bools that vary between calls."""
    return [
        torch.full((2, 3), fill, device=dev),                       # dtype from the number
        torch.full((4,), flag, device=dev, dtype=torch.bool),
        torch.full((2,), fill, device=dev, dtype=torch.int64),      # a float filling an int
        torch.ones(n, dtype=torch.long, device=dev),
        torch.zeros(3, 2, device=dev),
        torch.arange(n, device=dev),
        torch.arange(1, n + 1, dtype=torch.float32, device=dev),
        torch.arange(0.5, 3.0, 0.5, device=dev),
        torch.eye(3, device=dev),
        torch.linspace(0.0, 1.0, 5, device=dev),
    ]


@pytest.mark.modes("defer", "strict")
def test_factories_with_a_device_equal_cpu_and_are_kernel_hits(tpu_mode):
    """Each factory's result equals CPU's (dtype, shape, values) on every call, with the fill
    value and bool changing between calls; in defer mode, once learnt, every factory is a kernel
    hit and nothing is routed (strict mode runs each op: routed)."""
    dev = torch.device("tpu", 0)
    for i, (fill, flag) in enumerate(((3.25, True), (-1.75, False), (7.5, True), (2.25, False))):
        want = _factories("cpu", 4, fill, flag)
        got, k, r = _counted(lambda: _factories(dev, 4, fill, flag))
        assert_same(got, want, msg=f"call {i}")
        if i >= 2 and tpu_mode == "defer":
            assert r == {}, (i, k, r)
            assert k["hits"] == len(want) and k["passed"] == k["unkeyed"] == 0, (i, k, r)


@pytest.mark.modes("defer")
def test_factory_numbers_are_runtime_inputs_and_types_stay_apart():
    """A fill value is a runtime input (a new value compiles nothing), but its type is in the
    key: ``full(.., 3)`` is int64, ``full(.., 3.5)`` float32 and ``full(.., True)`` bool, as on
    CPU, called alternately on one shape; 2 is a special constant of its own key."""
    dev = torch.device("tpu", 0)
    fills = (3, 3.5, True, 5, 4.25, False, 2, 2.0, 7, 6.75)
    for rnd in range(2):
        for v in fills:
            want = torch.full((3,), v)
            got, k, r = _counted(lambda: torch.full((3,), v, device=dev))
            assert_same(got, want, msg=f"fill {v!r}")
            if rnd == 1:
                assert r == {} and k["hits"] == 1, (v, k, r)
    c0 = deferfuse.metrics()["compiles"]
    for v in (11, 12.5, 13, 14.75):
        assert_same(torch.full((3,), v, device=dev), torch.full((3,), v))
    deferfuse.sync()
    assert deferfuse.metrics()["compiles"] == c0


@pytest.mark.modes("defer", "strict")
def test_casts_on_the_device_equal_cpu_and_are_kernel_hits(tpu_mode):
    """``_to_copy`` of a tpu tensor to its own device, between dtypes (float, int, bool, double,
    half), with ``device=`` naming its own device or not, from a view (a slice of a row), to a
    channels-last layout: results equal CPU's; in defer mode every cast is a kernel hit once
    learnt."""
    torch.manual_seed(3)
    xs = [torch.randn(2, 6) * 4, torch.randint(-5, 6, (2, 1, 3)), torch.rand(2, 2, 3, 3)]
    dev = torch.device("tpu", 0)
    ts = [x.to(dev) for x in xs]

    def casts(a, b, c, d):
        return [a.int(), a.to(torch.float64), a.to(dtype=torch.float16), (a > 0).float(),
                a[:, -1].to(copy=True, dtype=torch.float32, device=d), a.to(d, torch.int64),
                b.float(), b.to(torch.bool), b[..., 1:].double(), b.to(torch.float32, copy=True),
                c.to(torch.float64, memory_format=torch.channels_last),
                c.permute(0, 2, 3, 1).to(torch.float16)]

    for i in range(3):
        want = casts(*xs, "cpu")
        got, k, r = _counted(lambda: casts(*ts, dev))
        assert_same(got, want, atol=1e-3, msg=f"call {i}")
        for g, w in zip(got, want):
            assert g.stride() == w.stride(), (g.stride(), w.stride())
        if i == 2 and tpu_mode == "defer":
            assert r == {}, (k, r)
            assert k["passed"] == k["unkeyed"] == 0, (k, r)


@pytest.mark.modes("defer", "strict")
def test_casts_and_factories_the_kernel_does_not_key_still_equal_cpu(tpu_mode):
    """What the kernel leaves to the router stays right: a cast to CPU, from CPU, to another tpu
    device (where there is one), a factory with ``device="tpu"`` (no index: the thread's
    device); each is routed every call, never a hit."""
    torch.manual_seed(4)
    x = torch.randn(3, 4)
    t = x.to("tpu")
    for i in range(3):
        got, k, r = _counted(lambda: [t.to("cpu", torch.float64), x.to("tpu", torch.int32),
                                      torch.full((2,), 1.5 + i, device="tpu"),
                                      torch.arange(3 + i, device="tpu")])
        want = [x.double(), x.int(), torch.full((2,), 1.5 + i), torch.arange(3 + i)]
        assert got[0].device.type == "cpu"
        assert got[0].dtype == want[0].dtype and torch.equal(got[0], want[0])
        assert_same(got[1:], want[1:])
        if tpu_mode == "defer" and i == 2:
            assert r.get("aten::_to_copy", 0) >= 2 and r.get("aten::full", 0) == 1 \
                and r.get("aten::arange", 0) == 1, r
    if torch.tpu.device_count() > 1:
        d1 = torch.device("tpu", 1)
        for i in range(3):
            got, k, r = _counted(lambda: t.to(d1, torch.float64))
            assert got.device == d1
            assert_same(got.to("tpu:0"), x.double())
            if tpu_mode == "defer" and i == 2:
                assert r.get("aten::_to_copy", 0) == 1 and k["hits"] == 0, (k, r)


@pytest.mark.modes("defer")
def test_bad_factory_arguments_raise_as_on_cpu():
    """A bad factory call raises CPU's exception type and message, learnt keys or not."""
    dev = torch.device("tpu", 0)
    torch.arange(4, device=dev)
    for fn in (lambda d: torch.arange(1, 0, 1, device=d),
               lambda d: torch.full((-1,), 2.5, device=d),
               lambda d: torch.arange(0, 5, 0, device=d)):
        with pytest.raises(Exception) as want:
            fn("cpu")
        with pytest.raises(type(want.value)) as got:
            fn(dev)
        assert str(got.value) == str(want.value)


@pytest.mark.modes("defer", "strict")
def test_tensor_from_data_is_its_own_tensor_and_cats_as_on_cpu(tpu_mode):
    """``torch.tensor(data, device=...)`` ends with ``lift_fresh``, which returns its argument as
    on CPU (PyTorch's composite, not an alias made by the router): the new tensor is a base the
    kernel keys, so a Hugging Face dynamic cache's first ``cat([empty keys, k])`` and the ops after
    it are kernel hits (defer). Values, dtypes and shapes equal CPU's; the upload itself
    (``_to_copy`` from CPU and its ``copy_``) is routed."""
    torch.manual_seed(8)
    ks = [torch.randn(2, 2, 3, 4) for _ in range(3)]
    dev = torch.device("tpu", 0)
    tks = [k.to(dev) for k in ks]

    def first_cat(k, d):
        keys = torch.tensor([], dtype=k.dtype, device=d)
        out = torch.cat([keys, k], dim=-2)
        return [keys, out, torch.tensor(7, device=d, dtype=torch.long) + 1]

    for i, (k, tk) in enumerate(zip(ks, tks)):
        want = first_cat(k, "cpu")
        got, c, r = _counted(lambda: first_cat(tk, dev))
        assert_same(got, want, msg=f"call {i}")
        if i == 2 and tpu_mode == "defer":
            assert set(r) == {"aten::_to_copy", "aten::copy_"}, (c, r)
            assert c["hits"] >= 2 and c["passed"] == 0, (c, r)


@pytest.mark.modes("strict")
def test_strict_mode_hits_run_now_and_equal_cpu():
    """NOTE [C++ strict hits]: in strict mode a learnt key's call is run now by the kernel
    (``Plain.run_hit``), not routed: a chain of pointwise ops with Python numbers (int, float,
    bool), a reduction, a matmul, factories and casts equal CPU's on every call, and from the
    third call on nothing but the in-place op and the sync is routed. Each result is computed
    (a value, not pending) when the op returns."""
    torch.manual_seed(9)
    x, w = torch.randn(4, 5), torch.randn(5, 3)
    dev = torch.device("tpu", 0)
    tx, tw = x.to(dev), w.to(dev)

    def ops(x, w, d, s):
        y = (x * s + 2) * True
        z = (y.int() * 3).sum(0)
        h = (x @ w).relu().float()
        h.add_(1.5)
        return [y, z, h, torch.full((3,), s, device=d), torch.arange(4, device=d) * s,
                (x > s).to(torch.float16), y.sum().item()]

    for i, s in enumerate((0.25, 1.75, -0.6, 3.1)):
        want = ops(x, w, "cpu", s)
        k0 = EXT.kernel_stats()["strict_hits"]
        got, k, r = _counted(lambda: ops(tx, tw, dev, s))
        hits = EXT.kernel_stats()["strict_hits"] - k0
        for t in got[:-1]:
            st = plain.PLAIN.storage(t)
            assert st.val.array is not None or st.val.node is None, "pending in strict mode"
        assert_same(got[:-1], want[:-1], atol=1e-4, msg=f"call {i}")
        assert type(got[-1]) is float and got[-1] == pytest.approx(want[-1], rel=1e-5)
        if i >= 2:
            assert set(r) <= {"aten::add_.Tensor", "aten::add.out", "aten::_local_scalar_dense"}, (k, r)
            assert hits == k["hits"] and hits >= 12, (hits, k, r)
