"""A training step's optimizer and loss ops as C++ kernel hits on the plain tpu tensor
(docs/cxx-plan.md, Session 6 (cxx13)): the in-place foreach ops, checked
per call for a written storage read elsewhere (NOTE [C++ foreach] in deferfuse/_tpu_tensor.cpp),
foreach ops returning a tensor list, lists of Python numbers as runtime inputs,
``linear_backward`` with a None output and ``nll_loss_forward`` (several fresh out= tensors,
NOTE [fresh outs] in deferfuse/plain.py). Every result equals CPU eager (dtypes, shapes, values);
the counts say what the kernel took and what the router ran."""

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import deferfuse
from deferfuse import plain
from util import assert_same, bench_module

if not plain.KERNEL:
    pytest.skip("the C++ recording kernel is off (DEFERFUSE_CXX_KERNEL=0)", allow_module_level=True)

EXT = plain.PLAIN.ext
_KEYS = ("hits", "passed", "unkeyed", "passed_overlap")


def _counted(fn):
    """``fn()``, with what the kernel took (``kernel_stats``' counters) and what the router ran
    (``route_stats``: op -> calls) meanwhile."""
    k0, r0 = EXT.kernel_stats(), EXT.route_stats()
    out = fn()
    k1, r1 = EXT.kernel_stats(), EXT.route_stats()
    return (out, {k: k1[k] - k0[k] for k in _KEYS},
            {op: n - r0.get(op, 0) for op, n in r1.items() if n != r0.get(op, 0)})


def _mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(12, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(),
                         nn.Linear(16, 5))


def _opt(name, params):
    if name == "adamw":
        return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1, foreach=True)
    return torch.optim.SGD(params, lr=0.1, momentum=0.9, weight_decay=1e-3, foreach=True)


@pytest.mark.modes("defer")
@pytest.mark.parametrize("name", ["adamw", "sgd"])
def test_optimizer_steps_are_kernel_hits_and_equal_cpu(name):
    """AdamW and SGD with momentum (foreach=True) on an MLP whose input needs no gradient (its
    first ``linear_backward`` has a None output), with cross entropy (``nll_loss_forward``): from
    the third step on nothing is routed, the same ops are kernel hits every step, and the loss,
    parameters and optimizer states equal CPU's at every step (dtypes and shapes too)."""
    torch.manual_seed(1)
    x, y = torch.randn(8, 12), torch.randint(0, 5, (8,))
    cpu_model, tpu_model = _mlp(), _mlp().to("tpu")
    cpu_opt, tpu_opt = _opt(name, cpu_model.parameters()), _opt(name, tpu_model.parameters())
    xt, yt = x.to("tpu"), y.to("tpu")

    def step(model, opt, x, y):
        opt.zero_grad(set_to_none=True)
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        return loss

    counts = []
    for i in range(4):
        got, k, r = _counted(lambda: step(tpu_model, tpu_opt, xt, yt))
        deferfuse.sync()
        counts.append((k, r))
        assert_same(got, step(cpu_model, cpu_opt, x, y), atol=1e-6)
        for pt, pc in zip(tpu_model.parameters(), cpu_model.parameters()):
            assert_same(pt, pc, atol=1e-5)
            for key, sc in cpu_opt.state[pc].items():
                st = tpu_opt.state[pt][key]
                if isinstance(sc, torch.Tensor) and sc.device.type == "cpu" and st.device.type == "cpu":
                    assert_same(st.to("tpu"), sc)      # AdamW's step count stays on CPU
                else:
                    assert_same(st, sc, atol=1e-6)
    k, r = counts[-1]
    assert counts[-2] == counts[-1], counts         # steady
    assert r == {}, counts                          # nothing routed
    assert k["passed"] == k["unkeyed"] == k["passed_overlap"] == 0, counts
    # AdamW: 13 hits a step before the foreach ops (8), the first layer's linear_backward and
    # nll_loss_forward were kernel hits (10 routed ops a step); SGD with momentum: 5 foreach ops
    assert k["hits"] >= (23 if name == "adamw" else 19), counts


@pytest.mark.modes("defer", "strict")
def test_foreach_calls_reading_what_they_write_equal_cpu_every_time(tpu_mode):
    """NOTE [C++ foreach]: a call whose other arguments read a written storage at another index
    (or as the single tensor argument), or whose written tensors share a storage (slices of one
    flat buffer), has the same C++ key as a call without, so the check runs on every call: each
    such call is routed (and run one element at a time, as CPU writes), each other call of the
    same key is a kernel hit. Values equal CPU's after every call."""
    torch.manual_seed(5)
    xs, ys = [torch.randn(4) for _ in range(3)], [torch.randn(4) for _ in range(3)]
    zs = [torch.tensor(v) for v in (2.0, 3.0, 5.0)]
    flat = torch.randn(12)
    ts, us, ws, ft = ([a.to("tpu") for a in xs], [a.to("tpu") for a in ys],
                      [a.to("tpu") for a in zs], flat.to("tpu"))
    cases = [   # (overlaps, fn)
        (False, lambda a, b, z, f: torch._foreach_add_(a, b)),
        (True, lambda a, b, z, f: torch._foreach_add_(a, a[::-1])),
        (False, lambda a, b, z, f: torch._foreach_add_(a, a)),          # the same index: one op
        (True, lambda a, b, z, f: torch._foreach_addcmul_(a, b, a[::-1], 0.25)),
        (False, lambda a, b, z, f: torch._foreach_addcmul_(a, b, b[::-1], 0.25)),
        (True, lambda a, b, z, f: torch._foreach_mul_(z, z[1])),        # a single tensor
        (False, lambda a, b, z, f: torch._foreach_mul_(z, b[0][0])),
        (True, lambda a, b, z, f: torch._foreach_mul_(list(f.split(4)), 0.75)),   # one storage
        (False, lambda a, b, z, f: torch._foreach_mul_([t[1:3] for t in a], 0.75)),  # views
    ]
    for rnd in range(3):
        for i, (overlaps, fn) in enumerate(cases):
            fn(xs, ys, zs, flat)
            _, k, r = _counted(lambda: fn(ts, us, ws, ft))
            if rnd == 2 and tpu_mode == "defer":
                assert k["passed_overlap" if overlaps else "hits"] == 1, (i, k, r)
                assert (r == {}) != overlaps, (i, k, r)
            for got, want in ((ts, xs), (us, ys), (ws, zs), ([ft], [flat])):
                assert_same(got, want, atol=1e-5, rtol=1e-5, msg=f"case {i}, round {rnd}")


@pytest.mark.modes("defer")
def test_numbers_of_foreach_calls_are_runtime_inputs():
    """A Python number, and each number of a list of them (AdamW's per-parameter step sizes),
    is a runtime input: new values are kernel hits of the same key and compile nothing; a
    special value (2.0) is a constant of another key. Values equal CPU's."""
    torch.manual_seed(6)
    xs, ys, zs = ([torch.randn(3, 2) for _ in range(3)] for _ in range(3))
    zs = [z.abs() + 0.5 for z in zs]
    ts, us, vs = ([a.to("tpu") for a in l] for l in (xs, ys, zs))

    def run(a, b, c, s):
        torch._foreach_mul_(a, s)
        torch._foreach_addcdiv_(a, b, c, [s, -s / 3, s + 0.25])
        torch._foreach_div_(a, [1.5 + s, 2.5, 0.3 + s])
        return torch._foreach_sqrt(torch._foreach_abs(a))

    for i, s in enumerate((0.3, 0.7, 1.1, 0.9, 2.0, 0.4)):
        want = run(xs, ys, zs, s)
        c0 = deferfuse.metrics()["compiles"]
        got, k, r = _counted(lambda: run(ts, us, vs, s))
        deferfuse.sync()
        assert_same(got, want, atol=1e-6)
        assert_same(ts, xs, atol=1e-6)
        if i >= 2 and s != 2.0:      # keys learnt; 2.0 is a constant, another key
            assert r == {}, (s, k, r)
            assert k["hits"] == 5, (s, k, r)
            if i >= 3:
                assert deferfuse.metrics()["compiles"] == c0, s


@pytest.mark.modes("defer", "strict")
def test_list_outputs_none_outputs_and_several_fresh_outs_equal_cpu(tpu_mode):
    """``_foreach_sqrt``/``_foreach_add.List`` (a Tensor[] of new outputs), ``linear_backward``
    with an ``output_mask`` False (a None output) and ``nll_loss_forward`` (two fresh out=
    tensors, every reduction, a class weight, an ignored index): dtypes, shapes and values as
    on CPU, and kernel hits once learnt (defer)."""
    torch.manual_seed(7)
    xs = [torch.randn(5), torch.randn(2, 3)]
    ts = [x.to("tpu") for x in xs]
    lin = nn.Linear(6, 4)
    tlin = nn.Linear(6, 4).to("tpu")
    tlin.load_state_dict({k: v.to("tpu") for k, v in lin.state_dict().items()})
    inp = torch.randn(3, 6)
    logp = torch.randn(7, 5).log_softmax(-1)
    target = torch.tensor([0, 4, 2, 2, 1, 3, 0])
    weight = torch.rand(5) + 0.5
    tinp, tlogp, ttarget, tweight = (a.to("tpu") for a in (inp, logp, target, weight))
    nll = torch.ops.aten.nll_loss_forward.default

    def ops(xs, lin, inp, logp, target, weight):
        out = [torch._foreach_sqrt([x.abs() for x in xs]), torch._foreach_add(xs, xs, alpha=0.5)]
        lin.zero_grad(set_to_none=True)
        lin(inp).square().sum().backward()      # linear_backward, mask [False, True, True]
        out += [lin.weight.grad, lin.bias.grad]
        for red in (0, 1, 2):
            out.append(list(nll(logp, target, None, red, -100)))
            out.append(list(nll(logp, target, weight, red, 2)))
        out.append(F.cross_entropy(logp, target))
        return out

    for rnd in range(3):
        want = ops(xs, lin, inp, logp, target, weight)
        got, k, r = _counted(lambda: ops(ts, tlin, tinp, tlogp, ttarget, tweight))
        assert_same(got, want, atol=1e-5, rtol=1e-5)
        if rnd == 2 and tpu_mode == "defer":
            assert k["passed"] == k["unkeyed"] == 0 and r == {}, (k, r)


def _workload_counts(name, steps=4):
    """Per steady step of the paired bench's quick ``name`` workload (defer): the kernel's and
    the router's counts, and the final loss beside CPU eager's after the same steps."""
    W = bench_module("workloads")
    b = getattr(W, name)(W.Ctx("defer"), True)
    e = getattr(W, name)(W.Ctx("eager"), True)
    for _ in range(steps):
        b.step()
        e.step()
    counts = [_counted(b.step)[1:] for _ in range(2)]
    e.step()
    e.step()
    return counts, b.check(), e.check()


@pytest.mark.modes("defer")
def test_mlp_train_routes_only_its_item():
    """bench/workloads.py's quick mlp_train (AdamW): per steady step 23 kernel hits (13 before
    this session's kernels) and one routed op (11 before: 8 foreach ops, ``linear_backward`` with
    a None output, ``nll_loss_forward``, the ``.item()``); its loss equals CPU eager's."""
    counts, got, want = _workload_counts("mlp_train")
    assert counts[0] == counts[1], counts
    k, r = counts[1]
    assert r == {"aten::_local_scalar_dense": 1}, counts
    assert k["hits"] >= 23 and k["passed"] == 0 and k["unkeyed"] == 1, counts
    assert abs(got - want) <= 1e-5 * max(1.0, abs(want)), (got, want)


@pytest.mark.slow
@pytest.mark.modes("defer")
def test_gpt_train_routes_only_its_item():
    """bench/workloads.py's quick gpt_train (AdamW): per steady step 62 kernel hits (53 before)
    and one routed op, the ``.item()`` (10 before: 8 foreach ops, ``nll_loss_forward``, the
    ``.item()``); its loss equals CPU eager's."""
    counts, got, want = _workload_counts("gpt_train")
    assert counts[0] == counts[1], counts
    k, r = counts[1]
    assert r == {"aten::_local_scalar_dense": 1}, counts
    assert k["hits"] >= 62 and k["passed"] == 0 and k["unkeyed"] == 1, counts
    assert abs(got - want) <= 1e-4 * max(1.0, abs(want)), (got, want)
