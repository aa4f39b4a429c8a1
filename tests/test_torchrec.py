"""TorchRec on tpu (``pip install -e '.[torchrec]'``, or ``make test-torchrec``): the FBGEMM ops
TorchRec calls (deferfuse/fbgemm.py), ``KeyedJaggedTensor``, ``EmbeddingBagCollection`` and
``EmbeddingCollection`` forward and backward, and a small DLRM trained a few steps, each against
CPU eager on the same inputs (FBGEMM's own CPU kernels for its ops), with no CPU fallback."""
import copy

import pytest
import torch

torchrec = pytest.importorskip("torchrec", reason="torchrec is optional (pip install -e '.[torchrec]')")

from torchrec import (EmbeddingBagCollection, EmbeddingBagConfig, EmbeddingCollection,  # noqa: E402
                      EmbeddingConfig, KeyedJaggedTensor, KeyedTensor, PoolingType)
from torchrec.models.dlrm import DLRM  # noqa: E402

from util import assert_same, cpu  # noqa: E402

pytestmark = pytest.mark.usefixtures("no_cpu_fallbacks")
fbgemm = torch.ops.fbgemm


def _tpu(x):
    if isinstance(x, torch.Tensor):
        return x.to("tpu")
    if isinstance(x, (list, tuple)):
        return type(x)(_tpu(y) for y in x)
    return x


def _same_op(op, *args, atol=1e-5, rtol=1.3e-6):
    """``op`` on tpu copies of ``args`` gives what FBGEMM's CPU kernel gives."""
    want = op(*args)
    got = op(*_tpu(list(args)))
    if isinstance(want, (list, tuple)):
        assert len(got) == len(want)
        for g, w in zip(got, want):
            if w is None:
                assert g is None
            else:
                assert_same(g, w, atol, rtol)
    else:
        assert_same(got, want, atol, rtol)


# --------------------------------------------------------------------------------------------
# FBGEMM ops, each against its CPU kernel

LENGTHS = torch.tensor([2, 0, 1, 3, 1, 0, 0, 4, 2])    # 3 keys x batch 3, empty bags included


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_cumsums(dtype):
    t = LENGTHS.to(dtype)
    _same_op(fbgemm.asynchronous_complete_cumsum, t)
    _same_op(fbgemm.asynchronous_complete_cumsum, t.view(3, 3))
    _same_op(fbgemm.asynchronous_inclusive_cumsum, t)
    _same_op(fbgemm.asynchronous_exclusive_cumsum, t)


@pytest.mark.parametrize("permute", [[2, 0, 1], [1, 1, 0], [2]])
def test_permute_sparse_data(permute):
    n = int(LENGTHS.sum())
    values, weights = torch.randint(0, 100, (n,)), torch.rand(n)
    p = torch.tensor(permute, dtype=torch.int32)
    total = int(LENGTHS.view(3, 3)[permute].sum())
    for sum_ in (total, None):       # given (TorchRec always gives it) and read from the data
        _same_op(fbgemm.permute_2D_sparse_data, p, LENGTHS.view(3, 3), values, weights, sum_)
        _same_op(fbgemm.permute_2D_sparse_data, p, LENGTHS.view(3, 3), values, None, sum_)
        _same_op(fbgemm.permute_2D_sparse_data_input1D, p, LENGTHS, values, 3, weights, sum_)
    lengths1d = LENGTHS[:3]
    _same_op(fbgemm.permute_1D_sparse_data, p, lengths1d, values[:int(lengths1d.sum())], None,
             None)


def test_segment_sum_csr_and_offsets_range():
    values = torch.randn(12)
    _same_op(fbgemm.segment_sum_csr, 2, torch.tensor([0, 1, 1, 4, 6], dtype=torch.int32), values)
    _same_op(fbgemm.segment_sum_csr, 1, torch.tensor([0, 3, 9], dtype=torch.int32),
             LENGTHS.to(torch.int32))
    offsets = fbgemm.asynchronous_complete_cumsum(LENGTHS)
    _same_op(fbgemm.offsets_range, offsets, int(LENGTHS.sum()))
    _same_op(fbgemm.offsets_range, offsets[:-1].contiguous(), int(LENGTHS.sum()))


@pytest.mark.parametrize("inner", [(), (3,)])
def test_jagged_to_padded_dense(inner):
    offsets = fbgemm.asynchronous_complete_cumsum(LENGTHS)
    n = int(LENGTHS.sum())
    x = torch.randn(n, *inner, requires_grad=True)
    xt = x.detach().to("tpu").requires_grad_()
    for max_len in (2, 5):
        want = fbgemm.jagged_to_padded_dense(x, [offsets], [max_len], -1.5)
        got = fbgemm.jagged_to_padded_dense(xt, [offsets.to("tpu")], [max_len], -1.5)
        assert_same(got, want.detach())
        g = torch.randn(want.shape)
        want.backward(g)
        got.backward(g.to("tpu"))
        assert_same(xt.grad, x.grad)


def test_permute_pooled_embs():
    x = torch.randn(4, 10, requires_grad=True)
    xt = x.detach().to("tpu").requires_grad_()
    dims = torch.tensor([0, 2, 5, 6, 10])                 # 4 keys of widths 2, 3, 1, 4
    perm = torch.tensor([2, 0, 3, 1])
    inv = torch.argsort(perm)
    inv_dims = torch.cat([torch.zeros(1, dtype=torch.long), (dims.diff()[perm]).cumsum(0)])
    args = (dims, perm, inv_dims, inv)
    want = fbgemm.permute_pooled_embs_auto_grad(x, *args)
    got = fbgemm.permute_pooled_embs_auto_grad(xt, *_tpu(list(args)))
    assert_same(got, want.detach())
    g = torch.randn(want.shape)
    want.backward(g)
    got.backward(g.to("tpu"))
    assert_same(xt.grad, x.grad)
