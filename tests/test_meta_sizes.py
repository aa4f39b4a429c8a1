"""NOTE [sizes by rule] (deferfuse/metasize.py): a new length's output metadata is derived from a
checked rule instead of the meta kernel, and equals what CPU gives (sizes, strides, dtypes,
values); a rule that fails its check is never used."""
import pytest
import torch
import torch.nn.functional as F

import deferfuse
from deferfuse import meta


@pytest.fixture
def rules(monkeypatch):
    """The size rules from empty, with no disk memo answering first (it knows exact signatures)."""
    monkeypatch.setattr(meta.memo, "path", None)
    meta.sizes.clear()
    before = dict(meta.sizes.stats())
    yield lambda: {k: meta.sizes.stats()[k] - before[k] for k in ("derived", "refuted")}


def _block(x, w, b, emb, ids):
    """A GPT-like step over a sequence of ``x.shape[1]`` positions, in ops the rules cover."""
    t = x.shape[1]
    h = x + emb[torch.arange(0, t, device=x.device)]
    h = F.layer_norm(h, (h.shape[-1],))
    q = F.linear(h, w, b)
    a = F.scaled_dot_product_attention(q[:, None], q[:, None], q[:, None], is_causal=True)[:, 0]
    o = F.gelu(a + h).softmax(-1)
    last = o[:, [-1], :]
    nxt = torch.cat([ids, ids[:, -1:] + 1], dim=1)
    return o, last, nxt


@pytest.mark.modes("defer")
def test_new_lengths_reuse_inferred_metadata_and_match_cpu(rules):
    torch.manual_seed(0)
    d = 24
    w, b, emb = torch.randn(d, d), torch.randn(d), torch.randn(40, d)
    tw, tb, temb = w.to("tpu"), b.to("tpu"), emb.to("tpu")
    got, want = [], []
    for t in range(3, 17):
        x = torch.randn(2, t, d)
        ids = torch.arange(2 * t).reshape(2, t)
        g = _block(x.to("tpu"), tw, tb, temb, ids.to("tpu"))
        c = _block(x, w, b, emb, ids)
        for gi, ci in zip(g, c):
            # metadata first: known before anything runs
            assert (gi.shape, gi.stride(), gi.dtype) == (ci.shape, ci.stride(), ci.dtype), t
        if t in (6, 16):        # values at two derived lengths (each length compiles)
            got.append(g)
            want.append(c)
    n = rules()
    # each op learns a line from two lengths and checks it on a third; after that (and after each
    # length crossing another size: 4, 8, 16 here) the lengths are derived
    assert n["derived"] >= 60 and n["refuted"] == 0, n
    for g, c in zip(got, want):
        for gi, ci in zip(g, c):
            torch.testing.assert_close(gi.cpu(), ci, atol=1e-5, rtol=1e-5)


@pytest.mark.modes("defer")
def test_a_size_that_is_not_affine_is_never_derived(rules):
    # (L, L) scores: their strides are L * L, which no line through two lengths gives
    got, want = [], []
    for t in range(5, 12):
        x = torch.randn(1, t, 8)
        s = x.to("tpu") @ x.to("tpu").transpose(-1, -2)
        c = x @ x.transpose(-1, -2)
        assert (s.shape, s.stride()) == (c.shape, c.stride()), t
        got.append(s)
        want.append(c)
    n = rules()
    assert n["refuted"] >= 1, n
    for g, c in zip(got, want):
        torch.testing.assert_close(g.cpu(), c, atol=1e-5, rtol=1e-5)


@pytest.mark.modes("debug")
def test_debug_mode_checks_every_derived_answer(rules, monkeypatch):
    x = torch.randn(2, 7)
    for t in range(3, 7):
        (x[:, :t].to("tpu") * 2).cpu()
    assert rules()["derived"] >= 1
    # a derived answer that the meta kernel contradicts is an internal error, not a wrong shape
    monkeypatch.setattr(meta.sizes, "derive", lambda k: ("one", (((2, 99), (99, 1), torch.float32),)))
    with pytest.raises(AssertionError, match="sizes by rule"):
        x[:, :7].to("tpu") * 2
    with deferfuse.override(meta_rules=False):      # the off switch: the meta kernel alone
        assert (x[:, :7].to("tpu") * 2).shape == (2, 7)


@pytest.mark.modes("defer")
def test_a_dim_argument_is_never_interpolated(rules):
    # sizes all equal (and above every dim): summing over dims 2 to 5 gives one shape, and the
    # dims would be one line of one key; dim 6 is out of range on CPU
    x = torch.randn(*[10] * 6)
    t = x.to("tpu")
    for d in (2, 3, 4, 5):
        g = t.sum(d)
        assert (g.shape, g.stride()) == (x.sum(d).shape, x.sum(d).stride())
    with pytest.raises(IndexError) as cpu_err:
        x.sum(6)
    with pytest.raises(IndexError) as tpu_err:
        t.sum(6)
    assert str(tpu_err.value) == str(cpu_err.value)
    torch.testing.assert_close(t.sum(5).cpu(), x.sum(5))
