"""A kernel hit's output takes its storage context from a bounded pool of released ones (NOTE
[context pool] in deferfuse/_tpu_tensor.cpp; docs/cxx-plan.md, Session 12 (cxx23)): hits reuse
them (counted), the pool never grows past its bound, and a reused context starts as a new one,
whatever layout, dtype, signature or lazy value its last tensor had: every output's layout and
values, and those of later hits reading it, equal CPU eager's. ``DEFERFUSE_CTX_POOL=0`` turns it
off."""
import gc
import os
import subprocess
import sys
import textwrap

import pytest
import torch

import deferfuse
from deferfuse import plain
from util import assert_same

EXT = plain.PLAIN.ext

pytestmark = pytest.mark.modes("defer")


def _hits():
    return EXT.kernel_stats()["hits"]


def _layout(t):
    return (tuple(t.shape), t.stride(), t.dtype, t.storage_offset(), t.is_contiguous(),
            t.dim() == 4 and t.is_contiguous(memory_format=torch.channels_last),
            t.untyped_storage().nbytes())


def _ops(a, b, c4, d4):
    """Outputs of every kind a context can have held: contiguous, transposed, channels-last,
    0-d, empty, int and bool, each then read by a later op."""
    outs = [a + b, a.t() * b.t(), c4 * d4, (a - b).sum() * 2.5, a[:0] * b[:0],
            (a > b).int() + 3, a > b]
    later = [outs[0] * 0.5 + b, outs[1].t() - a, outs[2] + d4, outs[3] * a,
             outs[4] + 1, outs[5] * 2, outs[6].int() + outs[5]]
    return outs + later


def _inputs():
    torch.manual_seed(21)
    cpu = [torch.randn(5, 3), torch.randn(5, 3),
           torch.randn(2, 3, 4, 5).to(memory_format=torch.channels_last),
           torch.randn(2, 3, 4, 5).to(memory_format=torch.channels_last)]
    return cpu, [t.to("tpu") for t in cpu]


def test_hits_take_their_contexts_from_the_pool_and_it_stays_bounded():
    """300 hits whose outputs die at once: nearly every hit takes a released context (counted),
    the pool holds at most its bound, and the last output equals CPU's."""
    cx, cy = torch.randn(8, 8), torch.randn(8, 8)
    x, y = cx.to("tpu"), cy.to("tpu")
    for _ in range(3):
        x + y
    deferfuse.sync()
    p0, h0 = EXT.ctx_pool_stats(), _hits()
    if p0["cap"] == 0:
        pytest.skip("DEFERFUSE_CTX_POOL=0: no pool (test_the_off_switch covers it)")
    for _ in range(300):
        x + y
    last = x + y
    p1 = EXT.ctx_pool_stats()
    assert _hits() - h0 >= 295      # a step-detection check or a cut takes the Python path
    assert p1["reused"] - p0["reused"] >= 290, (p0, p1)
    assert p1["pooled"] - p0["pooled"] >= 290, (p0, p1)
    assert 0 <= p1["size"] <= p1["cap"]
    assert_same(last, cx + cy)


def test_a_reused_context_starts_new_whatever_its_last_tensor_was():
    """Rounds of hits of every layout and dtype, outputs dropped between rounds in a rotating
    order, so each round's outputs reuse contexts that held another layout, dtype and signature:
    each output's layout equals CPU's, its signature id (which later hits' keys read, and which a
    context caches) is that of a tensor of its layout made anew, and its values and those of the
    later hits reading it equal CPU's, read before and after a sync."""
    cpu, tpu = _inputs()
    want = _ops(*cpu)
    sigs = [EXT.sig(w.to("tpu")) for w in want]
    assert all(s >= 0 for s in sigs) and len(set(sigs)) >= 6, sigs
    p0 = EXT.ctx_pool_stats()
    for r in range(6):
        h = _hits()
        got = _ops(*tpu)
        if r >= 2:
            assert _hits() - h >= 10, (r, _hits() - h)
        for i, (g, w) in enumerate(zip(got, want)):
            assert _layout(g) == _layout(w), (r, i)
            assert EXT.sig(g) == sigs[i], (r, i)
        if r % 2:
            deferfuse.sync()
        for g, w in zip(got, want):
            assert_same(g, w)
        # the pool hands out the last released first: a rotating order of release gives the next
        # round's outputs the contexts of other kinds
        n = len(got)
        for i in [(r * 5 + 3 + k) % n for k in range(n)]:
            got[i] = None
        gc.collect()
    if p0["cap"]:
        assert EXT.ctx_pool_stats()["reused"] - p0["reused"] >= 50


def test_the_off_switch():
    """DEFERFUSE_CTX_POOL=0: the pool's bound is 0, no context is reused or pooled, and hits'
    values equal CPU's (a fresh process: the setting is read once)."""
    code = textwrap.dedent("""
        import torch, deferfuse
        from deferfuse import plain
        ext = plain.PLAIN.ext
        cx, cy = torch.randn(4, 6), torch.randn(4, 6)
        with deferfuse.mode("defer"):
            x, y = cx.to("tpu"), cy.to("tpu")
            for _ in range(50):
                z = (x + y) * y
            assert ext.kernel_stats()["hits"] >= 90, ext.kernel_stats()
            assert torch.equal(z.cpu(), (cx + cy) * cy)
        p = ext.ctx_pool_stats()
        assert p == {"size": 0, "cap": 0, "reused": 0, "pooled": 0, "deleted": p["deleted"]}, p
        assert p["deleted"] >= 90, p
        print("ok")
    """)
    env = {**os.environ, "DEFERFUSE_CTX_POOL": "0"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-3000:]
