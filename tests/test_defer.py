"""DeferAndFuse: sync points, fusion, the compile cache, step detection, reports, memory plan."""
import copy
import gc
import os
import re
import subprocess
import sys

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import deferfuse
from deferfuse.tensor import storage_of
from util import assert_same

pytestmark = pytest.mark.modes("defer")


def _pending(t):
    return storage_of(t).val.array is None     # either tensor representation (tensor.py)


def test_ops_are_recorded_not_run():
    x = torch.randn(8, 8).to("tpu")
    deferfuse.sync()
    deferfuse.reset_metrics()
    y = (x.sin() * 2).exp()
    assert _pending(y)
    assert y.shape == (8, 8) and y.dtype == torch.float32 and y.device.type == "tpu"
    assert deferfuse.metrics()["ops_recorded"] >= 3
    assert deferfuse.metrics()["regions_run"] == 0
    assert_same(y, (x.cpu().sin() * 2).exp())
    assert deferfuse.metrics()["regions_run"] == 1


@pytest.mark.parametrize("reason,trigger", [
    ("item", lambda y: y.sum().item()),
    ("cpu", lambda y: y.cpu()),
    ("tolist", lambda y: y.tolist()),
    ("print", lambda y: repr(y)),
    ("item", lambda y: bool(y.sum() > 0)),
    ("sync", lambda y: deferfuse.sync()),
    ("synchronize", lambda y: torch.tpu.synchronize()),
    ("synchronize", lambda y: torch.accelerator.synchronize()),
    ("data-dependent shape", lambda y: y.nonzero()),
    ("data-dependent shape", lambda y: y[y > 0]),
])
def test_sync_points_record_reason_and_line(reason, trigger):
    x = torch.randn(4, 4).to("tpu")
    deferfuse.sync()
    deferfuse.reset_metrics()
    y = x * 3
    trigger(y)
    m = deferfuse.metrics()
    assert m["syncs"].get(reason, 0) >= 1, m["syncs"]
    assert any(__file__ in site for site in m["sync_sites"]), m["sync_sites"]
    assert not _pending(y)


def test_mode_exit_syncs():
    with deferfuse.mode("strict"):
        pass
    deferfuse.reset_metrics()
    with deferfuse.mode("defer"):
        y = torch.ones(3, device="tpu") * 2
    assert not _pending(y)
    assert deferfuse.metrics()["syncs"].get("mode exit", 0) >= 1


def test_trace_limit_cuts():
    with deferfuse.override(trace_limit=50):
        x = torch.zeros(4, device="tpu")
        for _ in range(120):
            x = x + 1
        syncs = deferfuse.metrics()["syncs"]
        assert syncs.get("trace limit", 0) >= 1
        assert syncs.get("trace limit", 0) + syncs.get("loop boundary", 0) >= 2
        assert_same(x, torch.full((4,), 120.0))


def test_dead_values_never_become_outputs():
    x = torch.randn(256, 256).to("tpu")
    deferfuse.sync()
    deferfuse.reset_metrics()
    y = x.sin()
    z = y.cos()
    del y
    w = z * 2
    w.sum().item()
    m = deferfuse.metrics()
    # y was dropped before the sync: its 256 KB never became a buffer
    assert m["elided_bytes"] >= 256 * 256 * 4


@pytest.mark.parametrize("foreach", [None, False])
def test_steady_loop_compiles_nothing_after_second_step(foreach):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3)).to("tpu")
    # foreach=None picks the multi-tensor path for tpu parameters; its per-step bias corrections
    # arrive as a list of Python floats (List[number]), which must become inputs, not constants
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=foreach)
    sched = torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.9)   # lr changes every step
    x, y = torch.randn(5, 8).to("tpu"), torch.randint(0, 3, (5,)).to("tpu")
    compiles = []
    for step in range(5):
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        sched.step()
        loss.item()
        compiles.append(deferfuse.metrics()["compiles"])
    assert compiles[2] == compiles[3] == compiles[4], compiles
    assert deferfuse.metrics()["cache_hits"] >= 2


@pytest.mark.parametrize("opt_cls", [torch.optim.AdamW, torch.optim.SGD])
def test_parameters_update_in_their_own_buffers(opt_cls):
    """NOTE [alias order]: each parameter's new value is written into its old buffer (donated),
    not into a gradient's or another parameter's, so XLA copies no parameter out of the way; the
    values still match CPU eager."""
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    model = copy.deepcopy(ref).to("tpu")
    kw = dict(lr=0.01, momentum=0.9) if opt_cls is torch.optim.SGD else dict(lr=0.01)
    opts = [opt_cls(m.parameters(), **kw) for m in (model, ref)]
    x, y = torch.randn(5, 8), torch.randn(5, 4)
    xt, yt = x.to("tpu"), y.to("tpu")

    def step(k):
        m, opt, a, b = ((model, opts[0], xt, yt), (ref, opts[1], x, y))[k]
        opt.zero_grad()
        loss = F.mse_loss(m(a), b)
        loss.backward()
        opt.step()
        return loss.item()

    for _ in range(3):
        step(0), step(1)
    deferfuse.sync()

    def buffers():
        return [storage_of(p).val.array.unsafe_buffer_pointer() for p in model.parameters()]

    before = buffers()
    assert step(0) == pytest.approx(step(1), rel=1e-5)
    deferfuse.sync()
    assert buffers() == before
    for p, r in zip(model.parameters(), ref.parameters()):
        assert_same(p.detach(), r.detach(), atol=1e-6, rtol=1e-5)


def test_item_waits_only_for_the_ops_it_reads():
    # NOTE [needed first]: loss.item() after a training step runs the forward pass as one region,
    # and the backward pass and optimizer step as a second region that it does not wait for.
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))
    model = copy.deepcopy(ref).to("tpu")
    x, y = torch.randn(5, 8), torch.randint(0, 3, (5,))
    xt, yt = x.to("tpu"), y.to("tpu")
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (model, ref)]
    deferfuse.sync()
    deferfuse.reset_metrics()
    with deferfuse.override(backward_cut=False):    # it would dispatch the forward pass earlier
        for step in range(4):
            losses = []
            for m, opt, a, b in ((model, opts[0], xt, yt), (ref, opts[1], x, y)):
                opt.zero_grad()
                loss = F.cross_entropy(m(a), b)
                loss.backward()
                opt.step()
                losses.append(loss.item())
            assert losses[0] == pytest.approx(losses[1], rel=1e-5, abs=1e-6), step
    m = deferfuse.metrics()
    assert m["needed_first_splits"] == 4 and m["regions_run"] == 8, m
    assert m["donated_bytes"] > 0       # the optimizer step still updates its buffers in place
    for p, q in zip(model.parameters(), ref.parameters()):
        assert_same(p.detach(), q.detach(), atol=1e-5, rtol=1e-4)
    deferfuse.reset_metrics()
    with deferfuse.override(needed_first=False, backward_cut=False):  # the switch: one region
        opts[0].zero_grad()
        loss = F.cross_entropy(model(xt), yt)
        loss.backward()
        opts[0].step()
        loss.item()
    m = deferfuse.metrics()
    assert m["needed_first_splits"] == 0 and m["regions_run"] == 1, m


def test_index_error_in_ops_a_read_skips_is_raised_at_the_next_sync():
    w = torch.randn(10, 4).to("tpu")
    idx = torch.tensor([3, 12]).to("tpu")
    x = torch.randn(4).to("tpu")
    deferfuse.sync()
    s = x.sum()
    z = F.embedding(idx, w)        # out of range, in ops that s.item() does not need
    for _ in range(10):
        z = z * 2
    assert s.item() == pytest.approx(float(x.cpu().sum()), rel=1e-6)
    assert deferfuse.metrics()["needed_first_splits"] >= 1
    with pytest.raises(IndexError, match="embedding"):
        deferfuse.sync()
    del z



def test_index_error_in_the_ops_a_read_needs_is_raised_at_the_read():
    # The piece the read waits for and the piece after it are both dispatched before the first
    # one's index checks are read: the error still comes at the read, naming the op.
    w = torch.randn(10, 4).to("tpu")
    idx = torch.tensor([3, 12]).to("tpu")
    xc = torch.randn(4)
    x = xc.to("tpu")
    deferfuse.sync()
    deferfuse.reset_metrics()
    s = F.embedding(idx, w).sum()
    for _ in range(10):            # ops the read does not need: the second piece
        x = x * 2
    with pytest.raises(IndexError, match="embedding"):
        s.item()
    assert deferfuse.metrics()["needed_first_splits"] == 1
    torch.testing.assert_close(x.cpu(), xc * 1024)     # the other piece ran: its values are right

def _mlp_pair(seed=0):
    torch.manual_seed(seed)
    ref = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))
    model = copy.deepcopy(ref).to("tpu")
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (model, ref)]
    return model, ref, opts


def test_backward_cut_dispatches_the_forward_pass_and_the_read_the_rest():
    # NOTE [backward cut] (deferfuse/device.py): backward() dispatches the forward pass; loss.item()
    # finds the loss computed and dispatches the backward pass and optimizer step, waiting for none.
    from deferfuse.config import config
    model, ref, opts = _mlp_pair()
    x, y = torch.randn(5, 8), torch.randint(0, 3, (5,))
    xt, yt = x.to("tpu"), y.to("tpu")
    deferfuse.sync()
    deferfuse.reset_metrics()
    with deferfuse.override(backward_cut=True):
        assert config.backward_cut
        for step in range(4):
            losses = []
            for m, opt, a, b in ((model, opts[0], xt, yt), (ref, opts[1], x, y)):
                opt.zero_grad()
                loss = F.cross_entropy(m(a), b)
                loss.backward()
                if m is model:
                    assert not _pending(loss)           # dispatched when backward() began
                opt.step()
                if m is model:
                    assert _pending(next(model.parameters()))
                losses.append(loss.item())
                if m is model:
                    assert not _pending(next(model.parameters()))   # dispatched by the read
            assert losses[0] == pytest.approx(losses[1], rel=1e-5, abs=1e-6), step
            if step == 1:
                compiles = deferfuse.metrics()["compiles"]
    m = deferfuse.metrics()
    assert m["syncs"]["backward"] == 4 and m["syncs"]["item"] == 4, m["syncs"]
    assert m["regions_run"] == 8 and m["needed_first_splits"] == 0, m
    assert m["compiles"] == compiles        # steps 3 and 4 compiled nothing
    for p, q in zip(model.parameters(), ref.parameters()):
        assert_same(p.detach(), q.detach(), atol=1e-5, rtol=1e-4)


def test_backward_cut_runs_a_loop_without_syncs_as_one_region_per_step():
    model, ref, opts = _mlp_pair(1)
    x, y = torch.randn(5, 8), torch.randint(0, 3, (5,))
    xt, yt = x.to("tpu"), y.to("tpu")
    deferfuse.sync()
    deferfuse.reset_metrics()
    with deferfuse.override(backward_cut=True):
        for step in range(6):
            for m, opt, a, b in ((model, opts[0], xt, yt), (ref, opts[1], x, y)):
                opt.zero_grad()
                F.cross_entropy(m(a), b).backward()
                opt.step()
            if step == 2:
                compiles = deferfuse.metrics()["compiles"]
        assert deferfuse.metrics()["compiles"] == compiles
        assert deferfuse.metrics()["syncs"]["backward"] == 6
        for p, q in zip(model.parameters(), ref.parameters()):
            assert_same(p.detach(), q.detach(), atol=1e-5, rtol=1e-4)


def test_backward_cut_also_at_autograd_grad_and_off_in_strict_mode():
    w = torch.randn(4, 3, requires_grad=True)
    wt = w.detach().to("tpu").requires_grad_()
    x = torch.randn(2, 4)
    deferfuse.sync()
    deferfuse.reset_metrics()
    with deferfuse.override(backward_cut=True):
        (g,) = torch.autograd.grad((x.to("tpu") @ wt).tanh().sum(), wt)
        assert deferfuse.metrics()["syncs"]["backward"] == 1
        assert_same(g, torch.autograd.grad((x @ w).tanh().sum(), w)[0])
        with deferfuse.mode("strict"):
            (x.to("tpu") @ wt).sum().backward()
        assert deferfuse.metrics()["syncs"]["backward"] == 1


def test_backward_cut_raises_an_index_error_of_the_forward_pass_at_the_read():
    emb = nn.Embedding(10, 4).to("tpu")
    idx = torch.tensor([3, 12]).to("tpu")
    deferfuse.sync()
    with deferfuse.override(backward_cut=True):
        loss = emb(idx).sum()
        loss.backward()                 # dispatched; nobody waits, nothing raises yet
        with pytest.raises(IndexError, match="embedding"):
            loss.item()


def test_backward_cut_is_on_by_default_and_can_be_turned_off():
    from deferfuse.config import SETTINGS, config
    assert SETTINGS["backward_cut"].default is True
    assert SETTINGS["backward_cut"].parse("auto") and not SETTINGS["backward_cut"].parse("0")
    with deferfuse.override(backward_cut=False):
        assert not config.backward_cut


def test_loop_without_sync_detects_the_step():
    torch.manual_seed(0)
    w = torch.randn(16, 16).to("tpu")
    x = torch.randn(4, 16).to("tpu")
    with deferfuse.override(trace_limit=400):
        for _ in range(200):       # 7 ops a step, never a sync
            x = torch.tanh(x @ w) * 0.5 + x.mean() - 0.1
        c1 = deferfuse.metrics()["compiles"]
        for _ in range(200):
            x = torch.tanh(x @ w) * 0.5 + x.mean() - 0.1
        c2 = deferfuse.metrics()["compiles"]
    m = deferfuse.metrics()
    # Cut every k repetitions of the 7-op body, k * 7 >= steps.CUT_MIN_OPS (NOTE [early step
    # detection]): 2,800 ops, a cut every 133.
    assert m["syncs"].get("loop boundary", 0) >= 15, m["syncs"]
    assert c2 == c1, "the second run of the loop compiled again"
    assert torch.isfinite(x.cpu()).all()


def test_a_loop_without_backward_or_sync_is_cut_once_its_body_repeats():
    # NOTE [early step detection] (deferfuse/record.py): an evaluation loop collecting outputs has
    # no sync and no backward() to cut at; once 256 recorded ops show a repeating body, it is cut
    # at every repetition, and those pieces run while the rest is recorded (not at the end).
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
    mt = copy.deepcopy(m).to("tpu")
    xs = [torch.randn(3, 8) for _ in range(300)]
    xts = [x.to("tpu") for x in xs]
    deferfuse.sync()
    deferfuse.reset_metrics()
    compiles = []
    for run in range(2):
        with torch.no_grad():
            outs = [mt(x).softmax(-1) for x in xts]
        before_sync = deferfuse.metrics()
        got = torch.stack(outs)
        got.sum().item()
        compiles.append(deferfuse.metrics()["compiles"])
    with torch.no_grad():
        assert_same(got, torch.stack([m(x).softmax(-1) for x in xs]), atol=1e-5, rtol=1e-5)
    if deferfuse.current_mode() == "defer":
        # 4 ops an iteration: a cut every 32 iterations (steps.CUT_MIN_OPS), from the 64th on.
        assert before_sync["syncs"].get("loop boundary", 0) >= 12, before_sync["syncs"]
        assert before_sync["regions_run"] >= 12         # ran during the loop, not after it
        assert compiles[1] == compiles[0]               # the second pass compiled nothing


def test_a_loop_that_syncs_now_and_then_is_cut_again_right_after_the_sync():
    # NOTE [body phase] (deferfuse/record.py): a sync ends a trace partway into the loop body; the
    # next trace starts there, and is cut once it has recorded one body from that point, not only
    # after 256 more ops show the body again.
    torch.manual_seed(1)
    w = torch.randn(8, 8)
    wt = w.to("tpu")
    x, xt = torch.randn(2, 8), None
    xt = x.to("tpu")
    deferfuse.sync()
    cuts_after_sync = []
    for segment in range(3):
        # 4 ops an iteration; 1,360 ops from one sync to the next: more than an outer loop's body
        # that runs whole (NOTE [outermost body] in scheduler/steps.py).
        for i in range(300):
            h, ht = torch.tanh(x @ w), torch.tanh(xt @ wt)
            if i == 299:    # a sync halfway through an iteration: the next trace starts there
                assert_same(ht, h, atol=1e-4, rtol=1e-4)
                before = deferfuse.metrics()["syncs"].get("loop boundary", 0)
            x, xt = h * 0.5 + 0.1, ht * 0.5 + 0.1
        for _ in range(40):                     # 160 ops: fewer than step detection's 256
            x = torch.tanh(x @ w) * 0.5 + 0.1
            xt = torch.tanh(xt @ wt) * 0.5 + 0.1
        cuts_after_sync.append(deferfuse.metrics()["syncs"].get("loop boundary", 0) - before)
        assert_same(xt, x, atol=1e-4, rtol=1e-4)
    if deferfuse.current_mode() == "defer":
        # The body found is 128 ops (32 iterations): at least one cut in the 160 ops after a sync.
        assert all(c >= 1 for c in cuts_after_sync[1:]), cuts_after_sync


class _WordLM(torch.nn.Module):
    """pytorch/examples' word_language_model RNNModel (LSTM, its init and forward); ``cell``: the
    same LSTM written as a Python loop over time of ``nn.LSTMCell`` (a time loop inside the step)."""

    def __init__(self, ntoken=200, ninp=32, nhid=32, cell=False):
        super().__init__()
        self.encoder = torch.nn.Embedding(ntoken, ninp)
        self.rnn = torch.nn.LSTMCell(ninp, nhid) if cell else torch.nn.LSTM(ninp, nhid, 1)
        self.decoder = torch.nn.Linear(nhid, ntoken)
        torch.nn.init.uniform_(self.encoder.weight, -0.1, 0.1)
        torch.nn.init.zeros_(self.decoder.bias)
        torch.nn.init.uniform_(self.decoder.weight, -0.1, 0.1)

    def forward(self, x, hidden):
        emb = self.encoder(x)
        if isinstance(self.rnn, torch.nn.LSTMCell):
            h, c = hidden[0][0], hidden[1][0]
            outs = []
            for t in range(emb.size(0)):
                h, c = self.rnn(emb[t], (h, c))
                outs.append(h)
            out, hidden = torch.stack(outs), (h[None], c[None])
        else:
            out, hidden = self.rnn(emb, hidden)
        return torch.nn.functional.log_softmax(self.decoder(out), dim=-1).view(-1, 200), hidden


@pytest.mark.modes("defer")
@pytest.mark.parametrize("cell", [False, pytest.param(True, marks=pytest.mark.slow)],
                         ids=["LSTM", "LSTMCell_loop"])
def test_a_training_step_with_a_time_loop_is_one_body_not_one_per_time_step(cell):
    # NOTE [outermost body] (scheduler/steps.py): word_language_model's training loop (bptt 35,
    # clip_grad_norm_, the manual ``p.data.add_``, ``loss.item()`` every batch) ran as about 94
    # regions a batch: step detection cut at the LSTM's time steps inside the step. nn.LSTM now
    # records one op a layer (deferfuse/rnn.py: CPU's oneDNN layer, a scan); a Python loop over
    # nn.LSTMCell keeps the time loop inside the step (slow: its backward's ``select_backward``
    # bakes the time index, a program per index; its gradient chain runs op by op).
    torch.manual_seed(0)
    m = _WordLM(cell=cell)
    data = torch.randint(0, 200, (35 * 8 + 1, 4))
    runs = {}
    for dev in ("cpu", "tpu"):
        model = copy.deepcopy(m).to(dev)
        hidden = (torch.zeros(1, 4, 32, device=dev), torch.zeros(1, 4, 32, device=dev))
        losses, regions, ops, compiles = [], [], [], []
        for i in range(0, data.size(0) - 1, 35):
            x, y = data[i:i + 35].to(dev), data[i + 1:i + 36].reshape(-1).to(dev)
            before = deferfuse.metrics()
            model.zero_grad()
            hidden = tuple(h.detach() for h in hidden)
            out, hidden = model(x, hidden)
            loss = torch.nn.functional.nll_loss(out, y)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.25)
            for p in model.parameters():
                p.data.add_(p.grad, alpha=-20.0)
            losses.append(loss.item())
            after = deferfuse.metrics()
            regions.append(after["regions_run"] - before["regions_run"])
            ops.append(after["ops_recorded"] - before["ops_recorded"])
            compiles.append(after["compiles"] - before["compiles"])
        runs[dev] = (model, losses, regions, ops, compiles)
    (mc, lc, _, _, _), (mt, lt, regions, ops, compiles) = runs["cpu"], runs["tpu"]
    torch.testing.assert_close(torch.tensor(lt), torch.tensor(lc), atol=1e-5, rtol=1e-5)
    for p, q in zip(mc.parameters(), mt.parameters()):
        torch.testing.assert_close(q.detach().cpu(), p.detach(), atol=1e-5, rtol=1e-5)
    m = deferfuse.metrics()
    if not cell:
        # Every batch: the forward pass (cut at backward()) and the rest, about 30 ops in all,
        # none run op by op; in the first, the initial hidden state's zeros (made before the loop
        # and kept) run first, so its forward pass is the next batches' (NOTE [setup first] in
        # scheduler/cut.py: the second batch compiled that pass again), and no batch after the
        # first compiles anything.
        assert regions == [3] + [2] * (len(regions) - 1) and max(ops) < 40, (regions, ops)
        assert not any(compiles[1:]), compiles
        assert m["shape_fallbacks"] == 0 and "op by op" not in deferfuse.report(file=False)
        return
    # From the fourth batch on: the forward pass (cut at backward()) and the rest.
    assert max(regions[4:]) <= 3, regions
    assert m["caches"]["loop bodies"]["outer_loops"] >= 1


class _TinyDiT(nn.Module):
    """A diffusion transformer's shape in torch ops: a timestep embedding, three blocks with
    adaptive LayerNorm and attention over patches (82 ops a denoising step), and a decoder of 30
    small convolutions (91 ops), as a pipeline's VAE decode."""

    def __init__(self, d=16, blocks=3, convs=30):
        super().__init__()
        self.inp, self.t1, self.out = nn.Linear(16, d), nn.Linear(16, d), nn.Linear(d, 16)
        self.blocks = nn.ModuleList(nn.ModuleDict(dict(
            ada=nn.Linear(d, 2 * d), n1=nn.LayerNorm(d), qkv=nn.Linear(d, 3 * d), o=nn.Linear(d, d),
            n2=nn.LayerNorm(d), f1=nn.Linear(d, 2 * d), f2=nn.Linear(2 * d, d))) for _ in range(blocks))
        self.dec = nn.ParameterList(nn.Parameter(torch.randn(4, 4, 3, 3) * 0.05) for _ in range(convs))

    def forward(self, x, t):
        B = x.shape[0]
        e = t[:, None] * torch.exp(-torch.arange(8, device=x.device, dtype=torch.float32) / 8)
        temb = F.silu(self.t1(torch.cat([e.sin(), e.cos()], -1)))
        h = self.inp(x.reshape(B, 4, 4, 2, 4, 2).permute(0, 2, 4, 1, 3, 5).reshape(B, 16, 16))
        for b in self.blocks:
            sc, sh = b["ada"](temb).chunk(2, -1)
            q, k, v = b["qkv"](b["n1"](h) * (1 + sc[:, None]) + sh[:, None]).chunk(3, -1)
            h = h + b["o"](torch.softmax(q @ k.transpose(-1, -2) / 4.0, -1) @ v)
            h = h + b["f2"](F.gelu(b["f1"](b["n2"](h))))
        return self.out(h).reshape(B, 4, 4, 4, 2, 2).permute(0, 3, 1, 4, 2, 5).reshape(B, 4, 8, 8)

    def sample(self, lat, steps=4, clamp=False):
        """Flow-matching Euler steps with guidance, then the decode: one call, read once."""
        ts = torch.linspace(1.0, 0.0, steps + 1, device=lat.device)
        for i in range(steps):
            t = ts[i].expand(lat.shape[0]) * 1000
            vu, vc = self(torch.cat([lat, lat]), torch.cat([t, t])).chunk(2)
            lat = lat + (ts[i + 1] - ts[i]) * (vu + 3.0 * (vc - vu))
        out = lat / 0.18
        for w in self.dec:
            out = torch.tanh(F.conv2d(out, w, padding=1)) + out
        return out.clamp(-50, 50) if clamp else out


@torch.no_grad()
def test_a_short_pipeline_called_again_keeps_its_steps_cut():
    # NOTE [outermost body] (scheduler/steps.py): a 4-step denoising call repeated was taken for an
    # outer loop's body: its third call compiled the whole call again as one program (4.8 s here,
    # work the first call had compiled as pieces), and so did each call that differed by an op. Its
    # steps (82 ops each) are a loop of long iterations: they stay cut, every call runs the same
    # pieces, and a call that adds an op at its end compiles only the piece that changed.
    torch.manual_seed(0)
    m = _TinyDiT().eval()
    mt = copy.deepcopy(m).to("tpu")
    lat = torch.randn(1, 4, 8, 8)
    counts = []
    outer = deferfuse.metrics()["caches"]["loop bodies"]["outer_loops"]
    for clamp in (False, False, False, True, False):
        before = deferfuse.metrics()
        got = mt.sample(lat.to("tpu"), clamp=clamp)
        assert_same(got, m.sample(lat, clamp=clamp), atol=1e-4, rtol=1e-4)
        after = deferfuse.metrics()
        counts.append({k: after[k] - before[k] for k in ("compiles", "regions_run", "shape_fallbacks",
                                                          "shape_splits", "ops_recorded")})
    assert [c["ops_recorded"] for c in counts] == [420, 420, 420, 421, 420], counts
    assert [c["compiles"] for c in counts[1:]] == [0, 0, 1, 0], counts     # the clamp's piece
    assert len({c["regions_run"] for c in counts}) == 1 and counts[0]["regions_run"] > 1, counts
    assert all(c["shape_fallbacks"] == 0 and c["shape_splits"] == 0 for c in counts), counts
    assert deferfuse.metrics()["caches"]["loop bodies"]["outer_loops"] == outer


@torch.no_grad()
def test_a_pipeline_whose_first_call_donates_less_keeps_its_steps_compiled():
    # NOTE [shape churn] (runtime/flush.py): a step's program is keyed by its donation pattern too.
    # With the garbage collector off (or after a refused torch.compile, by the collector's timing)
    # the first call's first step donated one input fewer: a third program for the same ops at the
    # same shapes, counted as a third set of shapes, so the step ran op by op (43 compiles, not 4)
    # and the next call compiled again. The same shapes under another key are not a new version.
    gc_was = gc.isenabled()
    gc.disable()
    try:
        torch.manual_seed(0)
        m = _TinyDiT().eval()
        mt = copy.deepcopy(m).to("tpu")
        lat = torch.randn(1, 4, 8, 8)
        counts = []
        for _ in range(3):
            before = deferfuse.metrics()
            got = mt.sample(lat.to("tpu"))
            assert_same(got, m.sample(lat), atol=1e-4, rtol=1e-4)
            after = deferfuse.metrics()
            counts.append({k: after[k] - before[k] for k in ("compiles", "shape_fallbacks")})
    finally:
        if gc_was:
            gc.enable()
    assert all(c["shape_fallbacks"] == 0 for c in counts), counts
    assert [c["compiles"] for c in counts[1:]] == [0, 0], counts
    assert counts[0]["compiles"] <= 8, counts


def test_many_steps_before_one_sync_compile_one_region_per_step():
    # NOTE [loop split]: a loop that syncs every 100 steps recorded 100 steps as one program
    # (1,900 ops of a small MLP took 98 s to compile); it runs as one cached region per step.
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 2))
    mt = copy.deepcopy(m).to("tpu")
    x, y = torch.randn(4, 8), torch.randn(4, 2)
    losses = []
    for model, dev in ((m, "cpu"), (mt, "tpu")):
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        with deferfuse.override(backward_cut=False):    # it would cut every step at backward()
            for _ in range(30):
                loss = torch.nn.functional.mse_loss(model(x.to(dev)), y.to(dev))
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
        losses.append(loss.item())
    metrics = deferfuse.metrics()
    assert abs(losses[0] - losses[1]) < 1e-5 * max(1.0, abs(losses[0]))
    for p, q in zip(m.parameters(), mt.parameters()):
        torch.testing.assert_close(q.detach().cpu(), p.detach(), atol=1e-5, rtol=1e-5)
    if deferfuse.current_mode() == "defer":
        # The first 256 ops run one region per step; then the loop is cut every 7 steps (NOTE
        # [early step detection]: k repetitions of a body, k * body >= 128 ops).
        assert metrics["loop_splits"] == 1
        assert metrics["regions_run"] >= 12
        assert metrics["region_compiles"] <= 6, metrics["miss_reasons"]


def test_scalars_do_not_recompile():
    x = torch.ones(4).to("tpu")
    deferfuse.sync()
    deferfuse.reset_metrics()
    for lr in (0.1, 0.2, 0.3, 0.7):
        (x * lr + lr).sum().item()
    m = deferfuse.metrics()     # one program, compiled or loaded from the on-disk cache
    assert m["region_compiles"] + m["disk_cache_hits"] == 1


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int32])
def test_packed_scalars_keep_pytorch_promotion(dtype, monkeypatch):
    # A region's Python scalars arrive packed (floats and ints as two arrays, see execute.py):
    # interleaved floats and ints, on narrow dtypes, must still promote as Python numbers do.
    from deferfuse.engine import engine
    monkeypatch.setattr(engine.runner.programs, "dir", None)   # lowered here, to read its HLO
    x = (torch.arange(12, dtype=torch.float32) * 0.37 - 2).to(dtype)
    xt = x.to("tpu")
    deferfuse.sync()
    deferfuse.clear_caches()    # the other dtypes' versions of this structure would count as churn
    deferfuse.reset_metrics()
    tol = 1e-2 if dtype == torch.bfloat16 else 1e-6     # XLA fuses: one rounding, not five
    for a, k in ((1.3, 3), (0.7, 5), (-2.9, 11)):
        fn = lambda t: ((t * a + k) * k - a).div(k).sub(a * 0.5) + 7  # noqa: E731
        assert_same(fn(xt), fn(x), atol=tol, rtol=tol)
    m = deferfuse.metrics()
    assert m["region_compiles"] + m["disk_cache_hits"] == 1, m["miss_reasons"]
    # Weakly typed, as Python numbers are: no arithmetic on the tensor happened in float64.
    from deferfuse.engine import engine
    (region,) = engine.runner.regions.values()
    hlo = region.lowered.as_text()
    assert "tensor<f64>" in hlo and "tensor<12xf64>" not in hlo


def test_report_explains_a_recompile():
    x = torch.ones(4).to("tpu")
    (x * 3).sum().item()
    x2 = torch.ones(5).to("tpu")
    (x2 * 3).sum().item()
    text = deferfuse.report(file=False)
    assert "what compiled and why" in text
    assert re.search(r"shape \[5\], cached \[4\]", text), text
    assert "sync" in text and __file__ in text


def test_report_tells_waits_from_cuts():
    # A training step: backward() cuts (nothing waits), .item() waits. The report keeps them apart
    # and says what each cut did, so a cut is not read as a place the code made the device wait.
    model = nn.Linear(4, 2).to("tpu")
    x = torch.randn(3, 4).to("tpu")
    deferfuse.sync()
    deferfuse.reset_metrics()
    with deferfuse.override(backward_cut=True):
        loss = model(x).square().mean()
        loss.backward()
        loss.item()
    text = deferfuse.report(file=False)
    if deferfuse.current_mode() != "defer":
        assert "syncs: 0" in text
        return
    assert "1 where the host waited for the device, 1 cuts that waited for nothing" in text, text
    assert "backward: backward() dispatched the forward pass" in text, text
    waited = text.split("top sync sites")[1].split("top cut sites")[0]
    assert "item" in waited and "backward" not in waited, text
    assert __file__ in text.split("top cut sites")[1].splitlines()[1], text


def test_report_names_new_ops_not_a_shape_of_another_region():
    """A region with other ops is explained as a new structure, even when the closest cached region
    of its length starts with the same op on other shapes."""
    a, b = torch.ones(4).to("tpu"), torch.ones(5).to("tpu")
    deferfuse.sync()
    (a * 3).exp().sum().item()
    deferfuse.reset_metrics()
    (b * 3).sin().sum().item()
    why = deferfuse.metrics()["miss_reasons"][-1][1]
    # (the closest cached region may be another test's: only this region's own op is certain)
    assert why.startswith("new region structure") and "where this has aten.sin" in why, why
    assert "shape" not in why, why


@pytest.mark.parametrize("buckets", [True, False])
def test_growing_shape_splits_region_and_stays_correct(buckets):
    # generate()-like: a stable computation plus a sequence that grows by one each step. After
    # shape_recompile_limit versions the region runs padded in buckets of lengths (NOTE
    # [buckets]), or without buckets, the growing ops are split off and the rest compiles once.
    def run(dev):
        torch.manual_seed(0)
        w, h = torch.randn(8, 8).to(dev), torch.randn(2, 8).to(dev)
        seq, out, region_compiles = torch.zeros(2, 1, dtype=torch.long).to(dev), [], []
        for _ in range(10):
            h = torch.tanh(h @ w) * 0.9 + h.mean()
            seq = torch.cat([seq, h.argmax(-1, keepdim=True)], 1)
            out.append((seq * 2).sum().item() + h.sum().item())
            m = deferfuse.metrics()     # with buckets: programs made, compiled or loaded
            region_compiles.append(m["region_compiles"] + buckets * m["program_disk_hits"])
        return out, region_compiles, seq
    want, _, want_seq = run("cpu")
    deferfuse.clear_caches()
    with deferfuse.override(buckets=buckets):
        got, region_compiles, got_seq = run("tpu")
    assert got == pytest.approx(want, rel=1e-5)
    assert_same(got_seq, want_seq)
    m = deferfuse.metrics()
    assert (m["bucketed_runs"] > 0 and m["shape_splits"] == 0) if buckets else \
        (m["shape_splits"] > 0 and m["bucketed_runs"] == 0), m
    # (with buckets: the bucket of 16 is the last one made, at the 9th step)
    assert region_compiles[8 if buckets else 6] == region_compiles[-1], region_compiles
    text = deferfuse.report(file=False)    # a second call: report() stays the function
    assert "input 0 has shape" in text or "is a view of a tensor of shape" in text, text


def test_recurring_shapes_compile_whole_on_their_second_run():
    # Bucketed batch shapes: more shapes than shape_recompile_limit, each coming back. Buckets past
    # the limit run split the first time they are seen and compile whole the second time; after
    # that every bucket runs as one cached region.
    w = torch.randn(6, 6).to("tpu")
    for rnd in range(4):
        before = dict(deferfuse.metrics())
        for n in (2, 3, 4, 5):
            x = torch.ones(n, 6).to("tpu")
            got = ((x @ w).relu() * 2 - 1).sum(0)
            assert_same(got, ((torch.ones(n, 6) @ w.cpu()).relu() * 2 - 1).sum(0), rtol=1e-5)
        m = deferfuse.metrics()
        if rnd == 3:
            assert m["region_compiles"] == before["region_compiles"]
            assert m["shape_splits"] + m["shape_fallbacks"] == \
                before["shape_splits"] + before["shape_fallbacks"]


def test_dump_trace(tmp_path):
    x = torch.ones(3).to("tpu")
    (x.sin() + x.cos()).sum().item()
    path = deferfuse.dump_trace(str(tmp_path / "trace"))
    text = open(path).read()
    assert text.startswith("digraph") and "aten.sin" in text and "->" in text
    # a trace run as two regions (see NOTE [needed first]) shows which op ran in which
    s = x.sum()
    z = x
    for _ in range(10):
        z = z.exp()
    s.item()
    text = open(deferfuse.dump_trace(str(tmp_path / "split"))).read()
    assert "run as 2 regions" in text and "r1 " in text and "aten.exp" in text
    del z


def test_cross_check_passes_on_good_region():
    with deferfuse.override(cross_check=True):
        x = torch.randn(16).to("tpu")
        assert_same((x.exp() * 2).sum(), (x.cpu().exp() * 2).sum(), atol=1e-4)


def test_error_in_region_names_op_and_line():
    from deferfuse.runtime.lowering import LOWERINGS, Lowering
    op = torch.ops.aten.erfinv.default
    saved = LOWERINGS.get(op)

    def broken(x):
        raise ValueError("lowering exploded")
    try:
        from deferfuse import opinfo
        opinfo._INFOS.pop(op, None)
        deferfuse.clear_caches()      # the dispatcher's routes hold the op's OpInfo
        LOWERINGS[op] = Lowering(broken)
        x = torch.rand(4).to("tpu")
        y = x * 2
        z = torch.erfinv(y * 0.1)     # the failing line
        with pytest.raises(deferfuse.RegionError, match=r"(?s)erfinv.*test_defer.py:\d+.*debug"):
            z.cpu()
    finally:
        if saved is None:
            LOWERINGS.pop(op, None)
        else:
            LOWERINGS[op] = saved
        opinfo._INFOS.pop(op, None)
        deferfuse.clear_caches()


def test_donation_never_exposes_a_dead_buffer():
    p = torch.randn(1000).to("tpu")
    view = p[:10]
    q = torch.randn(1000).to("tpu")
    deferfuse.sync()
    p.mul_(2).add_(q)                 # p's old buffer is dead: donated
    deferfuse.sync()
    assert deferfuse.metrics()["donated_bytes"] >= 4000
    assert_same(view, (p.cpu())[:10])
    # a tensor saved for backward keeps its storage; autograd still sees the right values
    w = torch.randn(10).to("tpu").requires_grad_()
    h = w * 3
    s = (h.exp()).sum()
    s.backward()
    assert_same(w.grad, 3 * (3 * w.detach().cpu()).exp(), atol=1e-4, rtol=1e-5)


def test_disk_cache_second_process_compiles_nothing(tmp_path):
    code = ("import torch, deferfuse\n"
            "x = torch.arange(10.).to('tpu')\n"
            "print((x.sin() * 3 + x.cos()).sum().item())\n"
            "m = deferfuse.metrics(); print(m['region_compiles'], m['disk_cache_hits'])\n")
    env = {**os.environ, "DEFERFUSE_CACHE_DIR": str(tmp_path), "TORCHTPU_MODE": "defer"}
    runs = [subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                           check=True).stdout.split("\n") for _ in range(2)]
    assert runs[0][0] == runs[1][0]
    first_hits = int(runs[0][1].split()[1])
    second_hits = int(runs[1][1].split()[1])
    assert first_hits == 0 and second_hits >= 1, runs


def test_linalg_programs_loaded_in_a_second_process_run(tmp_path):
    """A program with LAPACK calls (svd, qr, eigh) loaded from the program store in a new process
    ran through jaxlib's LAPACK table before anything filled it: a segmentation fault (NOTE
    [loaded programs and LAPACK] in runtime/diskcache.py). Both processes print CPU's values."""
    code = ("import torch, deferfuse\n"
            "a = torch.arange(15.).reshape(5, 3).sin()\n"
            "t = a.to('tpu')\n"
            "s = torch.linalg.svd(t, full_matrices=False)[1]\n"
            "r = torch.linalg.qr(t)[1].abs()\n"
            "e = torch.linalg.eigvalsh(t.mT @ t)\n"
            "want = torch.cat([torch.linalg.svd(a, full_matrices=False)[1],\n"
            "                  torch.linalg.qr(a)[1].abs().flatten(), torch.linalg.eigvalsh(a.mT @ a)])\n"
            "got = torch.cat([s, r.flatten(), e]).cpu()\n"
            "print(torch.allclose(got, want, atol=1e-4), deferfuse.metrics()['disk_cache_hits'])\n")
    env = {**os.environ, "DEFERFUSE_CACHE_DIR": str(tmp_path), "TORCHTPU_MODE": "strict"}
    runs = [subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
            for _ in range(2)]
    assert [r.returncode for r in runs] == [0, 0], [r.stderr[-2000:] for r in runs]
    out = [r.stdout.split() for r in runs]
    assert out[0][0] == out[1][0] == "True", out
    assert int(out[1][1]) >= 1, out          # the second process loaded what the first stored


def test_memory_budget_splits_regions_and_matches():
    x = torch.randn(256, 256)

    def f(t):
        a = t.sin()
        b = t @ t
        c = (b.tanh() * a).sum(0)
        return ((c[None] * t).cos() @ t + a).sum()
    want = f(x)
    xt = x.to("tpu")
    deferfuse.sync()
    with deferfuse.override(memory_budget=600_000):      # x alone is 256 KB
        got = f(xt)
        assert_same(got, want, atol=1e-2, rtol=1e-4)
        assert deferfuse.metrics()["budget_splits"] >= 1
        compiles = deferfuse.metrics()["compiles"]
        assert_same(f(xt), want, atol=1e-2, rtol=1e-4)   # the split is cached too
        assert deferfuse.metrics()["compiles"] == compiles


def test_max_regions_drops_compiled_programs_and_stays_correct():
    # A long-running process that compiles many distinct regions drops them all past max_regions
    # (and JAX's own caches) instead of exhausting the CPU JIT's memory mappings.
    with deferfuse.override(max_regions=3):
        for n in range(2, 9):
            x = torch.arange(float(n))
            got = (x.to("tpu") * 2 + 1).sum()
            assert_same(got, (x * 2 + 1).sum())
    assert deferfuse.metrics()["region_evictions"] >= 1


_ITEM_DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.int8, torch.int16,
                torch.int32, torch.int64, torch.uint8, torch.uint16, torch.uint32, torch.bool,
                torch.complex64, torch.complex128]


@pytest.mark.parametrize("dtype", _ITEM_DTYPES, ids=str)
def test_item_is_cpus_number(dtype):
    """``.item()`` reads the number without a CPU tensor for the dtypes numpy gives as torch does
    (transfer.to_number) and through one for the others: the same Python type and value as CPU's,
    -0.0, nan and inf included, of a base, of a view and of a computed value."""
    for v in (3.25, -0.0, float("nan"), float("inf"), 7, -5, 300, True):
        c = torch.tensor(v).to(dtype)
        got = [c.to("tpu").item(), c.to("tpu").reshape(1, 1)[0, 0].item()]
        want = [c.item(), c.reshape(1, 1)[0, 0].item()]
        if not dtype.is_complex:
            got.append((c.to("tpu").reshape(1) * 1)[0].item())
            want.append((c.reshape(1) * 1)[0].item())
        for g, w in zip(got, want):
            assert type(g) is type(w), (v, g, w)
            assert repr(g) == repr(w), (v, g, w)    # nan == nan, -0.0 != 0.0 as text
