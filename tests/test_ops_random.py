"""Random ops: shape and dtype as CPU, the right distribution (moments of a large sample),
reproducible under torch.manual_seed, different across consecutive calls, no CPU fallback."""
import math
from typing import Optional

import pytest
import torch

import deferfuse

T = "tpu"
N = 20000


pytestmark = pytest.mark.usefixtures("no_cpu_fallbacks")


def like_cpu(fn):
    """fn(device) on tpu: same shape/dtype as on CPU, reproducible under manual_seed, and a second
    call draws different numbers. Returns the first tpu draw (on CPU)."""
    want = fn("cpu")
    torch.manual_seed(123)
    t = fn(T)
    assert t.device.type == "tpu"
    assert t.dtype == want.dtype and t.shape == want.shape, (t.dtype, want.dtype, t.shape, want.shape)
    a = t.cpu()
    b = fn(T).cpu()
    torch.manual_seed(123)
    a2 = fn(T).cpu()
    assert torch.equal(a, a2), "not reproducible under torch.manual_seed"
    if a.numel() > 8:
        assert not torch.equal(a, b), "two consecutive draws are equal"
    return a


def moments(x, mean, std, tol=0.05):
    x = x.double()
    assert abs(x.mean().item() - mean) < tol * max(std, 1e-3) * 3 + 1e-3, (x.mean().item(), mean)
    assert abs(x.std().item() - std) < tol * std + 1e-3, (x.std().item(), std)


@pytest.mark.slow_params("strict")   # long: defer only in the default run
def test_uniform_normal_factories():
    moments(like_cpu(lambda d: torch.rand(N, device=d)), 0.5, 1 / math.sqrt(12))
    moments(like_cpu(lambda d: torch.randn(N, device=d)), 0.0, 1.0)
    x = like_cpu(lambda d: torch.randn(N, device=d, dtype=torch.bfloat16))
    moments(x.float(), 0.0, 1.0)
    moments(like_cpu(lambda d: torch.empty(N, device=d).uniform_(-2, 4)), 1.0, 6 / math.sqrt(12))
    moments(like_cpu(lambda d: torch.normal(2.0, 3.0, (N,), device=d)), 2.0, 3.0)
    y = like_cpu(lambda d: torch.empty(4, N, device=d, dtype=torch.float64)[1].normal_(3, 0.5))
    moments(y, 3.0, 0.5)                                                   # a view, written back


@pytest.mark.slow_params("strict")   # long: defer only in the default run
def test_like_and_normal_tensor_overloads():
    base = torch.zeros(N)
    moments(like_cpu(lambda d: torch.rand_like(base.to(d))), 0.5, 1 / math.sqrt(12))
    moments(like_cpu(lambda d: torch.randn_like(base.to(d), dtype=torch.float64)), 0.0, 1.0)
    mean = torch.full((N,), 5.0)
    std = torch.full((N,), 2.0)
    moments(like_cpu(lambda d: torch.normal(mean.to(d), 0.5)), 5.0, 0.5)
    moments(like_cpu(lambda d: torch.normal(-1.0, std.to(d))), -1.0, 2.0)
    moments(like_cpu(lambda d: torch.normal(mean.to(d), std.to(d))), 5.0, 2.0)


@pytest.mark.slow_params("strict")   # long: defer only in the default run
def test_integers():
    x = like_cpu(lambda d: torch.randint(0, 10, (N,), device=d))
    assert x.min() == 0 and x.max() == 9
    moments(x.double(), 4.5, math.sqrt(99 / 12))
    x = like_cpu(lambda d: torch.randint(-5, 5, (N,), device=d, dtype=torch.int32))
    assert x.min() == -5 and x.max() == 4
    base = torch.zeros(N, dtype=torch.int16)
    x = like_cpu(lambda d: torch.randint_like(base.to(d), 7))
    assert x.min() == 0 and x.max() == 6
    x = like_cpu(lambda d: torch.empty(N, device=d).random_(-3, 3))
    assert x.min() == -3 and x.max() == 2
    x = like_cpu(lambda d: torch.empty(N, dtype=torch.uint8, device=d).random_())
    assert x.min() == 0 and x.max() == 255
    x = like_cpu(lambda d: torch.empty(N, dtype=torch.float32, device=d).random_())
    assert x.min() >= 0 and x.max() <= 2 ** 24 and x.max() > 2 ** 23 and torch.equal(x, x.round())
    x = like_cpu(lambda d: torch.empty(N, dtype=torch.int64, device=d).random_())
    assert x.min() >= 0 and x.max() > 2 ** 60
    x = like_cpu(lambda d: torch.empty(N, dtype=torch.int64, device=d).random_(-2 ** 40, None))
    assert x.min() >= -2 ** 40 and x.max() > 2 ** 60


@pytest.mark.slow_params("strict")   # long: defer only in the default run
def test_bernoulli():
    x = like_cpu(lambda d: torch.empty(N, device=d).bernoulli_(0.3))
    assert set(x.unique().tolist()) <= {0.0, 1.0}
    moments(x, 0.3, math.sqrt(0.21))
    p = torch.linspace(0, 1, N)
    x = like_cpu(lambda d: torch.bernoulli(p.to(d)))
    assert x[:100].sum() < 10 and x[-100:].sum() > 90
    moments(x, 0.5, 0.5, tol=0.1)
    x = like_cpu(lambda d: torch.empty(N, dtype=torch.bool, device=d).bernoulli_(p.to(d)))
    moments(x.double(), 0.5, 0.5, tol=0.1)
    x = like_cpu(lambda d: torch.bernoulli(torch.zeros(N, device=d), 0.8))
    moments(x, 0.8, 0.4)


@pytest.mark.slow_params("strict")   # long: defer only in the default run
def test_rrelu():
    """RReLU: evaluation uses the mean slope (as CPU, exactly); training scales each non-positive
    element by its own uniform slope in [lower, upper], which is also its gradient; in place on a
    view writes through to the base."""
    import torch.nn.functional as F
    x = torch.randn(N // 100, 100)
    neg = x <= 0
    assert torch.equal(F.rrelu(x.to(T), 0.1, 0.3, training=False).cpu(),
                       F.rrelu(x, 0.1, 0.3, training=False))
    y = like_cpu(lambda d: F.rrelu(x.to(d), 0.1, 0.3, training=True))
    assert torch.equal(y[~neg], x[~neg])
    slope = y[neg] / x[neg]
    assert slope.min() >= 0.1 - 1e-6 and slope.max() <= 0.3 + 1e-6
    moments(slope, 0.2, 0.2 / math.sqrt(12), tol=0.1)
    torch.manual_seed(7)
    xt = x.to(T).requires_grad_()
    yt = F.rrelu(xt, 0.1, 0.3, training=True)
    yt.sum().backward()
    g, yc = xt.grad.cpu(), yt.detach().cpu()
    assert torch.allclose(g[neg], yc[neg] / x[neg]) and torch.equal(g[~neg], torch.ones_like(x)[~neg])
    base, want = x.to(T), x.clone()
    F.rrelu(base[1:5], training=False, inplace=True)
    F.rrelu(want[1:5], training=False, inplace=True)
    assert torch.equal(base.cpu(), want)
    m = torch.nn.RReLU(inplace=True).to(T)
    t = x.to(T)
    assert m(t) is t and torch.equal(t.cpu()[~neg], x[~neg])


@pytest.mark.slow_params("strict")   # long: defer only in the default run
def test_other_distributions():
    moments(like_cpu(lambda d: torch.empty(N, device=d).exponential_(2.0)), 0.5, 0.5)
    p = 0.3
    x = like_cpu(lambda d: torch.empty(N, device=d).geometric_(p))
    assert x.min() >= 1 and torch.equal(x, x.round())
    moments(x, 1 / p, math.sqrt(1 - p) / p)
    x = like_cpu(lambda d: torch.empty(N, device=d).log_normal_(0.0, 0.25))
    moments(x.log(), 0.0, 0.25)
    x = like_cpu(lambda d: torch.empty(N, device=d).cauchy_(1.0, 2.0))
    assert abs(x.median().item() - 1.0) < 0.1
    q = (x - 1.0).abs().median().item()     # the half-width at the median is sigma
    assert abs(q - 2.0) < 0.15


@pytest.mark.slow_params("strict")   # long: defer only in the default run
def test_randperm_multinomial():
    x = like_cpu(lambda d: torch.randperm(1000, device=d))
    assert torch.equal(x.sort().values, torch.arange(1000))
    w = torch.tensor([[1.0, 0.0, 3.0, 6.0], [0.0, 0.0, 5.0, 5.0]])
    x = like_cpu(lambda d: torch.multinomial(w.to(d), 5000, replacement=True))
    freq = torch.stack([torch.bincount(r, minlength=4) for r in x]).double() / 5000
    torch.testing.assert_close(freq, w.double() / w.sum(1, keepdim=True), atol=0.03, rtol=0)
    x = like_cpu(lambda d: torch.multinomial(w[0].to(d), 3))
    assert sorted(x.tolist()) == [0, 2, 3]
    # without replacement, the first draw follows the weights
    first = like_cpu(lambda d: torch.multinomial(w[:1].expand(N, 4).contiguous().to(d), 2))[:, 0]
    freq = torch.bincount(first, minlength=4).double() / N
    torch.testing.assert_close(freq, w[0].double() / w[0].sum(), atol=0.02, rtol=0)


@pytest.mark.modes("strict")
def test_same_seed_same_numbers_in_every_mode_and_no_recompile():
    def draws(mode):
        with deferfuse.mode(mode):
            torch.manual_seed(7)
            x = torch.ones(64, 32).to("tpu")
            out = []
            for _ in range(4):
                y = torch.nn.functional.dropout(x, 0.3, training=True) + torch.randn(64, 32, device="tpu")
                out.append(y.cpu())
            return out
    strict, defer = draws("strict"), draws("defer")
    for a, b in zip(strict, defer):
        assert torch.equal(a, b)
    assert not torch.equal(strict[0], strict[1])       # a new step draws new numbers
    with deferfuse.mode("defer"):
        torch.manual_seed(7)
        x = torch.ones(64, 32).to("tpu")
        compiles = []
        for _ in range(5):
            torch.nn.functional.dropout(x, 0.3, training=True).sum().item()
            compiles.append(deferfuse.metrics()["region_compiles"])
    assert compiles[1] == compiles[-1], compiles


@pytest.mark.parametrize("probs,msg", [([-1.0, 2.0], "element < 0"), ([float("nan"), 1.0], "nan"),
                                       ([float("inf"), 1.0], "inf"), ([0.0, 0.0], "sum of probabilities")])
def test_multinomial_invalid_probabilities_raise(probs, msg):
    # CPU checks the distribution (CUDA with a device assert); this sampled from it anyway.
    with pytest.raises(RuntimeError, match=msg):
        torch.tensor(probs).multinomial(1)
    with pytest.raises(RuntimeError, match=msg):
        torch.tensor(probs, device="tpu").multinomial(1).cpu()


@pytest.mark.parametrize("draw", [
    lambda g: torch.randn(64, device="tpu", generator=g),
    lambda g: torch.rand(8, 8, device="tpu", generator=g),
    lambda g: torch.randint(0, 100, (32,), device="tpu", generator=g),
    lambda g: torch.empty(50, device="tpu").uniform_(-2, 3, generator=g),
    lambda g: torch.empty(50, device="tpu").normal_(1, 2, generator=g),
    lambda g: torch.bernoulli(torch.full((40,), 0.3).to("tpu"), generator=g),
])
@pytest.mark.slow_params("strict")   # long: defer only in the default run
def test_a_cpu_generator_seeds_the_op(draw):
    # NOTE [generators] (deferfuse/generator.py): a generator was ignored (the device's key drew,
    # and a seeded generator did not reproduce), and each new generator object compiled again.
    def gen(seed):
        return torch.Generator().manual_seed(seed)
    torch.manual_seed(0)
    a, b = draw(gen(7)).cpu(), draw(gen(7)).cpu()
    assert torch.equal(a, b)                        # the same seed, the same numbers
    g = gen(7)
    c, d = draw(g).cpu(), draw(g).cpu()
    assert torch.equal(a, c) and not torch.equal(c, d)     # the generator advances
    torch.manual_seed(0)
    want = torch.randn(16, device="tpu").cpu()
    torch.manual_seed(0)
    draw(gen(1))                                    # leaves the device's own stream alone
    assert torch.equal(torch.randn(16, device="tpu").cpu(), want)
    deferfuse.reset_metrics()
    for seed in range(3):
        draw(gen(seed)).cpu()
    assert deferfuse.metrics()["compiles"] == 0     # a new generator is not a new program


@pytest.mark.slow_params("strict")   # long: defer only in the default run
def test_a_generator_and_the_distribution_it_draws():
    x = torch.empty(20000, device="tpu").normal_(3.0, 2.0, generator=torch.Generator().manual_seed(3))
    x = x.cpu()
    assert abs(float(x.mean()) - 3.0) < 0.06 and abs(float(x.std()) - 2.0) < 0.06


# --------------------------------------------------------------------------------------------
# The generator contract: CUDA's 16-byte (seed, offset) state, torch.Generator("tpu")
# (NOTE [rng offsets] in runtime/prng.py). Random values are not CPU's (nor are CUDA's): the
# comparisons with CPU are of shapes, dtypes, ranges and distributions.

def _state(seed, offset):
    return torch.tensor(list(seed.to_bytes(8, "little") + offset.to_bytes(8, "little")),
                        dtype=torch.uint8)


def test_rng_state_is_seed_and_offset_and_reading_it_never_syncs():
    torch.manual_seed(2 ** 40 + 5)
    s = torch.tpu.get_rng_state()
    assert s.dtype == torch.uint8 and s.shape == (16,) and s.device.type == "cpu"
    assert torch.equal(s, _state(2 ** 40 + 5, 0))
    assert torch.tpu.initial_seed() == 2 ** 40 + 5
    deferfuse.reset_metrics()
    a = torch.randn(10, device=T)                   # 10 values: the offset moves by 12
    assert torch.equal(torch.tpu.get_rng_state(), _state(2 ** 40 + 5, 12))
    torch.tpu.set_rng_state(s)
    b = torch.randn(10, device=T)
    assert sum(deferfuse.metrics()["syncs"].values()) == 0    # the state is the host's
    assert torch.equal(a.cpu(), b.cpu())            # the saved state replays the same numbers


@pytest.mark.slow_params("strict")   # long: defer only in the default run
def test_offset_moves_along_one_stream():
    """What DTensor's tracker relies on: the draw at offset o + k is the draw at o, k values on;
    another offset, another stream."""
    torch.tpu.set_rng_state(_state(99, 8))
    whole = torch.rand(64, device=T).cpu()
    torch.tpu.set_rng_state(_state(99, 8 + 24))
    assert torch.equal(torch.rand(40, device=T).cpu(), whole[24:])
    torch.tpu.set_rng_state(_state(99, 1000))
    assert not torch.equal(torch.rand(64, device=T).cpu()[:8], whole[:8])
    torch.tpu.set_rng_state(_state(98, 8))
    assert not torch.equal(torch.rand(64, device=T).cpu()[:8], whole[:8])


def test_unaligned_offset_raises_as_cuda():
    with pytest.raises(RuntimeError, match="offset must be a multiple of 4"):
        torch.tpu.set_rng_state(_state(99, 10))


def test_bad_rng_state_raises_as_cpu():
    for gen in (torch.Generator(), torch.Generator("tpu")):
        with pytest.raises(TypeError, match="RNG state must be a torch.ByteTensor"):
            gen.set_state(torch.zeros(16))
        with pytest.raises(RuntimeError):
            gen.set_state(torch.zeros(3, dtype=torch.uint8))
    with pytest.raises(RuntimeError, match="RNG state is wrong size"):
        torch.tpu.set_rng_state(torch.zeros(3, dtype=torch.uint8))


def test_seed_functions_of_torch_tpu():
    torch.tpu.manual_seed(3)
    assert torch.tpu.initial_seed() == 3
    a = torch.rand(5, device=T).cpu()
    torch.tpu.manual_seed_all(3)
    assert torch.equal(torch.rand(5, device=T).cpu(), a)
    s = torch.tpu.seed()
    assert torch.tpu.initial_seed() == s
    states = torch.tpu.get_rng_state_all()
    assert len(states) == torch.tpu.device_count() and torch.equal(states[0], _state(s, 0))
    b = torch.rand(5, device=T).cpu()
    torch.tpu.set_rng_state_all(states)
    assert torch.equal(torch.rand(5, device=T).cpu(), b)
    g = torch.tpu.default_generators[0]
    assert g.device == torch.device("tpu", 0) and torch.equal(g.get_state(), torch.tpu.get_rng_state())
    torch.tpu.set_rng_state_all(states)
    with torch.random.fork_rng(devices=[0], device_type="tpu"):
        torch.rand(5, device=T)
    assert torch.equal(torch.rand(5, device=T).cpu(), b)


def test_generator_object():
    g = torch.Generator("tpu")
    assert isinstance(g, torch.Generator) and isinstance(torch.Generator(), torch.Generator)
    assert g.device == torch.device("tpu", 0)
    assert torch.Generator(device="tpu").device == torch.Generator(torch.device("tpu", 0)).device
    assert torch.Generator().device.type == "cpu"   # every other device: PyTorch's own
    assert g.manual_seed(11) is g and g.initial_seed() == 11 and g.get_offset() == 0
    assert torch.equal(g.get_state(), _state(11, 0))
    torch.rand(7, device=T, generator=g)
    assert g.get_offset() == 8
    h = torch.Generator("tpu").set_state(g.get_state())
    assert torch.equal(torch.rand(9, device=T, generator=g).cpu(),
                       torch.rand(9, device=T, generator=h).cpu())
    s = g.seed()
    assert g.initial_seed() == s and g.get_offset() == 0
    import copy
    import pickle
    for c in (g.clone_state(), copy.deepcopy(g), pickle.loads(pickle.dumps(g))):
        assert torch.equal(c.get_state(), g.get_state()) and c.device == g.device


GEN_DRAWS = {
    "randn": lambda d, g: torch.randn(300, device=d, generator=g),
    "rand": lambda d, g: torch.rand(20, 15, device=d, generator=g, dtype=torch.float64),
    "randint": lambda d, g: torch.randint(-3, 7, (300,), device=d, generator=g),
    "randperm": lambda d, g: torch.randperm(50, device=d, generator=g),
    "normal_": lambda d, g: torch.empty(300, device=d).normal_(1.0, 2.0, generator=g),
    "uniform_": lambda d, g: torch.empty(300, device=d).uniform_(-2, 3, generator=g),
    "normal": lambda d, g: torch.normal(torch.zeros(300, device=d), 1.0, generator=g),
    "bernoulli": lambda d, g: torch.bernoulli(torch.full((300,), 0.3, device=d), generator=g),
    "bernoulli_": lambda d, g: torch.empty(300, device=d).bernoulli_(0.7, generator=g),
    "multinomial": lambda d, g: torch.multinomial(torch.ones(4, 10, device=d), 5, generator=g),
    "exponential_": lambda d, g: torch.empty(300, device=d).exponential_(2.0, generator=g),
    "random_": lambda d, g: torch.empty(300, device=d).random_(0, 9, generator=g),
    "init.normal_": lambda d, g: torch.nn.init.normal_(torch.empty(30, 10, device=d), generator=g),
    "init.uniform_": lambda d, g: torch.nn.init.uniform_(torch.empty(30, 10, device=d), generator=g),
    "init.trunc_normal_": lambda d, g: torch.nn.init.trunc_normal_(torch.empty(30, 10, device=d),
                                                                   generator=g),
    "init.kaiming_uniform_": lambda d, g: torch.nn.init.kaiming_uniform_(
        torch.empty(30, 10, device=d), generator=g),
    "init.xavier_normal_": lambda d, g: torch.nn.init.xavier_normal_(
        torch.empty(30, 10, device=d), generator=g),
}


@pytest.mark.parametrize("name", sorted(GEN_DRAWS))
@pytest.mark.slow_params("strict")   # long: defer only in the default run
def test_generator_is_honoured_by_random_ops(name):
    """Two tpu generators with one seed give the same numbers; the generator advances; the
    device's default generator is left alone; shape and dtype are CPU's."""
    draw = GEN_DRAWS[name]
    want = draw("cpu", torch.Generator().manual_seed(5))
    torch.manual_seed(0)
    before = torch.tpu.get_rng_state()
    g1, g2 = torch.Generator("tpu").manual_seed(5), torch.Generator("tpu").manual_seed(5)
    a, b = draw(T, g1), draw(T, g2)
    assert a.device.type == "tpu" and a.dtype == want.dtype and a.shape == want.shape
    assert torch.equal(a.cpu(), b.cpu())
    assert g1.get_offset() > 0 and not torch.equal(draw(T, g1).cpu(), a.cpu())
    assert torch.equal(torch.tpu.get_rng_state(), before)
    if name == "randperm":
        assert torch.equal(a.cpu().sort().values, torch.arange(50))
    if name == "randint":
        assert a.min() >= -3 and a.max() <= 6


def _scripted_randn(x: torch.Tensor, g: Optional[torch._C.Generator] = None) -> torch.Tensor:
    return x + torch.randn(x.shape, generator=g, device=x.device, dtype=x.dtype)


def _scripted_own_generator(x: torch.Tensor, seed: int) -> torch.Tensor:
    g = torch.Generator()
    g.manual_seed(seed)
    return torch.rand(x.shape, generator=g) * x


@pytest.mark.filterwarnings("ignore:`torch.jit.script` is deprecated")
def test_torchscript_takes_generators_as_before():
    """deferfuse makes ``torch.Generator`` a factory (a tpu generator for ``device="tpu"``):
    TorchScript still takes ``torch._C.Generator`` annotations (code that read torch.Generator
    before the factory replaced it) and ``torch.Generator()`` in scripted code, giving CPU's
    numbers; a tpu generator passed to a scripted function draws what it draws eagerly."""
    fn = torch.jit.script(_scripted_randn)
    x = torch.arange(6.).reshape(2, 3)
    assert torch.equal(fn(x, torch.Generator().manual_seed(4)),
                       _scripted_randn(x, torch.Generator().manual_seed(4)))
    own = torch.jit.script(_scripted_own_generator)
    assert torch.equal(own(x, 9), _scripted_own_generator(x, 9))
    xt = x.to(T)
    got = fn(xt, torch.Generator(T).manual_seed(4))
    want = _scripted_randn(xt, torch.Generator(T).manual_seed(4))
    assert got.device.type == "tpu" and got.dtype == x.dtype and got.shape == x.shape
    assert torch.equal(got.cpu(), want.cpu())


def test_a_tpu_generator_draws_the_right_distribution():
    g = torch.Generator("tpu").manual_seed(3)
    x = torch.empty(20000, device=T).normal_(3.0, 2.0, generator=g).cpu()
    moments(x, 3.0, 2.0)
    x = torch.rand(20000, device=T, generator=g).cpu()
    assert x.min() >= 0 and x.max() < 1
    moments(x, 0.5, 1 / math.sqrt(12))
    for seed in range(6):
        if seed == 3:
            deferfuse.reset_metrics()
        torch.rand(100, device=T, generator=torch.Generator("tpu").manual_seed(seed)).cpu()
    assert deferfuse.metrics()["compiles"] == 0     # a new generator is not a new program


@pytest.mark.parametrize("reentrant", [False, True])
@pytest.mark.slow_params("strict")   # long: defer only in the default run
def test_activation_checkpoint_replays_dropout(reentrant):
    """torch.utils.checkpoint saves the device's RNG state and restores it to recompute: the
    gradients through a checkpointed dropout equal those without checkpointing, as on CPU."""
    from torch.utils.checkpoint import checkpoint
    torch.manual_seed(1)
    m = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Dropout(0.5), torch.nn.Linear(16, 1))
    x = torch.randn(6, 8, requires_grad=reentrant)
    for d in ("cpu", T):
        md, xd = m.to(d), x.detach().to(d).requires_grad_(reentrant)
        grads = []
        for ck in (False, True):
            md.zero_grad()
            torch.manual_seed(0)
            y = checkpoint(md, xd, use_reentrant=reentrant) if ck else md(xd)
            y.sum().backward()
            grads.append(md[0].weight.grad.cpu().clone())
        assert grads[0].abs().sum() > 0 and torch.equal(grads[0], grads[1]), d
