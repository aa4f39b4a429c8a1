"""The router's share of a training step on the plain PrivateUse1 tpu tensor
(docs/cxx-plan.md, Session 5 (cxx10)): an optimizer's foreach ops reuse the wrappers of the
tensors they were given last step (NOTE [plain wrapper cache] in deferfuse/plain.py), a wrapper is
never reused once its tensor changed, and the backward ops with an ``output_mask`` are kernel hits
(their bool list keyed in C++). Every result equals CPU eager."""
import gc

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import deferfuse
from deferfuse import plain
from util import assert_same


def _mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(12, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(),
                         nn.Linear(16, 5))


def _step(model, opt, x, y):
    opt.zero_grad(set_to_none=True)
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    opt.step()
    return loss


def _counts():
    P = plain.PLAIN
    return P.ext.kernel_stats()["hits"], P.wrapper_hits, P.wrapper_misses


@pytest.fixture(params=[False, True], ids=["router", "kernel"])
def kernel(request):
    """The C++ kernel off (every op through the router and its wrapper cache) or on (the foreach
    ops are kernel hits after their first call, NOTE [C++ foreach] in _tpu_tensor.cpp)."""
    ext = plain.PLAIN.ext
    ext.set_kernel(request.param)
    try:
        yield request.param
    finally:
        ext.set_kernel(True)


@pytest.mark.modes("defer")
def test_training_steps_reuse_wrappers_take_masks_in_the_kernel_and_equal_cpu():
    """AdamW (foreach) on an MLP: after the first steps the kernel takes every op of a step (the
    linear_backward calls, the first layer's with a None output, the foreach ops: NOTE [C++
    foreach]), so the router wraps nothing, and the loss, parameters and optimizer states equal
    CPU's at every step. (Before the foreach ops were kernel hits, their parameters' and states'
    wrappers came from the cache: test_a_changed_tensor_is_never_given_its_old_wrapper[router]
    checks that cache.)"""
    torch.manual_seed(1)
    x, y = torch.randn(8, 12), torch.randint(0, 5, (8,))
    cpu_model, tpu_model = _mlp(), _mlp().to("tpu")
    cpu_opt = torch.optim.AdamW(cpu_model.parameters(), lr=1e-2)
    tpu_opt = torch.optim.AdamW(tpu_model.parameters(), lr=1e-2)
    xt, yt = x.to("tpu"), y.to("tpu")
    per_step = []
    for i in range(5):
        before = _counts()
        got = _step(tpu_model, tpu_opt, xt, yt)
        deferfuse.sync()
        per_step.append(tuple(b - a for a, b in zip(before, _counts())))
        want = _step(cpu_model, cpu_opt, x, y)
        assert_same(got, want)
    for pt, pc in zip(tpu_model.parameters(), cpu_model.parameters()):
        assert_same(pt, pc, atol=1e-5)
        st, sc = tpu_opt.state[pt], cpu_opt.state[pc]
        assert_same(st["exp_avg"], sc["exp_avg"], atol=1e-6)
        assert_same(st["exp_avg_sq"], sc["exp_avg_sq"], atol=1e-6)
    hits, w_hits, w_misses = per_step[-1]
    assert per_step[-2] == per_step[-1], per_step       # steady: the same counts every step
    # nothing routed, so no wrapper made or taken from the cache (before the foreach ops were
    # kernel hits: <= 18 made and >= 18 reused a step)
    assert (w_hits, w_misses) == (0, 0), per_step
    # 13 kernel hits a step before, 23 with the 8 foreach ops, the first linear_backward (a None
    # output) and nll_loss_forward
    assert hits >= 23, per_step


@pytest.mark.modes("defer", "strict")
def test_a_changed_tensor_is_never_given_its_old_wrapper(kernel):
    """NOTE [plain wrapper cache]: each change of the tensor between two routed ops (a write, an
    in-place resize, ``.data =``, ``set_``, an in-place view op, a new value through
    ``copy_``) gives the next routed op the tensor as it is now: values and shapes as on CPU.
    With the kernel on, the foreach ops are kernel hits keyed on the tensors as they are now."""
    torch.manual_seed(2)
    a, b = torch.randn(6), torch.randn(6)
    ta, tb = a.to("tpu"), b.to("tpu")

    def both(fn):
        fn(a, b)
        fn(ta, tb)
        assert_same(ta, a)
        assert_same(tb, b)

    both(lambda u, v: torch._foreach_mul_([u, v], 1.5))            # routed: wrappers kept
    both(lambda u, v: torch._foreach_add_([u], [v]))
    both(lambda u, v: u.add_(v))                                    # a kernel write between
    both(lambda u, v: torch._foreach_add_([u, v], 0.25))
    both(lambda u, v: u.resize_(2, 3))                              # geometry changed in place
    both(lambda u, v: torch._foreach_mul_([u], 3.0))
    both(lambda u, v: u.t_())                                       # an in-place view op
    both(lambda u, v: torch._foreach_add_([u], 1.25))
    both(lambda u, v: setattr(u, "data", v.view(3, 2) * 2.0))       # .data = another storage
    both(lambda u, v: torch._foreach_mul_([u, v], 0.5))
    both(lambda u, v: u.set_(v.clone()))                            # set_ another storage
    both(lambda u, v: torch._foreach_sub_([u, v], 1.0))
    both(lambda u, v: u.copy_(v * 3.0))
    both(lambda u, v: torch._foreach_addcmul_([u], [v], [u], 0.5))


@pytest.mark.modes("defer", "strict")
def test_one_tensor_twice_and_lists_reading_what_they_write_equal_cpu(kernel):
    """A tensor given twice (one cached wrapper for both), and a foreach op whose second list
    reads the first list's tensors at other places (run one element at a time; with the kernel
    on, routed so by NOTE [C++ foreach]'s check on every call), as on CPU."""
    torch.manual_seed(3)
    xs = [torch.randn(4) for _ in range(3)]
    ts = [x.to("tpu") for x in xs]
    for zs in (xs, ts):
        torch._foreach_add_(zs, zs)
        torch._foreach_mul_(zs, zs[::-1])
        torch._foreach_addcmul_(zs, zs, zs[::-1], 0.5)
    for t, x in zip(ts, xs):
        assert_same(t, x)


@pytest.mark.modes("defer")
def test_a_dead_tensor_leaves_the_wrapper_cache():
    """The cache keeps no Storage of a dead tensor: its entry goes with it."""
    P = plain.PLAIN
    t = torch.randn(5, 3).to("tpu")
    P.ext.set_kernel(False)     # routed (the kernel takes a foreach op it has learnt)
    try:
        torch._foreach_mul_([t], 2.5)
    finally:
        P.ext.set_kernel(True)
    k = id(t)
    assert k in P.wrappers
    st = P.wrappers[k][2]
    assert st is P.ext.storage(t)
    del t
    gc.collect()
    assert k not in P.wrappers or P.wrappers[k][0]() is not None


@pytest.mark.modes("defer", "strict")
def test_split_and_unbind_make_cxx_views_and_attention_on_them_equals_cpu():
    """NOTE [plain split]: ``split``/``split_with_sizes``/``unbind`` run PyTorch's composite over
    the C++ view kernels, so their pieces have C++ signatures (the ops on them can be kernel
    hits); a GPT block's q, k, v split, attention, and backward equal CPU's."""
    torch.manual_seed(4)
    x = torch.randn(2, 5, 24, requires_grad=True)
    w = (torch.randn(24, 24) * 0.2).requires_grad_()
    tx, tw = (x.detach().to("tpu").requires_grad_(), w.detach().to("tpu").requires_grad_())
    ext = plain.PLAIN.ext

    def block(x, w, check=False):
        q, k, v = (x @ w).split(8, dim=-1)
        if check:
            assert all(ext.sig(z) >= 0 for z in (q, k, v))
        q, k, v = (z.view(2, 5, 2, 4).transpose(1, 2) for z in (q, k, v))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        parts = a.transpose(1, 2).reshape(2, 5, 8).split_with_sizes([3, 5], dim=-1)
        rows = parts[1].unbind(1)
        if check:
            assert all(ext.sig(z) >= 0 for z in (*parts, *rows))
        return parts[0].sum() + sum(r.square().sum() for r in rows)

    for _ in range(3):
        want = block(x, w)
        got = block(tx, tw, check=True)
        assert_same(got, want, atol=1e-4, rtol=1e-5)
        want.backward()
        got.backward()
        assert_same(tx.grad, x.grad, atol=1e-4, rtol=1e-5)
        assert_same(tw.grad, w.grad, atol=1e-4, rtol=1e-5)
