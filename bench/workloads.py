"""The benchmark workloads: one builder per workload for PyTorch systems, and where written, a
hand-written JAX twin of the same computation (the XLA ceiling).

A PyTorch builder is ``build(ctx, quick) -> Built``; ``ctx`` (a ``Ctx``) says which device to use,
how to wait for a result and how to wrap a function for a compiling system. A JAX builder is
``build_jax(quick) -> Built``. Every builder seeds with ``SEED`` and makes its model and inputs on
CPU first, so every system starts from the same weights and the same data; the JAX twins take their
weights from the very same PyTorch modules.

``Built.step()`` runs one timed step and returns only once the work is done (a ``.item()`` or an
explicit device sync), optionally a dict of extra per-step metrics. ``Built.check()`` returns a
number computed after the timed steps (outside the timing) that should agree across systems.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

from models import GPT, GrowGPT, LSTMLM, TransformerLM

SEED = 0


class NotApplicable(Exception):
    """This system has no sensible way to run this workload (the table says 'n/a' and why)."""


@dataclass
class Built:
    step: Callable[[], Any]
    check: Callable[[], float]
    flops: float = 0.0          # model FLOPs per step (matmul-bound workloads)
    bytes: float = 0.0          # minimum memory traffic per step (memory-bound workloads)
    items: tuple | None = None  # (unit, count per step), e.g. ("tok", 64) or ("op", 300)
    info: dict = field(default_factory=dict)
    compiles: Callable[[], int] | None = None   # compile count (JAX twins: jit cache size)
    train_step: Callable[[], Any] | None = None  # training workloads: one step, its loss unread


# --------------------------------------------------------------------------- system context
def import_torchax():
    """(torchax, its default environment). torchax 0.0.13 names aten overloads taking dimension
    names (aten.prod.dim_Dimname ...) that torch 2.13 removed; while it loads, such a lookup gives
    a placeholder instead of failing (torchax never dispatches them: tensors have no names)."""
    import torch._ops as ops
    orig = ops.OpOverloadPacket.__getattr__

    def lookup(self, key):
        try:
            return orig(self, key)
        except AttributeError:
            if key.startswith("__") or "name" not in key.lower():
                raise
            return object()
    ops.OpOverloadPacket.__getattr__ = lookup
    try:
        import torchax
        return torchax, torchax.default_env()
    finally:
        ops.OpOverloadPacket.__getattr__ = orig


class Ctx:
    """How one system runs PyTorch code: device, waiting for results, compiling a function."""

    def __init__(self, system: str):
        self.system = system
        self.tx = None
        if system in ("eager", "compile"):
            self.device = "cpu"
        elif system in ("strict", "debug", "compiled", "compiled_fb") or system.startswith("defer"):
            import deferfuse  # noqa: F401  (registers the device)
            self.device = "tpu"
        elif system in ("torchax", "torchax_jit"):
            self.tx, self.env = import_torchax()
            self.device = "jax"
        elif system == "floor":
            self.device = "floor"
        else:
            raise ValueError(f"not a PyTorch system: {system}")

    def sync(self, t=None) -> None:
        """Wait until everything issued so far (and ``t``) is computed."""
        if self.device == "tpu":
            import deferfuse
            deferfuse.sync()
            torch.tpu.synchronize()
        elif self.device == "jax" and t is not None:
            import jax
            jax.block_until_ready(t.jax() if hasattr(t, "jax") else t._elem)

    def to(self, x):
        return x.to(self.device)

    def jit(self, fn, what: str = "function"):
        """``fn`` as this system runs it: compiled for 'compile' / 'torchax_jit', else unchanged."""
        if self.system == "compile":
            return torch.compile(fn)
        if self.system == "compiled":
            return torch.compile(fn, backend="tpu")
        if self.system == "compiled_fb":
            raise NotApplicable(f"compiled_fb: the two-function form is a training step's; a "
                                f"{what} compiles as in 'compiled'")
        if self.system == "torchax_jit":
            if what != "function":
                raise NotApplicable(f"torchax_jit: no jitted form written for a {what}")
            return self.tx.interop.jax_jit(fn)
        return fn


class FloorTensor(torch.Tensor):
    """The floor of any Python tensor backend (system ``floor``, workload ``overhead``): a wrapper
    subclass whose ``__torch_dispatch__`` only makes the output tensor. What PyTorch costs to reach
    Python and back, per op, on this machine and this torch."""
    __torch_function__ = torch._C._disabled_torch_function_impl

    @staticmethod
    def __new__(cls, shape):
        return torch.Tensor._make_wrapper_subclass(cls, shape, dtype=torch.float32)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        return torch.Tensor._make_wrapper_subclass(FloorTensor, args[0].shape, None, None, None,
                                                   torch.float32, torch.strided,
                                                   torch.device("cpu"))


# --------------------------------------------------------------------------- helpers
def _gen(seed=SEED):
    return torch.Generator().manual_seed(seed)


def _train_built(ctx, model, opt, loss_fn, flops=0.0, info=None):
    """A training step (zero_grad, forward, loss, backward, optimizer step), synced by .item()."""
    if ctx.system == "torchax_jit":
        raise NotApplicable("torchax_jit: a jitted training step needs torchax.train + optax "
                            "(not written)")

    def train_step():
        opt.zero_grad(set_to_none=True)
        loss = loss_fn()
        loss.backward()
        opt.step()
        return loss

    if ctx.system == "compiled_fb":
        fn = _two_functions(loss_fn, opt)
    else:
        fn = ctx.jit(train_step, "training step")
    last = [float("nan")]

    def step():
        last[0] = fn().item()

    return Built(step=step, check=lambda: last[0], flops=flops, info=info or {}, train_step=fn)


def _two_functions(loss_fn, opt):
    """System ``compiled_fb``: the training step in docs/compiled.md's two-function form: forward
    and backward one compiled function returning ``loss.detach()`` (one Dynamo graph when
    ``trace_autograd_ops`` is on: ``fb_config``), the optimizer step compiled apart, ``zero_grad``
    outside both."""
    def forward_backward():
        loss = loss_fn()
        loss.backward()
        return loss.detach()

    fb = torch.compile(forward_backward, backend="tpu")
    update = torch.compile(opt.step, backend="tpu")

    def train_step():
        opt.zero_grad(set_to_none=True)
        loss = fb()
        update()
        return loss
    return train_step


def fb_config():
    """The setting system ``compiled_fb``'s steps run under (Dynamo reads it while it traces)."""
    return torch._dynamo.config.patch(trace_autograd_ops=True)


def _sizes(quick, small, big):
    return small if quick else big


# --------------------------------------------------------------------------- mlp_train
def _mlp_cfg(quick):
    return _sizes(quick, dict(batch=64, dims=(256, 512, 512, 16)),
                  dict(batch=256, dims=(1024, 2048, 2048, 16)))


def _mlp_make(cfg):
    torch.manual_seed(SEED)
    d = cfg["dims"]
    layers = []
    for i in range(len(d) - 1):
        layers.append(nn.Linear(d[i], d[i + 1]))
        if i < len(d) - 2:
            layers.append(nn.ReLU())
    model = nn.Sequential(*layers)
    g = _gen(1)
    x = torch.randn(cfg["batch"], d[0], generator=g)
    y = torch.randint(0, d[-1], (cfg["batch"],), generator=g)
    flops = 6.0 * cfg["batch"] * sum(d[i] * d[i + 1] for i in range(len(d) - 1))
    return model, x, y, flops


def mlp_train(ctx, quick):
    cfg = _mlp_cfg(quick)
    model, x, y, flops = _mlp_make(cfg)
    model = model.to(ctx.device)
    x, y = ctx.to(x), ctx.to(y)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    return _train_built(ctx, model, opt, lambda: F.cross_entropy(model(x), y), flops, cfg)


# --------------------------------------------------------------------------- gpt_train
def _gpt_cfg(quick):
    return _sizes(quick, dict(vocab=256, d=64, layers=2, heads=4, t=32, batch=4),
                  dict(vocab=1024, d=256, layers=4, heads=4, t=128, batch=8))


def _gpt_make(cfg):
    torch.manual_seed(SEED)
    model = GPT(cfg["vocab"], cfg["d"], cfg["layers"], cfg["heads"], cfg["t"])
    g = _gen(1)
    x = torch.randint(0, cfg["vocab"], (cfg["batch"], cfg["t"]), generator=g)
    y = torch.randint(0, cfg["vocab"], (cfg["batch"], cfg["t"]), generator=g)
    n, d, L, T = cfg["batch"] * cfg["t"], cfg["d"], cfg["layers"], cfg["t"]
    flops = 6.0 * n * (L * 12 * d * d + d * cfg["vocab"]) + 12.0 * cfg["batch"] * T * T * d * L
    return model, x, y, flops


def gpt_train(ctx, quick):
    cfg = _gpt_cfg(quick)
    model, x, y, flops = _gpt_make(cfg)
    model = model.to(ctx.device)
    x, y = ctx.to(x), ctx.to(y)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def loss_fn():
        out = model(x)
        return F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))

    return _train_built(ctx, model, opt, loss_fn, flops, cfg)


def gpt_train_log10(ctx, quick):
    """The GPT training loop reading its loss every 10 steps, as a loop that logs does: a bench
    step is 10 training steps with no sync between them, then ``.item()``."""
    built = gpt_train(ctx, quick)
    inner, fn = built.step, built.train_step

    def step():
        for _ in range(9):
            fn()
        inner()

    built.step = step
    built.flops *= 10
    built.info = dict(built.info, steps_per_sync=10)
    return built


def gpt_eval(ctx, quick):
    """An evaluation loop: the GPT's forward pass on 20 batches, the predictions collected and read
    once at the end (no sync and no backward() inside the loop)."""
    cfg = _gpt_cfg(quick)
    model, x, _, flops = _gpt_make(cfg)
    model = model.to(ctx.device).eval()
    g = _gen(2)
    xs = [ctx.to(torch.randint(0, cfg["vocab"], (cfg["batch"], cfg["t"]), generator=g))
          for _ in range(20)]
    fwd = ctx.jit(lambda b: model(b).argmax(-1), "forward pass")
    last = [float("nan")]

    def step():
        with torch.no_grad():
            preds = [fwd(b) for b in xs]
            last[0] = float(torch.stack(preds).float().mean().item())

    return Built(step=step, check=lambda: last[0], flops=flops / 3 * 20,
                 info=dict(cfg, batches=20))


# --------------------------------------------------------------------------- convnet_train
class _ResBlock(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.c1, self.b1 = nn.Conv2d(c, c, 3, padding=1, bias=False), nn.BatchNorm2d(c)
        self.c2, self.b2 = nn.Conv2d(c, c, 3, padding=1, bias=False), nn.BatchNorm2d(c)

    def forward(self, x):
        h = F.relu(self.b1(self.c1(x)))
        return F.relu(x + self.b2(self.c2(h)))


def convnet_train(ctx, quick):
    cfg = _sizes(quick, dict(batch=4, c=16, hw=16, blocks=1), dict(batch=16, c=32, hw=32, blocks=2))
    torch.manual_seed(SEED)
    c = cfg["c"]
    model = nn.Sequential(nn.Conv2d(3, c, 3, padding=1, bias=False), nn.BatchNorm2d(c), nn.ReLU(),
                          *[_ResBlock(c) for _ in range(cfg["blocks"])],
                          nn.Conv2d(c, 2 * c, 3, stride=2, padding=1, bias=False),
                          nn.BatchNorm2d(2 * c), nn.ReLU(),
                          nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(2 * c, 10))
    g = _gen(1)
    x = torch.randn(cfg["batch"], 3, cfg["hw"], cfg["hw"], generator=g)
    y = torch.randint(0, 10, (cfg["batch"],), generator=g)
    model = model.to(ctx.device)
    x, y = ctx.to(x), ctx.to(y)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=1e-4)
    return _train_built(ctx, model, opt, lambda: F.cross_entropy(model(x), y), 0.0,
                        dict(cfg, optimizer="SGD momentum"))


# --------------------------------------------------------------------------- pointwise workloads
def _ew_n(quick):
    return _sizes(quick, 1 << 20, 4 << 20)


def _ew_fn(x):
    y = x * 1.5 + 0.25
    y = y.sin()
    y = y * x
    y = y.abs()
    y = y.sqrt()
    y = y.tanh()
    y = y - x
    return y


def elementwise_chain(ctx, quick):
    n = _ew_n(quick)
    x = ctx.to(torch.randn(n, generator=_gen(1)))
    fn = ctx.jit(_ew_fn)
    out = [None]

    def step():
        out[0] = fn(x)
        ctx.sync(out[0])

    return Built(step=step, check=lambda: out[0].sum().item(), bytes=2.0 * 4 * n,
                 info=dict(n=n, ops=8))


def _li_n(quick):
    return _sizes(quick, 8 << 20, 32 << 20)     # 32 MB / 128 MB of float32


def _li_fn(x):
    a = x.sin()
    b = x.cos()
    c = x.exp()
    return (a * b + c * a - b).sum()


def live_intermediates(ctx, quick):
    n = _li_n(quick)
    x = ctx.to(torch.randn(n, generator=_gen(1)))
    fn = ctx.jit(_li_fn)
    last = [float("nan")]

    def step():
        last[0] = fn(x).item()

    return Built(step=step, check=lambda: last[0], bytes=4.0 * n, info=dict(n=n, x_mb=4 * n / 2**20))


def _ip_n(quick):
    return _sizes(quick, 2 << 20, 16 << 20)


def _ip_fn(x):
    x.mul_(0.999)
    x.add_(0.001)
    x.clamp_(-2.0, 2.0)
    x.sin_()
    x.mul_(1.5)
    x.sub_(0.01)
    x.abs_()
    x.sqrt_()
    return x


def inplace_chain(ctx, quick):
    if ctx.system == "torchax_jit":
        raise NotApplicable("torchax_jit: in-place updates of a jitted function's input are not "
                            "written back")
    n = _ip_n(quick)
    x = ctx.to(torch.randn(n, generator=_gen(1)))
    fn = ctx.jit(_ip_fn)

    def step():
        fn(x)
        ctx.sync(x)

    return Built(step=step, check=lambda: x.sum().item(), bytes=2.0 * 4 * n, info=dict(n=n, ops=8))


def _so_iters(quick):
    return _sizes(quick, 50, 100)


def _so_fn(x, iters):
    for _ in range(iters):
        x = (x * 0.9 + 0.1).tanh()
    return x


def small_ops(ctx, quick):
    iters = _so_iters(quick)
    x = ctx.to(torch.randn(64, generator=_gen(1)))
    fn = ctx.jit(lambda t: _so_fn(t, iters))
    last = [float("nan")]

    def step():
        last[0] = fn(x).sum().item()

    return Built(step=step, check=lambda: last[0], items=("op", 3 * iters + 1),
                 info=dict(iters=iters, ops=3 * iters + 1, numel=64))


def _ov_k(quick):
    return _sizes(quick, 200, 1000)


def overhead(ctx, quick):
    """µs per op of a chain of tiny multiplies, timed without the final sync: what recording costs
    in defer, what dispatching costs in strict, what a CPU op costs in eager."""
    if ctx.system in ("compile", "compiled", "compiled_fb", "torchax_jit"):
        raise NotApplicable(f"{ctx.system}: per-op overhead is measured op by op only")
    k = _ov_k(quick)
    x = torch.randn(16, generator=_gen(1))
    x = FloorTensor(x.shape) if ctx.system == "floor" else ctx.to(x)
    out = [None]

    def step():
        y = x
        t0 = time.perf_counter()
        for _ in range(k):
            y = y * 1.0001
        t1 = time.perf_counter()
        if ctx.system != "floor":
            ctx.sync(y)
        out[0] = y
        return {"us_per_op": (t1 - t0) / k * 1e6}

    return Built(step=step, check=lambda: out[0].sum().item(), items=("op", k), info=dict(ops=k))



# --------------------------------------------------------------------------- Hugging Face Llama
def _llama(quick):
    from transformers import LlamaConfig, LlamaForCausalLM
    c = _sizes(quick, dict(vocab_size=256, hidden_size=64, intermediate_size=128,
                           num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2),
               dict(vocab_size=512, hidden_size=128, intermediate_size=256,
                    num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2))
    cfg = LlamaConfig(max_position_embeddings=256, bos_token_id=1, eos_token_id=None,
                      pad_token_id=0, **c)
    torch.manual_seed(SEED)
    model = LlamaForCausalLM(cfg)
    c["attn_implementation"] = getattr(model.config, "_attn_implementation", None)
    return model, c


def hf_llama_train(ctx, quick):
    model, c = _llama(quick)
    b, t = _sizes(quick, (2, 32), (4, 64))
    ids = torch.randint(2, c["vocab_size"], (b, t), generator=_gen(1))
    model = model.to(ctx.device)
    model.train()
    ids = ctx.to(ids)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    return _train_built(ctx, model, opt, lambda: model(input_ids=ids, labels=ids).loss, 0.0,
                        dict(c, batch=b, seq=t))


def _generate(ctx, quick, cache):
    model, c = _llama(quick)
    b, t = 2, 16
    new = _sizes(quick, 8, 32)
    ids = torch.randint(2, c["vocab_size"], (b, t), generator=_gen(1))
    model = model.to(ctx.device).eval()
    if ctx.system in ("compile", "compiled"):
        model.forward = ctx.jit(model.forward)
    elif ctx.system == "torchax_jit":
        raise NotApplicable("torchax_jit: generate() is a Python loop; no jitted form written")
    ids = ctx.to(ids)
    mask = torch.ones_like(ids)
    kw = dict(attention_mask=mask, max_new_tokens=new, min_new_tokens=new, do_sample=False,
              pad_token_id=0, disable_compile=True)   # same Python for every system; 'compile'
    if cache:                                         # compiles forward itself (above)
        kw["cache_implementation"] = cache
    out = [None]

    def step():
        with torch.no_grad():
            o = model.generate(ids, **kw)
        out[0] = o.cpu()                              # the tokens reach the host: a real sync

    return Built(step=step, check=lambda: float(out[0].sum()), items=("tok", b * new),
                 info=dict(c, batch=b, prompt=t, new_tokens=new, cache=cache or "dynamic"))


def hf_generate(ctx, quick):
    return _generate(ctx, quick, None)


def hf_generate_static(ctx, quick):
    return _generate(ctx, quick, "static")


# --------------------------------------------------------------------------- programs that vary
# (issue 25) Loops whose offsets, lengths or batch sizes change from step to step.
def _bptt_cfg(quick):
    return _sizes(quick, dict(vocab=100, d=32, t=12, batch=8, tokens=4000),
                  dict(vocab=1000, d=128, t=35, batch=20, tokens=40000))


def _bptt(ctx, quick, arch):
    """Truncated BPTT as in PyTorch's word-language-model example: one long token tensor, each
    step trains on the slices ``data[i:i+T]``, ``data[i+1:i+1+T]`` at the next offset ``i`` (the
    hidden state carried over, detached)."""
    if ctx.system in ("compile", "torchax_jit"):
        raise NotApplicable(f"{ctx.system}: a training step with a carried state is not written")
    cfg = _bptt_cfg(quick)
    torch.manual_seed(SEED)
    model = (LSTMLM if arch == "lstm" else TransformerLM)(cfg["vocab"], cfg["d"])
    data = torch.randint(0, cfg["vocab"], (cfg["tokens"] // cfg["batch"], cfg["batch"]),
                         generator=_gen(1))
    model = model.to(ctx.device)
    data = ctx.to(data)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    T = cfg["t"]
    st = {"i": 0, "h": None, "loss": float("nan")}

    def step():
        i = st["i"]
        if i + T + 1 > data.shape[0]:
            i, st["h"] = 0, None
        x, y = data[i:i + T], data[i + 1:i + 1 + T]
        h = st["h"]
        if h is not None:
            h = tuple(z.detach() for z in h)
        out, h = model(x, h)
        loss = F.cross_entropy(out.reshape(-1, cfg["vocab"]), y.reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
        st["h"] = h if arch == "lstm" else None
        st["i"] = i + T
        st["loss"] = loss.item()

    return Built(step=step, check=lambda: st["loss"], items=("tok", T * cfg["batch"]),
                 info=dict(cfg, arch=arch))


def wlm_lstm(ctx, quick):
    """pytorch/examples' word_language_model training loop with its LSTM (issue 33's sizes at both
    sizes: 1 layer, 64 wide, bptt 35, batch 20, vocabulary 1000): log_softmax and NLLLoss,
    ``model.zero_grad()``, ``clip_grad_norm_(0.25)``, the manual ``p.data.add_(p.grad,
    alpha=-lr)`` and ``loss.item()`` every batch. Step detection once cut it at the LSTM's time
    steps (about 94 regions a batch): NOTE [outermost body] in scheduler/steps.py."""
    if ctx.system in ("compile", "torchax_jit"):
        raise NotApplicable(f"{ctx.system}: a training step with a carried state is not written")
    vocab, d, T, batch = 1000, 64, 35, 20
    torch.manual_seed(SEED)
    model = LSTMLM(vocab, d).to(ctx.device)
    data = ctx.to(torch.randint(0, vocab, (T * 40 + 1, batch), generator=_gen(1)))
    st = {"i": 0, "h": None, "loss": float("nan")}
    return Built(step=lambda: wlm_batch(model, data, st, T, vocab), check=lambda: st["loss"],
                 items=("tok", T * batch), info=dict(vocab=vocab, d=d, t=T, batch=batch))


def wlm_batch(model, data, st, T, vocab, mark=None):
    """One batch of word_language_model's training loop (``wlm_lstm``): the state ``st`` carries
    the position, the hidden state and the loss. ``mark(phase)``, when given, is called as each
    phase ends (``bench/wlm_step.py`` times them)."""
    mark = mark or (lambda phase: None)
    i = st["i"]
    if i + T + 1 > data.shape[0]:
        i, st["h"] = 0, None
    x, y = data[i:i + T], data[i + 1:i + 1 + T].reshape(-1)
    model.zero_grad()
    h = st["h"]
    if h is not None:
        h = tuple(z.detach() for z in h)
    out, h = model(x, h)
    loss = F.nll_loss(F.log_softmax(out, dim=-1).view(-1, vocab), y)
    mark("forward")
    loss.backward()
    mark("backward()")
    torch.nn.utils.clip_grad_norm_(model.parameters(), 0.25)
    mark("clip_grad_norm_")
    for p in model.parameters():
        p.data.add_(p.grad, alpha=-20.0)
    mark("p.data.add_")
    st["h"], st["i"] = h, i + T
    st["loss"] = loss.item()
    mark("item")


def bptt_lstm(ctx, quick):
    return _bptt(ctx, quick, "lstm")


def bptt_transformer(ctx, quick):
    return _bptt(ctx, quick, "transformer")


def nanogpt_sample(ctx, quick):
    """nanoGPT's ``generate(idx, 50, top_k=1)`` loop (list index, top-k mask write, multinomial)
    on the same GPT as ``gpt_generate_grow``, from a 1-token prompt."""
    if ctx.system in ("compile", "torchax_jit"):
        raise NotApplicable(f"{ctx.system}: a Python loop of growing shapes is not written")
    torch.manual_seed(SEED)
    model = GrowGPT().eval().to(ctx.device)
    n = 50
    prompt = ctx.to(torch.zeros((1, 1), dtype=torch.long))
    out = [None]

    def step():
        out[0] = model.sample(prompt, n).cpu()

    return Built(step=step, check=lambda: float(out[0].sum()), items=("tok", n),
                 info=dict(layers=2, d=64, prompt=1, new_tokens=n, kv_cache="none", top_k=1))


def gpt_generate_grow(ctx, quick):
    """``generate(50)`` of a 2-layer, 64-wide GPT from an 8-token prompt, the sequence growing by
    one token per step (no KV cache); a step is one generate() call, the tokens read at the end."""
    if ctx.system in ("compile", "torchax_jit"):
        raise NotApplicable(f"{ctx.system}: a Python loop of growing shapes is not written")
    torch.manual_seed(SEED)
    model = GrowGPT().eval().to(ctx.device)
    n = 50
    prompt = ctx.to(torch.randint(0, 96, (1, 8), generator=_gen(1)))
    out = [None]

    def step():
        out[0] = model.generate(prompt, n).cpu()

    return Built(step=step, check=lambda: float(out[0].sum()), items=("tok", n),
                 info=dict(layers=2, d=64, prompt=8, new_tokens=n, kv_cache="none"))


def ragged_train(ctx, quick):
    """An epoch of an MLP over a dataset whose last batch is smaller (3 batches of 64 and one of
    23, quick): a step is the epoch, each batch's loss read."""
    cfg = _sizes(quick, dict(dims=(64, 256, 256, 10), batches=(64, 64, 64, 23)),
                 dict(dims=(256, 1024, 1024, 10), batches=(256, 256, 256, 256, 77)))
    torch.manual_seed(SEED)
    d = cfg["dims"]
    model = nn.Sequential(nn.Linear(d[0], d[1]), nn.ReLU(), nn.Linear(d[1], d[2]), nn.ReLU(),
                          nn.Linear(d[2], d[3])).to(ctx.device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    g = _gen(1)
    data = [(ctx.to(torch.randn(b, d[0], generator=g)), ctx.to(torch.randint(0, d[3], (b,),
                                                                             generator=g)))
            for b in cfg["batches"]]
    last = [float("nan")]

    def step():
        for x, y in data:
            opt.zero_grad(set_to_none=True)
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            opt.step()
            last[0] = loss.item()

    return Built(step=step, check=lambda: last[0], items=("batch", len(cfg["batches"])),
                 info=cfg)


# --------------------------------------------------------------------------- JAX twins
def _jax():
    import jax
    import jax.numpy as jnp
    return jax, jnp


def _params(model):
    import jax.numpy as jnp
    return {k: jnp.asarray(v.detach().numpy()) for k, v in model.named_parameters()}


def _adamw(jax, jnp, lr=1e-3, b1=0.9, b2=0.999, eps=1e-8, wd=1e-2):
    """torch.optim.AdamW's update, written out (step count traced: no recompiles)."""
    def init(p):
        z = jax.tree.map(jnp.zeros_like, p)
        return dict(m=z, v=jax.tree.map(jnp.zeros_like, p), t=jnp.zeros((), jnp.float32))

    def update(p, g, s):
        t = s["t"] + 1
        bc1, bc2 = 1 - b1 ** t, 1 - b2 ** t
        m = jax.tree.map(lambda m, g: b1 * m + (1 - b1) * g, s["m"], g)
        v = jax.tree.map(lambda v, g: b2 * v + (1 - b2) * g * g, s["v"], g)
        p = jax.tree.map(lambda p, m, v: p * (1 - lr * wd) - (lr / bc1) * m /
                         (jnp.sqrt(v) / jnp.sqrt(bc2) + eps), p, m, v)
        return p, dict(m=m, v=v, t=t)
    return init, update


def _xent(jax, jnp, logits, y):
    lse = jax.nn.logsumexp(logits, axis=-1)
    return (lse - jnp.take_along_axis(logits, y[:, None], axis=-1)[:, 0]).mean()


def _jax_train(params, loss_fn, flops, info):
    jax, jnp = _jax()
    init, update = _adamw(jax, jnp)

    def train(p, s):
        loss, g = jax.value_and_grad(loss_fn)(p)
        p, s = update(p, g, s)
        return p, s, loss

    train = jax.jit(train, donate_argnums=(0, 1))
    st = [params, init(params)]
    last = [float("nan")]

    def train_step():
        st[0], st[1], loss = train(st[0], st[1])
        return loss

    def step():
        last[0] = float(train_step())

    return Built(step=step, check=lambda: last[0], flops=flops, info=info,
                 compiles=lambda: train._cache_size(), train_step=train_step)


def mlp_train_jax(quick):
    jax, jnp = _jax()
    cfg = _mlp_cfg(quick)
    model, x, y, flops = _mlp_make(cfg)
    idx = [i for i, m in enumerate(model) if isinstance(m, nn.Linear)]
    x, y = jnp.asarray(x.numpy()), jnp.asarray(y.numpy())

    def loss_fn(p):
        h = x
        for j, i in enumerate(idx):
            h = h @ p[f"{i}.weight"].T + p[f"{i}.bias"]
            if j < len(idx) - 1:
                h = jax.nn.relu(h)
        return _xent(jax, jnp, h, y)

    return _jax_train(_params(model), loss_fn, flops, cfg)


def gpt_train_jax(quick):
    jax, jnp = _jax()
    cfg = _gpt_cfg(quick)
    model, x, y, flops = _gpt_make(cfg)
    x, y = jnp.asarray(x.numpy()), jnp.asarray(y.numpy())
    B, T, d, H = cfg["batch"], cfg["t"], cfg["d"], cfg["heads"]
    hd = d // H

    def ln(h, w, b):
        mu = h.mean(-1, keepdims=True)
        var = ((h - mu) ** 2).mean(-1, keepdims=True)
        return (h - mu) / jnp.sqrt(var + 1e-5) * w + b

    def lin(h, p, name):
        return h @ p[name + ".weight"].T + p[name + ".bias"]

    causal = jnp.tril(jnp.ones((T, T), bool))

    def loss_fn(p):
        h = p["emb.weight"][x] + p["pos"][:T]
        for i in range(cfg["layers"]):
            pre = f"blocks.{i}."
            qkv = lin(ln(h, p[pre + "ln1.weight"], p[pre + "ln1.bias"]), p, pre + "qkv")
            q, k, v = (z.reshape(B, T, H, hd).transpose(0, 2, 1, 3) for z in jnp.split(qkv, 3, -1))
            att = jnp.where(causal, q @ k.transpose(0, 1, 3, 2) / math.sqrt(hd), -jnp.inf)
            a = (jax.nn.softmax(att, axis=-1) @ v).transpose(0, 2, 1, 3).reshape(B, T, d)
            h = h + lin(a, p, pre + "proj")
            m = jax.nn.gelu(lin(ln(h, p[pre + "ln2.weight"], p[pre + "ln2.bias"]), p, pre + "mlp.0"),
                            approximate=False)
            h = h + lin(m, p, pre + "mlp.2")
        logits = lin(h, p, "head")
        return _xent(jax, jnp, logits.reshape(B * T, -1), y.reshape(-1))

    return _jax_train(_params(model), loss_fn, flops, cfg)


def _jax_input(n):
    import jax.numpy as jnp
    return jnp.asarray(torch.randn(n, generator=_gen(1)).numpy())


def elementwise_chain_jax(quick):
    jax, jnp = _jax()
    n = _ew_n(quick)
    x = _jax_input(n)

    @jax.jit
    def f(x):
        y = jnp.sqrt(jnp.abs(jnp.sin(x * 1.5 + 0.25) * x))
        return jnp.tanh(y) - x
    out = [None]

    def step():
        out[0] = f(x).block_until_ready()

    return Built(step=step, check=lambda: float(out[0].sum()), bytes=2.0 * 4 * n,
                 info=dict(n=n, ops=8), compiles=lambda: f._cache_size())


def live_intermediates_jax(quick):
    jax, jnp = _jax()
    n = _li_n(quick)
    x = _jax_input(n)

    @jax.jit
    def f(x):
        a, b, c = jnp.sin(x), jnp.cos(x), jnp.exp(x)
        return (a * b + c * a - b).sum()
    last = [float("nan")]

    def step():
        last[0] = float(f(x))

    return Built(step=step, check=lambda: last[0], bytes=4.0 * n, info=dict(n=n),
                 compiles=lambda: f._cache_size())


def inplace_chain_jax(quick):
    jax, jnp = _jax()
    n = _ip_n(quick)
    st = [_jax_input(n)]

    def f(x):
        x = jnp.clip(x * 0.999 + 0.001, -2.0, 2.0)
        return jnp.sqrt(jnp.abs(jnp.sin(x) * 1.5 - 0.01))
    f = jax.jit(f, donate_argnums=0)

    def step():
        st[0] = f(st[0]).block_until_ready()

    return Built(step=step, check=lambda: float(st[0].sum()), bytes=2.0 * 4 * n, info=dict(n=n),
                 compiles=lambda: f._cache_size())


def small_ops_jax(quick):
    jax, jnp = _jax()
    iters = _so_iters(quick)
    x = _jax_input(64)

    @jax.jit
    def f(x):
        for _ in range(iters):
            x = jnp.tanh(x * 0.9 + 0.1)
        return x.sum()
    last = [float("nan")]

    def step():
        last[0] = float(f(x))

    return Built(step=step, check=lambda: last[0], items=("op", 3 * iters + 1),
                 info=dict(iters=iters), compiles=lambda: f._cache_size())


def overhead_jax(quick):
    jax, jnp = _jax()
    k = _ov_k(quick)
    x = _jax_input(16)
    mul = jax.jit(lambda y, s: y * s)
    s = jnp.float32(1.0001)
    out = [None]

    def step():
        y = x
        t0 = time.perf_counter()
        for _ in range(k):
            y = mul(y, s)
        t1 = time.perf_counter()
        out[0] = y.block_until_ready()
        return {"us_per_op": (t1 - t0) / k * 1e6}

    return Built(step=step, check=lambda: float(out[0].sum()), items=("op", k), info=dict(ops=k),
                 compiles=lambda: mul._cache_size())


# --------------------------------------------------------------------------- registry
# bound: "memory" (fraction of measured bandwidth), "compute" (fraction of measured FLOP/s) or None
WORKLOADS = {
    "mlp_train": dict(torch=mlp_train, jax=mlp_train_jax, bound="compute",
                      desc="MLP training step, AdamW"),
    "gpt_train": dict(torch=gpt_train, jax=gpt_train_jax, bound="compute",
                      desc="small GPT (causal SDPA) training step, AdamW"),
    "gpt_train_log10": dict(torch=gpt_train_log10, jax=None, bound="compute",
                            desc="the same GPT, 10 training steps per loss read (a loop that logs)"),
    "gpt_eval": dict(torch=gpt_eval, jax=None, bound="compute",
                     desc="the same GPT, forward passes on 20 batches, predictions read at the end"),
    "convnet_train": dict(torch=convnet_train, jax=None, bound=None,
                          desc="small ResNet with BatchNorm, training step, SGD momentum"),
    "elementwise_chain": dict(torch=elementwise_chain, jax=elementwise_chain_jax, bound="memory",
                              desc="8 pointwise ops on a few million floats"),
    "small_ops": dict(torch=small_ops, jax=small_ops_jax, bound=None,
                      desc="hundreds of tiny ops (dispatch-bound)"),
    "live_intermediates": dict(torch=live_intermediates, jax=live_intermediates_jax,
                               bound="memory", desc="sin/cos/exp of a 128 MB x, reduced (peak memory)"),
    "inplace_chain": dict(torch=inplace_chain, jax=inplace_chain_jax, bound="memory",
                          desc="8 in-place updates of a large tensor"),
    "hf_llama_train": dict(torch=hf_llama_train, jax=None, bound=None,
                           desc="tiny HF LlamaForCausalLM (random weights), training step, AdamW"),
    "hf_generate": dict(torch=hf_generate, jax=None, bound=None,
                        desc="tiny HF Llama, greedy generate, dynamic cache"),
    "hf_generate_static": dict(torch=hf_generate_static, jax=None, bound=None,
                               desc="tiny HF Llama, greedy generate, static cache"),
    "overhead": dict(torch=overhead, jax=overhead_jax, bound=None,
                     desc="per-op overhead: µs per tiny op (recorded / dispatched)"),
    "bptt_lstm": dict(torch=bptt_lstm, jax=None, bound=None,
                      desc="truncated BPTT LSTM language model over slices of one token tensor"),
    "wlm_lstm": dict(torch=wlm_lstm, jax=None, bound=None,
                     desc="word_language_model's LSTM training loop (clip_grad_norm_, p.data.add_)"),
    "bptt_transformer": dict(torch=bptt_transformer, jax=None, bound=None,
                             desc="truncated BPTT Transformer LM over slices of one token tensor"),
    "gpt_generate_grow": dict(torch=gpt_generate_grow, jax=None, bound=None,
                              desc="GPT sampling loop, sequence grown by torch.cat, generate(50)"),
    "nanogpt_sample": dict(torch=nanogpt_sample, jax=None, bound=None,
                           desc="nanoGPT's sampling loop (list index, top-k mask, multinomial)"),
    "ragged_train": dict(torch=ragged_train, jax=None, bound=None,
                         desc="MLP training epoch whose last batch is smaller"),
}
