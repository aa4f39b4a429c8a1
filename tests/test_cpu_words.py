"""Bad arguments raise on tpu what they raise on CPU: the same exception type and CPU's message
(NOTE [CPU's words] in deferfuse/meta.py, NOTE [index checks] in runtime/lowering/__init__.py).

Each case runs on CPU first to get CPU's own error, then on tpu in strict and defer mode. Errors
that shapes and dtypes decide raise at the call in every mode; errors that depend on values (an
index out of range) are computed by the program and raised at the next read, in defer mode with
the op and its recorded line added after CPU's message.
"""
import re

import pytest
import torch
import torch.nn.functional as F

import deferfuse
from util import to_tpu


def _t(*v, dtype=None):
    return lambda: torch.tensor(v if len(v) > 1 or not isinstance(v[0], list) else v[0], dtype=dtype)


def _r(*shape, dtype=torch.float32):
    return lambda: torch.randn(*shape).to(dtype)


# name -> (function, makers of its inputs, whether the error depends on values)
CASES = {
    # products
    "matmul operator": (lambda a, b: a @ b, (_r(3, 4), _r(5, 6)), False),
    "matmul": (torch.matmul, (_r(3, 4), _r(5, 6)), False),
    "matmul 3-D by 2-D": (torch.matmul, (_r(2, 3, 4), _r(5, 6)), False),
    "matmul 1-D": (torch.matmul, (_r(4), _r(5)), False),
    "mm": (torch.mm, (_r(3, 4), _r(5, 6)), False),
    "mm float and double": (torch.mm, (_r(3, 4), _r(4, 5, dtype=torch.float64)), False),
    "bmm": (torch.bmm, (_r(2, 3, 4), _r(2, 5, 6)), False),
    "bmm batch": (torch.bmm, (_r(2, 3, 4), _r(3, 4, 6)), False),
    "addmm": (torch.addmm, (_r(3, 6), _r(3, 4), _r(5, 6)), False),
    "mv": (torch.mv, (_r(3, 4), _r(5)), False),
    "dot": (torch.dot, (_r(3), _r(4)), False),
    "linear": (F.linear, (_r(3, 4), _r(6, 5)), False),
    "linear bias": (F.linear, (_r(3, 4), _r(6, 4), _r(5)), False),
    "nn.Linear": (lambda x: torch.nn.Linear(5, 2).to(x.device)(x), (_r(3, 4),), False),
    # views, concatenation, broadcasting
    "view size": (lambda x: x.view(5, 3), (_r(3, 4),), False),
    "view strides": (lambda x: x.t().view(12), (_r(3, 4),), False),
    "view two -1": (lambda x: x.view(-1, -1), (_r(3, 4),), False),
    "reshape": (lambda x: x.reshape(5, -1), (_r(3, 4),), False),
    "expand": (lambda x: x.expand(2, 5), (_r(3),), False),
    "cat sizes": (lambda a, b: torch.cat([a, b]), (_r(3, 4), _r(3, 5)), False),
    "cat dim": (lambda a, b: torch.cat([a, b], dim=3), (_r(3, 4), _r(3, 4)), False),
    "cat ranks": (lambda a, b: torch.cat([a, b]), (_r(3, 4), _r(4)), False),
    "stack": (lambda a, b: torch.stack([a, b]), (_r(3, 4), _r(3, 5)), False),
    "broadcast add": (lambda a, b: a + b, (_r(3, 4), _r(5)), False),
    "broadcast mul": (lambda a, b: a * b, (_r(2, 3), _r(4, 3)), False),
    "broadcast in place": (lambda a, b: a.add_(b), (_r(3), _r(2, 3)), False),
    "where": (lambda a, b: torch.where(a > 0, a, b), (_r(3), _r(4)), False),
    "layer_norm": (lambda x: F.layer_norm(x, (5,)), (_r(3, 4),), False),
    "conv channels": (lambda x: torch.nn.Conv2d(3, 4, 3).to(x.device)(x), (_r(1, 2, 8, 8),), False),
    "mse_loss sizes": (F.mse_loss, (_r(3, 3), _r(3, 2)), False),
    # dtypes
    "add_ float into long": (lambda a, b: a.add_(b), (_r(3, dtype=torch.int64), _r(3)), False),
    "mul_ float into bool": (lambda a, b: a.mul_(b), (_r(3, dtype=torch.bool), _r(3)), False),
    "mul_ 2.5 into long": (lambda a: a.mul_(2.5), (_r(3, dtype=torch.int64),), False),
    "index_add source dtype": (lambda a, i, s: a.index_add(0, i, s),
                               (_r(3, 4), _t(0, 1), _r(2, 4, dtype=torch.float64)), False),
    "scatter src dtype": (lambda a, i, s: a.scatter(0, i, s),
                          (_r(3, 4), _t([[0, 1, 2, 0]]), _r(1, 4, dtype=torch.float64)), False),
    "masked_fill float mask": (lambda a: a.masked_fill(a, 1.0), (_r(3),), False),
    "bitwise_and float": (lambda a, b: a & b, (_r(3), _r(3)), False),
    "index_select float index": (lambda x, i: x.index_select(0, i), (_r(3, 4), _t(0., 1.)), False),
    "gather float index": (lambda x, i: x.gather(1, i), (_r(3, 4), _t([[0., 1.]])), False),
    "index_add float index": (lambda x, i: x.index_add(0, i, torch.ones(2, 4, device=x.device)),
                              (_r(3, 4), _t(0., 1.)), False),
    "take float index": (torch.take, (_r(3, 4), _t(0., 1.)), False),
    "indexing float index": (lambda x, i: x[i], (_r(3, 4), _t(0., 1.)), False),
    "embedding float index": (lambda w, i: F.embedding(i, w), (_r(10, 3), _t(0., 1.)), False),
    "nll_loss float target": (F.nll_loss, (_r(3, 4), _t(0., 1., 2.)), False),
    "dim out of range": (lambda x: x.sum(3), (_r(3),), False),
    # values: indices out of range, with the index named as CPU names it
    "index_select": (lambda x, i: x.index_select(0, i), (_r(3, 4), _t(0, 5, 7)), True),
    "index_select dim 1": (lambda x, i: x.index_select(1, i), (_r(3, 4), _t(0, 9)), True),
    "index_select negative": (lambda x, i: x.index_select(0, i), (_r(3, 4), _t(0, -1)), True),
    "embedding": (lambda w, i: F.embedding(i, w), (_r(10, 4), _t([1, 2], [3, 12])), True),
    "embedding negative": (lambda w, i: F.embedding(i, w), (_r(10, 4), _t(0, -1)), True),
    "gather": (lambda x, i: x.gather(1, i), (_r(3, 4), _t([0, 5], [7, 1], [2, 2])), True),
    "gather negative": (lambda x, i: x.gather(1, i), (_r(3, 4), _t([0, -1], [1, 1])), True),
    "scatter": (lambda x, i: x.scatter(1, i, 1.0), (_r(3, 4), _t([0, 5], [7, 1], [2, 2])), True),
    "scatter_add": (lambda x, i: x.scatter_add(1, i, torch.ones(3, 2, device=x.device)),
                    (_r(3, 4), _t([0, 5], [7, 1], [2, 2])), True),
    "index_add": (lambda x, i: x.index_add(0, i, torch.ones(2, 4, device=x.device)),
                  (_r(3, 4), _t(0, 5)), True),
    "index_copy": (lambda x, i: x.index_copy(0, i, torch.ones(2, 4, device=x.device)),
                   (_r(3, 4), _t(0, 5)), True),
    "index_fill": (lambda x, i: x.index_fill(0, i, 1.0), (_r(3, 4), _t(0, -5)), True),
    "indexing": (lambda x, i: x[i], (_r(3, 4), _t(0, 5, 7)), True),
    "indexing negative": (lambda x, i: x[i], (_r(3, 4), _t(0, -5)), True),
    "indexing second dim": (lambda x, i: x[:, i], (_r(3, 4), _t(0, 9)), True),
    "indexing two tensors": (lambda x, i, j: x[i, j], (_r(3, 4), _t(0, 1), _t(0, 9)), True),
    "index_put": (lambda x, i: x.index_put((i,), torch.tensor(1.0, device=x.device)),
                  (_r(3, 4), _t(0, 5)), True),
    "setitem": (lambda x, i: x.__setitem__(i, 1.0) or x, (_r(3, 4), _t(0, 5)), True),
    "take": (torch.take, (_r(3, 4), _t(0, 13, 15)), True),
    "take negative": (torch.take, (_r(3, 4), _t(0, -13)), True),
    "cross_entropy target": (F.cross_entropy, (_r(3, 4), _t(0, 5, 1)), True),
    "nll_loss target": (F.nll_loss, (_r(3, 4), _t(0, -5, 1)), True),
    "one_hot": (lambda t: F.one_hot(t, 3), (_t(0, 4),), True),
}


def _run(fn, inputs):
    out = fn(*inputs)
    # A read: deferred errors raise here, as CUDA reports device asserts at the next sync.
    for o in (out if isinstance(out, (tuple, list)) else (out,)):
        if isinstance(o, torch.Tensor):
            o.cpu()


@pytest.mark.parametrize("name", list(CASES))
def test_tpu_raises_cpu_words(name, tpu_mode):
    fn, makers, by_value = CASES[name]
    torch.manual_seed(0)
    inputs = [m() for m in makers]
    with pytest.raises(Exception) as cpu:
        _run(fn, [x.clone() for x in inputs])
    want = cpu.value
    with pytest.raises(Exception) as tpu:
        _run(fn, to_tpu(inputs))
    got = tpu.value
    assert type(got) is type(want), f"tpu raised {type(got).__name__}: {got}; CPU {type(want).__name__}: {want}"
    if by_value and tpu_mode == "defer":
        # Raised at the read, after the op ran inside a fused program: CPU's words, then where.
        assert re.fullmatch(re.escape(str(want)) + r" \(aten\.\S+ recorded at .+:\d+\)", str(got)), \
            f"{got!s} vs CPU's {want!s}"
    else:
        assert str(got) == str(want)


@pytest.mark.slow_params("strict")   # long: defer only in the default run
def test_cpu_words_leave_the_next_ops_working(tpu_mode):
    # An error in the middle of a program: the values before it and the ops after it are right.
    x = torch.randn(4, 4)
    t = x.to("tpu")
    y = t * 2
    with pytest.raises(RuntimeError, match=re.escape("mat1 and mat2 shapes cannot be multiplied (4x4 and 3x4)")):
        t @ torch.randn(3, 4, device="tpu")
    z = (y @ t).sum(0)
    torch.testing.assert_close(z.cpu(), (x * 2 @ x).sum(0))
    deferfuse.sync()
