"""After an error the user catches, training goes on as on CPU: a value that depends on the failed
op raises its error wherever it flows (gradients, optimizer state, parameters), never NaN.
Every check compares with CPU eager PyTorch doing the same steps and catching the same error."""
import math

import pytest
import torch
import torch.nn as nn

import deferfuse
from util import assert_same

OPTIMIZERS = {
    "sgd": lambda ps: torch.optim.SGD(ps, lr=0.1),
    "sgd_momentum": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
    "adam": lambda ps: torch.optim.Adam(ps, lr=0.01),                   # foreach, the default
    "adamw_loop": lambda ps: torch.optim.AdamW(ps, lr=0.01, foreach=False),
}
GOOD = [[1, 2, 3], [4, 5, 6]]
BAD = [[1, 2, 30], [4, 5, 6]]       # 30: out of the embedding's range


def _train(dev, opt_name, batches, restore_at=None):
    """Train a small embedding model on ``batches``, catching IndexError as a user would (and
    zeroing the gradients); with ``restore_at``, reload the model and optimizer state saved before
    that step when it raises. Returns each step's loss (or the error) and the parameters (or the
    error reading each raises)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(10, 4), nn.Flatten(), nn.Linear(12, 1)).to(dev)
    opt = OPTIMIZERS[opt_name](model.parameters())
    losses = []
    for step, b in enumerate(batches):
        if step == restore_at:
            saved = ({k: v.detach().cpu().clone() for k, v in model.state_dict().items()},
                     _cpu_state(opt.state_dict()))
        try:
            loss = model(torch.tensor(b, device=dev)).square().mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        except IndexError as e:
            assert "index out of range" in str(e)
            losses.append(IndexError)
            opt.zero_grad()
            if step == restore_at:
                model.load_state_dict(saved[0])
                opt.load_state_dict(saved[1])
    params = []
    for p in model.parameters():
        try:
            p.detach().cpu()
            params.append(p.detach())
        except IndexError:
            params.append(IndexError)
    return losses, params


def _cpu_state(sd):
    return {"state": {k: {n: t.detach().cpu().clone() if torch.is_tensor(t) else t
                          for n, t in s.items()} for k, s in sd["state"].items()},
            "param_groups": sd["param_groups"]}


def _same_or_raised(got, want, mode):
    """Strict mode (errors found before the next op runs) gives CPU's value; defer may find the
    error only after the optimizer step ran, and then a value computed from it raises it. Never
    NaN, never another value."""
    if got is IndexError and mode == "defer":
        return
    if want is IndexError:
        assert got is IndexError
    elif isinstance(want, float):
        assert not math.isnan(got)
        assert got == pytest.approx(want, rel=1e-5, abs=1e-7)
    else:
        assert not got.cpu().isnan().any()
        assert_same(got, want)


def _bad_batch_then_good(tpu_mode, opt_name):
    batches = [GOOD, BAD, GOOD, GOOD]
    want_losses, want_params = _train("cpu", opt_name, batches)
    losses, params = _train("tpu", opt_name, batches)
    assert want_losses[1] is IndexError and losses[1] is IndexError
    assert losses[0] == pytest.approx(want_losses[0], rel=1e-5)
    for got, want in zip(losses[2:], want_losses[2:]):
        _same_or_raised(got, want, tpu_mode)
    for got, want in zip(params, want_params):
        _same_or_raised(got, want, tpu_mode)
    if tpu_mode == "strict":      # the error came before the backward pass: nothing else changed
        assert params[0] is not IndexError and params[2] is not IndexError


@pytest.mark.parametrize("opt_name", list(OPTIMIZERS))
@pytest.mark.slow_params("strict")   # long: defer only in the default run
def test_training_after_a_caught_index_error_is_cpus_or_raises(tpu_mode, opt_name):
    """The issue's reproduction: an embedding indexed out of range, the IndexError caught, then
    training on good data (forward, backward, step, zero_grad, item). Defer mode dispatched the
    backward pass (the backward cut) and the step before the error was read, and every later loss
    and parameter came back NaN."""
    _bad_batch_then_good(tpu_mode, opt_name)


@pytest.mark.modes("defer")
@pytest.mark.parametrize("opt_name", ["sgd", "adam"])
def test_training_after_a_caught_index_error_without_the_backward_cut(tpu_mode, opt_name):
    with deferfuse.override(backward_cut=False):
        _bad_batch_then_good(tpu_mode, opt_name)


@pytest.mark.parametrize("opt_name", ["sgd_momentum", "adam"])
def test_reloading_the_last_good_state_after_an_index_error_trains_as_cpu(opt_name):
    """The way back in either mode: reload the state saved before the failing step; then every
    loss and parameter is CPU's."""
    batches = [GOOD, GOOD, BAD, GOOD, GOOD]
    want_losses, want_params = _train("cpu", opt_name, batches, restore_at=2)
    losses, params = _train("tpu", opt_name, batches, restore_at=2)
    assert losses[2] is IndexError and want_losses[2] is IndexError
    for got, want in zip(losses[:2] + losses[3:], want_losses[:2] + want_losses[3:]):
        assert got == pytest.approx(want, rel=1e-5, abs=1e-7)
    for got, want in zip(params, want_params):
        assert_same(got, want)


@pytest.mark.modes("defer")
def test_a_failed_value_raises_in_optimizer_state_and_parameters():
    """Defer mode runs the backward pass and the step before the index check is read: Adam's
    moments and the parameters computed from the bad lookup raise its error, through the next
    step too (whose program read them before the check was read), never NaN."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(10, 4), nn.Flatten(), nn.Linear(12, 1)).to("tpu")
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    for b in (BAD, GOOD):
        loss = model(torch.tensor(b, device="tpu")).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        with pytest.raises(IndexError, match="embedding"):
            loss.item()
    weights = [p for p in model.parameters()]
    for p in weights:
        for t in (p, opt.state[p]["exp_avg"], opt.state[p]["exp_avg_sq"]):
            with pytest.raises(IndexError, match="embedding"):
                t.cpu()
    ok = torch.ones(3, device="tpu") * 2           # what does not depend on it is computed
    assert_same(ok, torch.full((3,), 2.0))


ASSERT_VALUES = [torch.tensor(1), torch.tensor(float("nan")), torch.tensor(True), torch.tensor(1j),
                 torch.tensor([[1e-40]]), torch.tensor(0), torch.tensor(0.0), torch.tensor(False),
                 torch.tensor(0j), torch.tensor(-0.0, dtype=torch.bfloat16)]


def _cpu_error(fn):
    try:
        fn()
    except RuntimeError as e:
        return str(e)
    return None


def test_assert_async_checks_on_the_device(tpu_mode, no_cpu_fallbacks):
    """``torch._assert_async`` (TorchTitan's RoPE check) runs on the device, as on CUDA: a value
    that is zero raises CPU's error at the next sync in defer mode (at the call in strict mode),
    values computed beside it are CPU's, and nothing falls back to CPU. A tensor that is not one
    element raises CPU's error at the call."""
    for v in ASSERT_VALUES:
        for msg in ((), ("positions out of range",)):
            # v itself, not v * 3: XLA flushes a subnormal product to zero (TPUs too)
            want = _cpu_error(lambda: torch._assert_async(v, *msg))
            x = v.to("tpu")
            y = None
            try:
                torch._assert_async(x, *msg)
                y = x * 2
                y.cpu()
            except RuntimeError as e:
                assert want is not None, (v, e)
                assert str(e).startswith(want), (str(e), want)
            else:
                assert want is None, (v, want)
            if y is not None:
                assert_same(y, v * 2)         # the error is raised once; y holds CPU's values
    for v in (torch.tensor([1, 1]), torch.zeros(0), torch.ones(2, 3)):
        want = _cpu_error(lambda: torch._assert_async(v))
        with pytest.raises(RuntimeError) as e:
            torch._assert_async(v.to("tpu"))     # raised at the call, before anything runs
        assert str(e.value) == want


def test_assert_async_in_a_compiled_graph():
    def f(x, n):
        torch._assert_async((x.abs() < n).all(), "out of range")
        return x * 2
    g = torch.compile(f, backend="tpu")
    x = torch.arange(4.0)
    assert_same(g(x.to("tpu"), 10), f(x, 10))
    want = _cpu_error(lambda: f(x, 2))
    with pytest.raises(RuntimeError) as e:
        g(x.to("tpu"), 2).cpu()
    assert str(e.value).startswith(want)
