"""A bucket run's outputs are left at their bucket's shape and cut to their exact shape only where
something other than a bucket run reads them (NOTE [lazy cuts] in runtime/buckets.py, a state of
NOTE [value states]). Every reader gets CPU's values at the exact shape, never padding: ``.cpu()``,
a region that is not a bucket's, views, an in-place op that donates the value's buffer, a read
after an interrupted flush or cut; memory accounting counts the padded array until the cut; the
setting off cuts at once and computes the same."""
import numpy as np
import pytest
import torch

import deferfuse
from deferfuse import device_info, plain
from deferfuse.runtime import execute
from deferfuse.runtime.buckets import Buckets
from deferfuse.scheduler.records import Padded
from util import assert_same, bench_module

M = bench_module("models")

pytestmark = pytest.mark.modes("defer")


def _val(t):
    return plain.PLAIN.storage(t).val


def _sample(n=20):
    """nanoGPT's sampling loop on tpu and CPU (one bucket run a token); the tokens on tpu left
    computed (synced), and CPU's."""
    torch.manual_seed(0)
    model = M.TinyGPT().eval()
    x = torch.zeros((1, 1), dtype=torch.long)
    want = model.sample(x, n)
    model.to("tpu")
    got = model.sample(x.to("tpu"), n)
    deferfuse.sync()
    return model, got, want


def test_a_sampling_loop_leaves_its_tokens_padded_and_cpu_reads_them_exact():
    deferfuse.clear_caches()
    _sample()       # (learning the loop, its first call runs some tokens as exact regions)
    deferfuse.reset_metrics()
    _, got, want = _sample()
    m = deferfuse.metrics()
    assert m["bucketed_runs"] == 20 and m["compiles"] == 0, m
    # each token's run leaves the tokens padded; the next run pads from the padded array
    assert m["lazy_cuts"] == 20 and m["lazy_cuts_padded"] == 19 and m["lazy_cuts_read"] == 0, m
    v = _val(got)
    assert v.array.__class__ is Padded and v.array.array.shape == (1, 33), v.array
    assert v.shape == (1, 21)
    before = device_info.memory_allocated()
    reads = m["lazy_cuts_read"]
    assert_same(got, want)                      # .cpu(): the cut, then CPU's tokens
    assert v.array.__class__ is not Padded and tuple(v.array.shape) == (1, 21)
    # counted at its padded size (the bucket of 32, one token longer) until the cut, then exact
    assert before - device_info.memory_allocated() == (33 - 21) * 8
    assert deferfuse.metrics()["lazy_cuts_read"] == reads + 1
    assert_same(got, want)                      # cut once
    assert deferfuse.metrics()["lazy_cuts_read"] == reads + 1


def test_a_region_views_and_an_in_place_op_read_a_padded_value_exact():
    _, got, want = _sample()
    assert _val(got).array.__class__ is Padded
    # a region that is not a bucket's, and views of the padded value, each read at its exact shape
    y = (got * 3 + 1).float().mean(1)
    assert_same(y, (want * 3 + 1).float().mean(1))
    _, got, want = _sample()
    assert _val(got).array.__class__ is Padded
    assert_same(got[:, 5:], want[:, 5:])
    assert_same(got.t()[-3:], want.t()[-3:])
    assert_same(got.reshape(-1).flip(0), want.reshape(-1).flip(0))
    # an in-place op on the only holder of the padded value: its buffer may be donated
    # (no reference to its Value kept here: a holder more would keep it from being donated)
    _, got, want = _sample()
    assert _val(got).array.__class__ is Padded
    donated = deferfuse.metrics()["donated_bytes"]
    got.add_(7).mul_(2)
    want.add_(7).mul_(2)
    deferfuse.sync()
    assert deferfuse.metrics()["donated_bytes"] - donated == 21 * 8     # the cut array's
    assert_same(got, want)


def test_the_next_call_pads_from_padded_values_and_compiles_nothing():
    model, got, want = _sample()
    deferfuse.reset_metrics()
    x = torch.zeros((1, 1), dtype=torch.long)
    again = model.sample(x.to("tpu"), 20)
    longer = model.sample(got, 8)               # a padded value as a bucket run's input
    assert_same(again, want)
    cpu = M.TinyGPT()
    cpu.load_state_dict({k: p.cpu() for k, p in model.state_dict().items()})
    assert_same(longer, cpu.eval().sample(want, 8))
    m = deferfuse.metrics()
    assert m["compiles"] == 0, m["miss_reasons"]
    assert m["lazy_cuts_padded"] >= 25, m


def test_off_cuts_right_after_the_run_and_computes_the_same():
    deferfuse.clear_caches()
    with deferfuse.override(lazy_cuts=False):
        deferfuse.reset_metrics()
        _, got, want = _sample()
        m = deferfuse.metrics()
        assert _val(got).array.__class__ is not Padded
        assert m["lazy_cuts"] == 0 and m["lazy_cuts_padded"] == 0, m
        assert_same(got, want)
    compiles_off = m["compiles"]
    deferfuse.clear_caches()
    deferfuse.reset_metrics()
    _, got, want = _sample()
    assert deferfuse.metrics()["compiles"] == compiles_off    # the cut compiles nothing
    assert_same(got, want)


def test_an_interrupted_cut_or_flush_leaves_the_value_padded_and_right(monkeypatch):
    """Ctrl-C in the cut itself (the value stays padded, its array and count untouched) or in the
    program of a region reading it (the region is recorded again): every later read is CPU's."""
    real = Buckets.cut_read
    armed = []

    def interrupted(self, array, shape):
        if armed:
            armed.clear()
            raise KeyboardInterrupt
        return real(self, array, shape)
    monkeypatch.setattr(Buckets, "cut_read", interrupted)   # (before: a Padded holds its cut)
    _, got, want = _sample()
    v = _val(got)
    armed.append(1)
    before = device_info.memory_allocated()
    with pytest.raises(KeyboardInterrupt):
        got.cpu()
    assert v.array.__class__ is Padded and device_info.memory_allocated() == before
    assert_same(got, want)

    _, got, want = _sample()
    assert _val(got).array.__class__ is Padded
    run = execute.run_region
    armed.append(1)

    def interrupted_run(*a, **k):
        if armed:
            armed.clear()
            raise KeyboardInterrupt
        return run(*a, **k)
    monkeypatch.setattr(execute, "run_region", interrupted_run)
    y = got * 2 - 1
    with pytest.raises(KeyboardInterrupt):
        deferfuse.sync()
    assert_same(y, want * 2 - 1)
    assert_same(got, want)


def test_a_reader_that_skips_the_cut_fails_loudly():
    """A padded value is no array: numpy (and any program) refuses it, so a reader that took
    ``Value.array`` without ``Value.exact`` could never read padding as data."""
    _, got, want = _sample()
    p = _val(got).array
    assert p.__class__ is Padded
    with pytest.raises(TypeError, match="lazily cut"):
        np.asarray(p)
    assert_same(got, want)


def test_a_padded_value_freed_unread_uncounts_its_padded_size():
    """Freeing a value still lazily cut un-counts what was counted for it, its padded array's
    size (the finalizer of the exact ``Value`` class is C's: NOTE [value finalizer])."""
    import gc
    _sample()
    _, got, want = _sample()
    v = _val(got)
    assert v.array.__class__ is Padded and v.array.array.shape == (1, 33) and v.shape == (1, 21)
    del v
    gc.collect()
    held = device_info.memory_allocated()
    del got
    gc.collect()
    assert held - device_info.memory_allocated() == 33 * 8
