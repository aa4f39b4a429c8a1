"""Aliasing through views and in-place writes matches CPU eager exactly."""
import copy
import io
import warnings

import pytest
import torch

from util import assert_same

WRITES = {
    "setitem_row": lambda x: x.__setitem__(0, 1.0),
    "column_add_": lambda x: x[:, 1].add_(2),
    "t_mul_": lambda x: x.t().mul_(3),
    "view_flat_setitem": lambda x: x.view(-1).__setitem__(3, 0.0),
    "diagonal_zero_": lambda x: x.diagonal().zero_(),
    "unsqueeze_copy_": lambda x: x[2:4, ::2].unsqueeze(0).copy_(
        torch.full((1, 2, 3), 7.0, device=x.device)),
    "split_neg_": lambda x: x.split(2, dim=1)[1].neg_(),
    "unbind_add_": lambda x: x.unbind(0)[3].add_(100),
    "narrow_fill_": lambda x: x.narrow(1, 2, 3).fill_(-5),
    "strided_slice": lambda x: x[::2, 1::2].mul_(-1),
    "select_neg_idx": lambda x: x[-1, -2:].sub_(9),
    "chunk_clamp_": lambda x: x.chunk(2, 0)[0].clamp_(0, 10),
    "permute_view": lambda x: x.view(2, 2, 6).permute(2, 0, 1)[1].add_(1),
    "index_put": lambda x: x.__setitem__((torch.tensor([0, 2], device=x.device),
                                         torch.tensor([1, 3], device=x.device)), -3.0),
    "masked_fill_": lambda x: x.masked_fill_(x > 10, 0.0),
    "unfold_mul_": lambda x: x[0].unfold(0, 2, 2).mul_(10),
    "as_strided": lambda x: x.as_strided((2, 2), (6, 1), 1).add_(0.5),
    "transpose_copy_": lambda x: x.transpose(0, 1)[1:3].copy_(torch.zeros(2, 4, device=x.device)),
    "expand_read": lambda x: x[1:].add_(x[0:1].clone().expand(3, 6)),
    "squeeze_write": lambda x: x[1:2].squeeze(0).add_(4),
}


def _on(dev, write):
    x = torch.arange(24, dtype=torch.float32).reshape(4, 6).to(dev)
    other = x[1]                      # a view taken before the write
    t = x.t()
    write(x)
    return x, other, t, other * 1


@pytest.mark.parametrize("name", list(WRITES))
def test_write_through_view(name):
    want = _on("cpu", WRITES[name])
    got = _on("tpu", WRITES[name])
    for g, w in zip(got, want):
        assert_same(g, w, msg=name)


def test_view_metadata_matches_cpu():
    x = torch.randn(4, 6)
    t = x.to("tpu")
    for f in (lambda a: a.t(), lambda a: a[:, 1:5:2], lambda a: a.view(2, 12), lambda a: a.permute(1, 0),
              lambda a: a.unsqueeze(1), lambda a: a[1], lambda a: a.diagonal(), lambda a: a.expand(3, 4, 6),
              lambda a: a.t().contiguous(), lambda a: a + 1, lambda a: a.t() * 2):
        w, g = f(x), f(t)
        assert g.shape == w.shape and g.stride() == w.stride()
        assert g.storage_offset() == w.storage_offset()
        assert g.is_contiguous() == w.is_contiguous()
        assert_same(g, w)


def test_inplace_view_ops_change_the_tensor_itself():
    def run(dev):
        x = torch.arange(24, dtype=torch.float32).reshape(1, 4, 6).to(dev)
        base = x
        y = x[0:1]                 # a view taken before the in-place view ops
        x.squeeze_(0)
        x.t_()
        x.unsqueeze_(1)
        x.transpose_(0, 2)
        x.swapdims_(1, 2)
        x.mul_(2)                  # a write through the reshaped tensor reaches y
        meta = (tuple(x.shape), x.stride(), x.storage_offset(), x is base)
        return meta, x, y
    (wm, w, wy), (gm, g, gy) = run("cpu"), run("tpu")
    assert gm == wm
    assert_same(g, w)
    assert_same(gy, wy)


def test_vector_matrix_products():
    # at::matmul lowers 1-D @ 2-D through unsqueeze(0) ... squeeze_(0)
    v, m = torch.randn(3), torch.randn(3, 4)
    assert_same(v.to("tpu") @ m.to("tpu"), v @ m, rtol=1e-5)
    assert_same(m.t().to("tpu") @ v.to("tpu"), m.t() @ v, rtol=1e-5)
    b = torch.randn(2, 5, 3)
    assert_same(b.to("tpu") @ v.to("tpu"), b @ v, rtol=1e-5)
    assert_same(v.to("tpu") @ b.transpose(1, 2).to("tpu"), v @ b.transpose(1, 2), rtol=1e-5)


def test_view_of_noncontiguous_raises_like_cpu():
    x = torch.randn(4, 6)
    with pytest.raises(RuntimeError, match="view size is not compatible"):
        x.t().view(-1)
    with pytest.raises(RuntimeError, match="view size is not compatible"):
        x.to("tpu").t().view(-1)
    assert_same(x.to("tpu").t().reshape(-1), x.t().reshape(-1))


def test_out_argument():
    a, b = torch.randn(3, 4), torch.randn(3, 4)
    out_cpu = torch.empty(3, 4)
    out_tpu = torch.empty(3, 4, device="tpu")
    r = torch.add(a.to("tpu"), b.to("tpu"), out=out_tpu)
    torch.add(a, b, out=out_cpu)
    assert r is out_tpu
    assert_same(out_tpu, out_cpu)
    view = out_tpu[1]
    torch.mul(a[0].to("tpu"), 2, out=view)
    torch.mul(a[0], 2, out=out_cpu[1])
    assert_same(out_tpu, out_cpu)


@pytest.mark.slow_params("strict")   # long: defer only in the default run
def test_nn_init_in_place():
    for init in (torch.nn.init.zeros_, torch.nn.init.ones_, lambda w: torch.nn.init.constant_(w, 0.3),
                 torch.nn.init.eye_):
        w_cpu, w = torch.empty(3, 5), torch.empty(3, 5, device="tpu")
        init(w_cpu)
        init(w)
        assert_same(w, w_cpu)
    w = torch.empty(64, 64, device="tpu")
    torch.nn.init.kaiming_uniform_(w, a=5 ** 0.5)
    bound = 1 / 8
    assert w.abs().max().item() <= bound + 1e-6 and w.std().item() > bound / 3


def test_detach_shares_storage():
    x = torch.zeros(3, device="tpu", requires_grad=True)
    d = x.detach()
    d.add_(1)
    assert torch.equal(x.detach().cpu(), torch.ones(3))


@pytest.mark.parametrize("case", ["slice", "slice_step_neg", "slice_clamped", "select", "select_neg"])
def test_slice_and_select_backward_and_scatter_are_one_op(case, no_cpu_fallbacks):
    """The gradient of a slice or a selected row, and slice_scatter/select_scatter, record one op
    each (they were composites: new_zeros and a copy through a view), with CPU's values."""
    import deferfuse
    read, scatter = {
        "slice": (lambda x: x[:, 1:5], lambda x, s: torch.slice_scatter(x, s, 1, 1, 5)),
        "slice_step_neg": (lambda x: x[-3:, ::2], lambda x, s: torch.slice_scatter(x, s, 0, -3, None, 1)),
        "slice_clamped": (lambda x: x[2:100], lambda x, s: torch.slice_scatter(x, s, 0, 2, 100)),
        "select": (lambda x: x[:, 0], lambda x, s: torch.select_scatter(x, s, 1, 0)),
        "select_neg": (lambda x: x[-1], lambda x, s: torch.select_scatter(x, s, 0, -1)),
    }[case]
    x = torch.randn(4, 6)
    src = torch.randn(read(x).shape)
    g = torch.randn(read(x).shape)
    xc = x.clone().requires_grad_()
    read(xc).backward(g)
    xt = x.to("tpu").requires_grad_()
    gt = g.to("tpu")
    y = read(xt)
    deferfuse.sync()
    deferfuse.reset_metrics()
    y.backward(gt)
    deferfuse.sync()
    m = deferfuse.metrics()
    assert m["ops_recorded"] + m["ops_eager"] == (2 if case == "slice_step_neg" else 1)  # a slice each
    assert_same(xt.grad, xc.grad)
    # slice_scatter's source has the slice's shape: for "slice_step_neg" the rows -3: whole
    if case == "slice_step_neg":
        src = torch.randn(3, 6)
    assert_same(scatter(x.to("tpu"), src.to("tpu")), scatter(x, src))


def _windows(dev):
    """Views with an offset or index argument, taken one after another on one tensor and on views
    of it, so that each meets the view cache entries of the ones before (NOTE [view cache keys])."""
    x = torch.arange(36, dtype=torch.float32).reshape(6, 6).to(dev)
    outs = [torch.as_strided(x, (2, 2), (4, 1)), torch.as_strided(x, (2, 2), (4, 1), 1),
            torch.as_strided(x, (2, 2), (4, 1), 2), x[2:1], x[1:3], x[2:1, 1]]
    for i in range(3):
        row, rows = x[i], x[i:i + 2]
        outs += [torch.as_strided(row, (2, 2), (1, 1)), torch.as_strided(row, (2, 2), (1, 1), 3),
                 torch.as_strided(rows, (2,), (1,)), rows.select(0, 1).as_strided((2,), (2,)),
                 rows.narrow(1, i, 2), x.narrow(0, i, 2), x.select(1, i), x[i:i + 2],
                 torch.diagonal(x, i), torch.diagonal(rows, 1 - i), x.unfold(0, 2, i + 1),
                 rows.unfold(1, 3, 3 - i)]
    torch.as_strided(x[2], (2,), (1,)).mul_(-1)     # a write through an as_strided of a moved row
    x[3:4].as_strided((3,), (2,)).add_(100)
    return [(o.stride(), o.storage_offset(), o.clone()) for o in outs] + [((), 0, x)]


@pytest.mark.modes("defer")   # views record nothing: the cache is the same in every mode
def test_view_cache_keys_hold_the_whole_view():
    """as_strided with and without an offset, x[2:1] and x[i:i+2], and as_strided (no offset) of
    x[i] for each i were served one another's cached views: a ValueError, or silently the first
    row's values."""
    want = _windows("cpu")
    got = _windows("tpu")
    for i, ((gs, go, g), (ws, wo, w)) in enumerate(zip(got, want)):
        assert (gs, go) == (ws, wo), i
        assert_same(g, w, msg=str(i))


def test_as_strided_with_and_without_offset():
    x = torch.randn(4, 4)
    t = x.to("tpu")
    assert_same(torch.as_strided(t, (2, 2), (4, 1)), torch.as_strided(x, (2, 2), (4, 1)))
    assert_same(torch.as_strided(t, (2, 2), (4, 1), 1), torch.as_strided(x, (2, 2), (4, 1), 1))


# --- as_subclass and _make_subclass (PyTorch's own on the plain tensor) ----------------------------

class _Plain(torch.Tensor):
    pass


class _Slotted(torch.Tensor):
    __slots__ = ["tag"]


class _Logged(torch.Tensor):
    """A __torch_function__ subclass that refuses foreign types, as many do."""
    seen: list = []

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if not all(issubclass(cls, t) for t in types):
            return NotImplemented
        _Logged.seen.append(func.__name__)
        return super().__torch_function__(func, types, args, kwargs or {})


class _MyParam(torch.nn.Parameter):
    pass


class TableBatchedEmbeddingSlice(torch.nn.Parameter):
    """As TorchRec writes it: a slice of a table-batched embedding's flat weights, made with
    ``as_subclass`` in ``__new__``, whose ``grad`` reads the weights' gradient."""

    __slots__ = ["_original_tensor", "_start_offset", "_end_offset", "_num_embeddings",
                 "_embedding_dim"]

    def __init__(self, data, start_offset, end_offset, num_embeddings, embedding_dim):
        super().__init__()
        self._original_tensor = data
        self._start_offset = start_offset
        self._end_offset = end_offset
        self._num_embeddings = num_embeddings
        self._embedding_dim = embedding_dim
        self._init_grad = None
        if self._original_tensor.requires_grad:
            self.retain_grad()

    def __new__(cls, data, start_offset, end_offset, num_embeddings, embedding_dim):
        return data[start_offset:end_offset].view(num_embeddings, embedding_dim).as_subclass(cls)

    def __deepcopy__(self, memo):
        if id(self) not in memo:
            memo[id(self)] = TableBatchedEmbeddingSlice(
                self._original_tensor.clone(), self._start_offset, self._end_offset,
                self._num_embeddings, self._embedding_dim)
        return memo[id(self)]

    @property
    def grad(self):
        if self._original_tensor.grad is None:
            return self._init_grad
        return self._original_tensor.grad[self._start_offset:self._end_offset].view(
            self._num_embeddings, self._embedding_dim)

    @property
    def grad_fn(self):
        return None


def _kind(t):
    """A tensor's class as a test compares it: a tpu tensor's plain class is torch.Tensor's."""
    if type(t).__name__ == "TpuTensor":
        return "Tensor"
    return type(t).__name__ if isinstance(t, torch.Tensor) else t


def _subclasses(dev):
    torch.manual_seed(0)
    x = torch.randn(6, 4).to(dev)
    out = []
    r = x[2:4].as_subclass(_Plain)              # the reproduction
    y = r * 2 + x[0]
    out += [_kind(r), _kind(y), y, _kind(r.sum()), _kind(r[0]), _kind(torch.cat([x, r])),
            _kind(x[:2] + r), _kind(r.cpu()), r.cpu().device.type, _kind(r.detach())]
    r.add_(10)                                  # written through the subclass ...
    x[2, 0] = -1.0                              # ... and through the tensor
    out += [x, r, isinstance(r, _Plain), r.storage_offset()]
    r.t_()                                      # a change to the tensor itself
    out += [r.shape, r.stride(), r]
    s = x.as_subclass(_Slotted)
    s.tag = "slot"
    out += [_kind(s), s.tag, _kind(s.exp()), s.exp()]
    buf = io.BytesIO()
    torch.save(s, buf)
    buf.seek(0)
    s2 = torch.load(buf, weights_only=False)    # its class and its slot come back
    out += [_kind(s2), s2.tag, s2]
    for i in range(3):                          # rows at moving offsets
        out.append(x[i].as_subclass(_Plain) + 0)
    _Logged.seen.clear()
    w = torch.randn(3, 4).to(dev).requires_grad_()
    t = w.as_subclass(_Logged)                  # keeps the graph
    loss = (t * t).sum()
    loss.backward()
    out += [_kind(t), t.requires_grad, t.is_leaf, _kind(loss), w.grad, list(_Logged.seen)]
    m = torch.Tensor._make_subclass(_Plain, w, True)    # a leaf of its own
    (m * 3).sum().backward()
    out += [_kind(m), m.is_leaf, m.grad_fn, m.grad, w.grad]
    with torch.no_grad():
        m.mul_(0.5)                              # shares w's value
    out += [w]
    p = _MyParam(torch.ones(3).to(dev))
    q = torch.Tensor._make_subclass(_MyParam, x[1], False)
    out += [_kind(p), isinstance(p, torch.nn.Parameter), p.requires_grad, p.is_leaf, _kind(p * 2),
            _kind(q), q.requires_grad]
    return out


def test_as_subclass_of_a_view():
    x = torch.arange(8.0).reshape(4, 2)
    t = x.to("tpu")
    r, w = t[2:4].as_subclass(_Plain), x[2:4].as_subclass(_Plain)
    m = torch.Tensor._make_subclass(_Plain, t, True)
    assert type(r).__name__ == type(m).__name__ == "_Plain" and isinstance(r + 1, _Plain)
    assert m.is_leaf and m.requires_grad and not t.requires_grad
    assert_same((r + 1).as_subclass(torch.Tensor), (w + 1).as_subclass(torch.Tensor))


@pytest.mark.modes("defer")     # the classes' own paths are the same in every mode
def test_as_subclass_and_make_subclass_match_cpu():
    """Plain, __slots__ and __torch_function__ subclasses and a Parameter subclass on tpu: the
    classes, shared values, autograd and results CPU gives (as_subclass said "already associated
    to a python object of type TpuTensor")."""
    want = _subclasses("cpu")
    got = _subclasses("tpu")
    assert len(got) == len(want)
    for i, (g, w) in enumerate(zip(got, want)):
        if isinstance(w, torch.Tensor):
            assert isinstance(g, type(w)), (i, type(g), type(w))
            assert_same(g, w.as_subclass(torch.Tensor) if type(w) is not torch.Tensor else w,
                        msg=str(i))
        else:
            assert g == w, (i, g, w)


def _table_batched(dev):
    torch.manual_seed(0)
    weights = torch.nn.Parameter(torch.randn(20).to(dev))   # a TBE's flat weights
    tables = [TableBatchedEmbeddingSlice(weights, 0, 12, 3, 4),
              TableBatchedEmbeddingSlice(weights, 12, 20, 4, 2)]
    mod = torch.nn.Module()
    for k, t in enumerate(tables):
        mod.register_parameter(f"t{k}", t)
    idx = torch.tensor([[0, 2], [1, 1]]).to(dev)
    loss = sum((torch.nn.functional.embedding(idx.clamp(max=t.shape[0] - 1), t) ** 2).sum()
               for t in tables)
    loss.backward()
    mod.to(dev)                                  # where they are already: kept
    copied = copy.deepcopy(tables[0])
    out = [[_kind(t) for t in mod.parameters()], loss, weights.grad, tables[0].grad,
           tables[1].grad, [t.shape for t in tables], _kind(copied), copied * 1]
    with torch.no_grad():
        weights.sub_(0.1 * weights.grad)         # the optimizer updates the flat weights ...
        tables[1][0].fill_(5.0)                  # ... and a write through a slice reaches them
    out += [tables[0] * 1, tables[1] * 1, weights, _kind(tables[0] * 1)]
    return out


@pytest.mark.modes("defer")
def test_torchrec_table_batched_embedding_slice():
    want, got = _table_batched("cpu"), _table_batched("tpu")
    for i, (g, w) in enumerate(zip(got, want)):
        if isinstance(w, torch.Tensor):
            assert_same(g, w.detach().as_subclass(torch.Tensor), rtol=1e-5, msg=str(i))
        else:
            assert g == w, (i, g, w)


def test_views_of_normal_tensors_in_inference_mode():
    """Under torch.inference_mode(), a view (or detach) of a tensor made outside it is a normal
    tensor sharing the base's version counter, as on CPU; a view of an inference tensor is an
    inference tensor; computed results are inference tensors (NOTE [views in inference mode]).
    vLLM's model runner slices its persistent buffers this way."""
    for dev in ("cpu", "tpu"):
        x = torch.arange(16.0).reshape(4, 4).to(dev)
        with torch.inference_mode():
            y = torch.ones(4, 4, device=dev)
            z, d, w = x[1:3], x.detach(), y.t()[0]
            got = (z.is_inference(), d.is_inference(), w.is_inference(), (z * 2).is_inference())
            assert got == (False, False, True, True), (dev, got)
            assert (z * 2).sum().item() == 2 * sum(range(4, 12))
        z.add_(1)                                  # outside: the view writes through to its base
        assert x._version == z._version == 1
        assert x[1:3].sum().item() == sum(range(4, 12)) + 8


def _resizes(dev):
    """resize_ and resize_as_ as a user calls them; each step's tensor (values, shape, strides)."""
    out = []
    x = torch.arange(6.0, device=dev)
    for size in ((2, 3), (4,), (3, 2)):            # within the storage: a view of the same elements
        out.append(x.resize_(*size).clone())
    y = torch.arange(12, device=dev).reshape(3, 4)
    v = y[1]
    v.resize_(2, 2)                                 # a view keeps its offset, reaches into row 2
    out.append(v.clone())
    v.fill_(7)                                      # and writes through to its base
    out.append(y.clone())
    z = torch.arange(4, device=dev)
    z.resize_(2, 4)                                 # grows its storage: the old elements stay
    out.append(z[0].clone())
    z[1] = 5
    out.append(z.clone())
    e = torch.empty(0, device=dev)
    out.append(e.resize_(2, 3).fill_(2))
    c = torch.arange(24.0, device=dev)
    c.resize_(1, 2, 3, 4, memory_format=torch.channels_last)
    out.append(torch.tensor(c.stride(), device=dev))
    r = torch.zeros(5, device=dev)
    r.resize_as_(torch.ones(2, 2))
    out.append(torch.tensor(r.shape, device=dev))
    s, src = torch.zeros(2, 3, device=dev), torch.arange(6.0, device=dev)[1:5]
    s.set_(src)                                     # another shape and offset: src's storage
    s[0] = 50
    out += [src.clone(), torch.tensor([*s.shape, *s.stride(), s.storage_offset()], device=dev)]
    return out


@pytest.mark.slow_params("strict")   # defer only in the default run
def test_resize_as_on_cpu(tpu_mode):
    for got, want in zip(_resizes("tpu"), _resizes("cpu"), strict=True):
        assert_same(got, want)
    y = torch.arange(6, device="tpu")
    v = y[:2]
    with pytest.raises(RuntimeError, match="share that storage"):
        y.resize_(10)       # CPU grows the storage under y and v; tpu would split them: raises
    assert_same(v, torch.arange(2))
    with pytest.raises(RuntimeError) as want:
        torch.arange(6).resize_(-1)
    with pytest.raises(RuntimeError) as got:
        y.resize_(-1)
    assert str(got.value) == str(want.value)    # CPU's words (torch 2.13: a numel overflow)


@pytest.mark.slow_params("strict")   # defer only in the default run
def test_out_tensors_are_resized_as_on_cpu(tpu_mode):
    torch.manual_seed(0)
    a, b = torch.randn(3, 4), torch.randn(4, 5)
    ops = {
        "cat": lambda d, o: torch.cat([a.to(d), a.to(d)], out=o),
        "sum": lambda d, o: torch.sum(a.to(d), 1, out=o),
        "mm": lambda d, o: torch.mm(a.to(d), b.to(d), out=o),
        "arange": lambda d, o: torch.arange(5, out=o),
        "exp": lambda d, o: torch.exp(a.to(d), out=o),
    }
    for name, f in ops.items():
        for start in (0, 2):        # empty (resized silently) and of another shape (CPU warns)
            want = torch.empty(start, dtype=torch.long if name == "arange" else torch.float)
            got = want.to("tpu")
            with warnings.catch_warnings(record=True) as w_cpu:
                warnings.simplefilter("always")
                f("cpu", want)
            with warnings.catch_warnings(record=True) as w_tpu:
                warnings.simplefilter("always")
                f("tpu", got)
            assert_same(got, want)
            if name != "arange":    # its resize is PyTorch's own decomposition's, in its words
                assert [str(m.message) for m in w_tpu] == [
                    str(m.message).split(" (Triggered internally")[0] for m in w_cpu], name
            assert len(w_tpu) == (start > 0), name
    want = (torch.empty(0), torch.empty(0, dtype=torch.long))
    got = tuple(t.to("tpu") for t in want)      # .to() leaves the CPU tensors resizable
    torch.max(a, 1, out=want)
    torch.max(a.to("tpu"), 1, out=got)
    assert_same(got, want)
