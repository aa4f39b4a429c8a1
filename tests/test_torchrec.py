"""TorchRec on tpu (``pip install -e '.[torchrec]'``, or ``make test-torchrec``): the FBGEMM ops
TorchRec calls (deferfuse/fbgemm.py), ``KeyedJaggedTensor``, ``EmbeddingBagCollection`` and
``EmbeddingCollection`` forward and backward, a small DLRM trained a few steps, and a 2-rank
``DistributedModelParallel`` with fused SGD (tests/torchrec_worker.py, deferfuse/torchrec.py), each
against CPU eager on the same inputs (FBGEMM's own CPU kernels for its ops, gloo for the sharded
run), with no CPU fallback."""
import copy
import json
import os
import subprocess
import sys

import pytest
import torch

torchrec = pytest.importorskip("torchrec", reason="torchrec is optional (pip install -e '.[torchrec]')")

from torchrec import (EmbeddingBagCollection, EmbeddingBagConfig, EmbeddingCollection,  # noqa: E402
                      EmbeddingConfig, KeyedJaggedTensor, KeyedTensor, PoolingType)
from torchrec.models.dlrm import DLRM  # noqa: E402

from util import assert_same, cpu, free_port  # noqa: E402

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


def test_bounds_check_indices():
    """WARNING mode: indices out of their feature's table go to row 0, counted in ``warning``
    (-1, a pruned row, stays)."""
    rows = torch.tensor([5, 3, 7])
    offsets = fbgemm.asynchronous_complete_cumsum(LENGTHS)
    indices = torch.tensor([0, 4, 9, 1, 2, 3, -1, 6, 0, 7, -2, 2, 5])
    assert indices.numel() == int(LENGTHS.sum())
    want_i, want_w = indices.clone(), torch.zeros(1, dtype=torch.int64)
    got_i, got_w = indices.to("tpu"), want_w.to("tpu")
    fbgemm.bounds_check_indices(rows, want_i, offsets, 1, want_w)
    fbgemm.bounds_check_indices(rows.to("tpu"), got_i, offsets.to("tpu"), 1, got_w)
    assert int(want_w) > 0
    assert_same(got_i, want_i)
    assert_same(got_w, want_w)


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


# --------------------------------------------------------------------------------------------
# KeyedJaggedTensor

KEYS = ["f1", "f2", "f3"]


def _kjt(weighted=False, seed=0):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, 4, (len(KEYS) * 3,), generator=g)
    lengths[1] = 0                                        # an empty bag
    values = torch.randint(0, 10, (int(lengths.sum()),), generator=g)
    weights = torch.rand(values.shape, generator=g) if weighted else None
    return KeyedJaggedTensor.from_lengths_sync(keys=KEYS, values=values, lengths=lengths,
                                               weights=weights)


def _same_jt(got, want):
    """Two (Keyed)JaggedTensors hold the same keys, values, lengths, offsets, weights."""
    if hasattr(want, "keys"):
        assert got.keys() == want.keys()
    assert_same(got.values(), want.values())
    assert_same(got.lengths(), want.lengths())
    assert_same(got.offsets(), want.offsets())
    if want.weights_or_none() is None:
        assert got.weights_or_none() is None
    else:
        assert_same(got.weights(), want.weights())


@pytest.mark.parametrize("weighted", [False, True])
def test_kjt(weighted):
    k = _kjt(weighted)
    kt = k.to("tpu")            # before any CPU call on k: TorchRec's .to() copies its caches as is
    assert kt.device().type == "tpu" and kt.values().device.type == "tpu"
    _same_jt(kt, k)
    assert kt.length_per_key() == k.length_per_key() and kt.stride() == k.stride()
    d, dt = k.to_dict(), kt.to_dict()
    assert list(dt) == list(d)
    for key in d:
        _same_jt(dt[key], d[key])
        assert_same(dt[key].to_padded_dense(4), d[key].to_padded_dense(4))
    _same_jt(kt.permute([2, 0, 1]), k.permute([2, 0, 1]))
    _same_jt(kt.permute([1, 1]), k.permute([1, 1]))
    for got, want in zip(kt.split([1, 2]), k.split([1, 2])):
        _same_jt(got, want)
    _same_jt(kt["f2"], k["f2"])
    # Built on the device from its parts
    kd = KeyedJaggedTensor(keys=KEYS, values=k.values().to("tpu"), lengths=k.lengths().to("tpu"),
                           weights=_tpu(k.weights_or_none()))
    _same_jt(kd, k)
    assert kd.length_per_key() == k.length_per_key() and kd.offset_per_key() == k.offset_per_key()


def test_keyed_tensor_regroup():
    kts = [KeyedTensor(keys=["a", "b"], length_per_key=[2, 3], values=torch.randn(4, 5)),
           KeyedTensor(keys=["c"], length_per_key=[4], values=torch.randn(4, 4))]
    kts_t = [KeyedTensor(keys=t.keys(), length_per_key=t.length_per_key(), values=t.values().to("tpu"))
             for t in kts]
    for groups in ([["c", "a"], ["b"]], [["a", "c"], ["b", "a"]]):    # one-to-one, and a key reused
        assert_same(KeyedTensor.regroup(kts_t, groups), KeyedTensor.regroup(kts, groups))
    assert_same(kts_t[0]["b"], kts[0]["b"])
    d, dt = kts[1].to_dict(), kts_t[1].to_dict()
    assert_same(dt["c"], d["c"])


# --------------------------------------------------------------------------------------------
# Embedding collections, forward and backward

def _pair(module):
    """A CPU module and its copy on tpu."""
    return module, copy.deepcopy(module).to("tpu")


def _same_grads(mt, m):
    for (n, p), (nt, pt) in zip(m.named_parameters(), mt.named_parameters()):
        assert n == nt
        assert_same(pt.grad, p.grad, msg=n)


@pytest.mark.parametrize("weighted", [False, True])
def test_embedding_bag_collection(weighted):
    tables = [EmbeddingBagConfig(name="t1", embedding_dim=4, num_embeddings=10, feature_names=["f1", "f3"]),
              EmbeddingBagConfig(name="t2", embedding_dim=6, num_embeddings=12, feature_names=["f2"],
                                 # torch's embedding_bag weights only sum pooling
                                 pooling=PoolingType.SUM if weighted else PoolingType.MEAN)]
    m, mt = _pair(EmbeddingBagCollection(tables=tables, is_weighted=weighted, device=torch.device("cpu")))
    k = _kjt(weighted)
    kt = k.to("tpu")
    out, want = mt(kt), m(k)
    assert out.keys() == want.keys() and out.length_per_key() == want.length_per_key()
    assert_same(out.values(), want.values().detach())
    for key in want.keys():
        assert_same(out[key], want[key].detach())
    g = torch.randn(want.values().shape)
    want.values().backward(g)
    out.values().backward(g.to("tpu"))
    _same_grads(mt, m)


def test_embedding_collection():
    tables = [EmbeddingConfig(name="t1", embedding_dim=4, num_embeddings=10, feature_names=["f1", "f2"]),
              EmbeddingConfig(name="t3", embedding_dim=4, num_embeddings=10, feature_names=["f3"])]
    m, mt = _pair(EmbeddingCollection(tables=tables, device=torch.device("cpu")))
    k = _kjt()
    kt = k.to("tpu")
    out, want = mt(kt), m(k)
    assert list(out) == list(want)
    loss_t = loss = 0
    for key in want:
        _same_jt(out[key], want[key])
        assert_same(out[key].to_padded_dense(3), want[key].to_padded_dense(3).detach())
        loss = loss + (want[key].values() ** 2).sum() * len(key)
        loss_t = loss_t + (out[key].values() ** 2).sum() * len(key)
    loss.backward()
    loss_t.backward()
    _same_grads(mt, m)


# --------------------------------------------------------------------------------------------
# A DLRM trained a few steps

def test_dlrm_training():
    torch.manual_seed(0)
    tables = [EmbeddingBagConfig(name="t1", embedding_dim=8, num_embeddings=10, feature_names=["f1", "f3"]),
              EmbeddingBagConfig(name="t2", embedding_dim=8, num_embeddings=10, feature_names=["f2"])]
    ebc = EmbeddingBagCollection(tables=tables, device=torch.device("cpu"))
    m, mt = _pair(DLRM(embedding_bag_collection=ebc, dense_in_features=5,
                       dense_arch_layer_sizes=[16, 8], over_arch_layer_sizes=[8, 1]))
    opt = torch.optim.Adagrad(m.parameters(), lr=0.1)
    opt_t = torch.optim.Adagrad(mt.parameters(), lr=0.1)
    for step in range(3):
        k, x, y = _kjt(seed=step), torch.randn(3, 5), torch.rand(3, 1)
        kt = k.to("tpu")
        loss_t = torch.nn.functional.binary_cross_entropy_with_logits(mt(x.to("tpu"), kt), y.to("tpu"))
        loss = torch.nn.functional.binary_cross_entropy_with_logits(m(x, k), y)
        for o, l in ((opt, loss), (opt_t, loss_t)):
            o.zero_grad()
            l.backward()
            o.step()
        assert_same(loss_t, loss.detach(), atol=0, rtol=1e-5, msg=f"step {step}")
    for (n, p), (_, pt) in zip(m.named_parameters(), mt.named_parameters()):
        assert_same(pt, p.detach(), atol=1e-5, rtol=1e-5, msg=n)


# --------------------------------------------------------------------------------------------
# FBGEMM's table-batched embedding (what sharded TorchRec runs), with its fused SGD

@pytest.mark.parametrize("optim,pooling,weighted", [
    ("EXACT_SGD", "SUM", False), ("EXACT_SGD", "MEAN", False), ("EXACT_SGD", "SUM", True),
    ("EXACT_ROWWISE_ADAGRAD", "SUM", True), ("EXACT_ROWWISE_ADAGRAD", "MEAN", False)])
def test_tbe_fused_optimizer(optim, pooling, weighted):
    pytest.importorskip("deferfuse.torchrec")
    from fbgemm_gpu.split_embedding_configs import EmbOptimType
    from fbgemm_gpu.split_table_batched_embeddings_ops_common import EmbeddingLocation, PoolingMode
    from fbgemm_gpu.split_table_batched_embeddings_ops_training import (
        ComputeDevice, SplitTableBatchedEmbeddingBagsCodegen)

    specs = [(10, 4, EmbeddingLocation.HOST, ComputeDevice.CPU),
             (12, 8, EmbeddingLocation.HOST, ComputeDevice.CPU)]

    # FBGEMM's CPU row-wise Adagrad fails on a table shared by two features ("num of rows
    # processed by adagrad: 0 does not match c_block size"): one feature a table there.
    shared = optim == "EXACT_SGD"
    ftm = [0, 1, 0] if shared else [0, 1]

    def tbe(device):
        return SplitTableBatchedEmbeddingBagsCodegen(
            specs, feature_table_map=ftm, optimizer=getattr(EmbOptimType, optim),
            learning_rate=0.5, eps=1e-3, pooling_mode=getattr(PoolingMode, pooling), device=device)
    m, mt = tbe("cpu"), tbe("tpu")
    with torch.no_grad():
        mt.weights_host.copy_(m.weights_host)
    for step in range(2):
        k = _kjt(weighted, seed=step)
        k = k if shared else k.split([2, 1])[0]
        w = k.weights() if weighted else None
        want = m(k.values(), k.offsets(), per_sample_weights=w)
        got = mt(k.values().to("tpu"), k.offsets().to("tpu"), per_sample_weights=_tpu(w))
        assert_same(got, want.detach())
        g = torch.randn(want.shape)
        want.backward(g)
        got.backward(g.to("tpu"))
        assert_same(mt.weights_host, m.weights_host.detach(), msg=f"step {step}")
        if optim == "EXACT_ROWWISE_ADAGRAD":
            assert_same(mt.momentum1_host, m.momentum1_host, msg=f"step {step} state")


# --------------------------------------------------------------------------------------------
# Sharded: DistributedModelParallel, table-wise, fused SGD, against the same run on gloo

WORKER = os.path.join(os.path.dirname(__file__), "torchrec_worker.py")



@pytest.mark.modes("strict")        # the mode is the workers' (MODE), not this process's
@pytest.mark.slow_params("strict_workers", "rowwise_adagrad", "dlrm")
@pytest.mark.parametrize("mode,optim,model", [
    ("defer", "sgd", "ebc"), ("strict", "sgd", "ebc"), ("defer", "rowwise_adagrad", "ebc"),
    ("defer", "sgd", "dlrm")],
    ids=["defer_workers-sgd", "strict_workers-sgd", "defer_workers-rowwise_adagrad",
         "defer_workers-sgd-dlrm"])
def test_sharded_dmp_two_ranks(mode, optim, model):
    """2 ranks, 2 tables table-wise sharded, fused SGD (or row-wise Adagrad, slow), 3 steps: each
    rank's pooled outputs and shards within 1e-6 of the same model sharded by TorchRec on CPU over
    gloo. ``dlrm`` (slow): the tables in a DLRM whose dense part is DDP on each side, losses within
    1e-5 (relative), shards and dense weights within 1e-6."""
    port, n = free_port(), 2
    procs = []
    for r in range(n):
        env = dict(os.environ, RANK=str(r), WORLD_SIZE=str(n), LOCAL_RANK=str(r),
                   LOCAL_WORLD_SIZE=str(n), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                   JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1")
        env.pop("XLA_FLAGS", None)      # one CPU device per process
        procs.append(subprocess.Popen([sys.executable, WORKER, mode, optim, model], env=env, text=True,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE))
    results = []
    try:
        for r, p in enumerate(procs):
            so, se = p.communicate(timeout=400)
            assert p.returncode == 0, f"rank {r} exited with {p.returncode}:\n{so[-3000:]}\n{se[-6000:]}"
            line = [ln for ln in so.splitlines() if ln.startswith("RESULT ")]
            assert line, f"rank {r} printed no result:\n{so[-3000:]}"
            results.append(json.loads(line[-1][len("RESULT "):]))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert [x["rank"] for x in results] == [0, 1]
    assert sum(x["shards"] for x in results) == 2          # one table on each rank
    assert all(x["worst"] <= 1e-6 for x in results)
    if model == "dlrm":
        assert all(len(x["losses"]) == 3 for x in results)
