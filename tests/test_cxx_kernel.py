"""The C++ recording kernel on the plain PrivateUse1 tpu tensor
(docs/cxx-plan.md, Session 4 (cxx7)): ops on moving windows (NOTE [C++ moving windows] in
deferfuse/_tpu_tensor.cpp) are kernel hits at every offset, one program for every offset, and
every result equals CPU eager."""
import pytest
import torch

import deferfuse
from deferfuse import plain
from util import assert_same


def _hits():
    return plain.PLAIN.ext.kernel_stats()["hits"]


def _compiles():
    return deferfuse.metrics()["compiles"]


# NOTE [C++ moving windows]: writes and reads through windows that move, one op each
WRITES = [
    ("setitem_row", lambda b, s, i: b.__setitem__(i, s[:6] * 2.0)),
    ("copy_column", lambda b, s, i: b[:, i].copy_(s)),
    ("slice_add", lambda b, s, i: b[i:i + 2].add_(1.5)),
    ("strided_slice_mul", lambda b, s, i: b[i:i + 3:2].mul_(0.5)),
    ("select_of_t_fill", lambda b, s, i: b.t()[i].fill_(i + 0.25)),
    ("as_strided_sub", lambda b, s, i: b.as_strided((2, 3), (6, 1), i).sub_(0.25)),
]


@pytest.mark.modes("defer")
@pytest.mark.parametrize("write", [w[1] for w in WRITES], ids=[w[0] for w in WRITES])
def test_writes_at_moving_offsets_are_kernel_hits_and_equal_cpu(write):
    torch.manual_seed(0)
    want = torch.randn(8, 6)
    src = torch.randn(8)
    buf, s = want.to("tpu"), src.to("tpu")
    hits, compiles = [], []
    for i in range(6):
        h = _hits()
        write(buf, s, i)
        hits.append(_hits() - h)
        write(want, src, i)
        deferfuse.sync()
        compiles.append(_compiles())
        assert_same(buf, want)
    # the first offset learns the key (routed); every later offset is the same key, in C++
    assert hits[0] == 0 and all(h >= 1 for h in hits[2:]), hits
    assert compiles[1] == compiles[-1], compiles     # no offset after the first compiles


@pytest.mark.modes("defer")
def test_reads_of_moving_windows_are_kernel_hits_and_equal_cpu():
    torch.manual_seed(1)
    d, w = torch.randn(12, 5), torch.randn(5)
    t, wt = d.to("tpu"), w.to("tpu")
    hits, compiles = [], []
    for i in range(8):
        h = _hits()
        got = (t[i] * wt, t[i:i + 3].sum(0), t[:, i % 5] + 1)
        hits.append(_hits() - h)
        for g, c in zip(got, (d[i] * w, d[i:i + 3].sum(0), d[:, i % 5] + 1)):
            assert_same(g, c)
        compiles.append(_compiles())
    assert all(h >= 3 for h in hits[2:]), hits
    assert compiles[2] == compiles[-1], compiles


@pytest.mark.modes("defer")
def test_a_loop_of_row_writes_is_one_program_and_equals_cpu():
    """An RNN-style loop: row i of a buffer written from row i - 1 (a read and a write through
    two moving selects), then the whole buffer read; every step after the first is a hit."""
    torch.manual_seed(2)
    want = torch.zeros(10, 4)
    want[0] = torch.randn(4)
    m = torch.randn(4, 4) * 0.5
    buf, mt = want.to("tpu"), m.to("tpu")
    hits = []
    for rnd in range(2):
        for i in range(1, 10):
            h = _hits()
            buf[i] = torch.tanh(buf[i - 1] @ mt)
            hits.append(_hits() - h)
            want[i] = torch.tanh(want[i - 1] @ m)
        assert_same(buf.sum(1), want.sum(1))
        assert_same(buf, want)
    assert all(h >= 2 for h in hits[9:]), hits      # the second pass: select, mm, tanh, copy


@pytest.mark.modes("defer")
def test_whole_and_one_row_windows_keep_their_own_keys():
    """A slice of a whole dimension and ``[1::2]`` have the same sizes and strides but only the
    second moves; a select of a dimension of one does not move: each keeps its own key and
    values (a shared key would drop or add an offset input)."""
    d = torch.randn(6, 3)
    t = d.to("tpu")
    for _ in range(3):
        assert_same(t[0::2] * 3.5, d[0::2] * 3.5)
        assert_same(t[1::2] * 3.5, d[1::2] * 3.5)
        assert_same(t[::2] * 3.5, d[::2] * 3.5)
    e = torch.randn(1, 4)
    u = e.to("tpu")
    for _ in range(3):
        assert_same(u[0] * 1.5, e[0] * 1.5)
        assert_same(u[-1] * 1.5, e[-1] * 1.5)


def test_moving_windows_with_the_kernel_off_equal_the_kernel_on():
    ext = plain.PLAIN.ext
    d = torch.randn(7, 3)
    outs = []
    for on in (True, False):
        ext.set_kernel(on)
        try:
            t = d.to("tpu")
            for i in range(5):
                t[i + 1] = t[i] * 0.9 + 0.1
            deferfuse.sync()
            outs.append(t)
        finally:
            ext.set_kernel(True)
    want = d.clone()
    for i in range(5):
        want[i + 1] = want[i] * 0.9 + 0.1
    assert_same(outs[0], want)
    assert_same(outs[1], want)
