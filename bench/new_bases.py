"""A learnt model met at another base (issue 33, NOTE [new bases] in runtime/buckets.py): what each
phase compiles when one model is trained, evaluated and sampled at batch sizes and prompt lengths
it has not met, in defer mode, in one process from a cold cache folder, each phase's result
compared with CPU eager on the same inputs.

    python bench/new_bases.py [--tokens 20] [--only "wlm LSTM"]

Phases: train a small GPT (nanoGPT's shape) at batch 8, evaluate at 8, 3 and 5, train at 3 and 5,
sample 20 tokens from one token at batch 1, then from a 3-token prompt at batch 2, and again; then
pytorch/examples' word_language_model with its LSTM (1 layer, 16 wide, bptt 35; the decoder's
output flattened by ``view(-1, ntoken)``) trained at batch 20, evaluated at 20, 10, 7 and 10 again
(two bptt chunks each) and trained at 10 and 7; then the same over one corpus of 1,800 tokens
batchified at each batch (``N // B`` rows). Each row: programs compiled (or loaded from disk),
regions run in buckets, regions split for shape churn, the largest difference from CPU, wall
seconds. Prints a markdown table.
"""
from __future__ import annotations

import argparse
import copy
import os
import sys
import tempfile
import time

os.environ.setdefault("DEFERFUSE_CACHE_DIR", tempfile.mkdtemp(prefix="deferfuse-new-bases-"))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import deferfuse  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from models import TinyGPT, WlmLSTM  # noqa: E402


def train(m, dev, b, steps=4):
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(b)
    out = []
    for _ in range(steps):
        x = torch.randint(0, 40, (b, 12), generator=g).to(dev)
        loss = F.cross_entropy(m(x[:, :-1]).reshape(-1, 40), x[:, 1:].reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
        out.append(loss.item())
    return out


def evaluate(m, dev, b):
    g = torch.Generator().manual_seed(100 + b)
    with torch.no_grad():
        x = torch.randint(0, 40, (b, 12), generator=g).to(dev)
        return [F.cross_entropy(m(x[:, :-1]).reshape(-1, 40), x[:, 1:].reshape(-1)).item()]


def wlm(m, dev, b, train, bptt=35, corpus_len=None):
    """word_language_model's training loop (``clip_grad_norm_``, the manual update) or its
    ``evaluate()`` at batch ``b``, over data batchified to 3 (training) or 2 (evaluation) bptt
    chunks, or (``corpus_len``) over the first 2 chunks of one corpus batchified at ``b``
    (``N // b`` rows, as its ``batchify``): the losses."""
    rows = 3 * bptt + 1 if train else 2 * bptt + 1
    if corpus_len:
        corpus = torch.randint(0, m.ntoken, (corpus_len,), generator=torch.Generator().manual_seed(1))
        corpus = corpus[:corpus_len // b * b]
    else:
        corpus = torch.randint(0, m.ntoken, (rows * b,), generator=torch.Generator().manual_seed(b))
    src = corpus.view(b, -1).t().contiguous().to(dev)
    h, out = m.init_hidden(b), []
    m.train(train)
    for i in range(0, rows - 1 if not corpus_len else 2 * bptt, bptt):
        x, y = src[i:i + bptt], src[i + 1:i + 1 + bptt].reshape(-1)
        h = tuple(v.detach() for v in h)
        with torch.set_grad_enabled(train):
            o, h = m(x, h)
            loss = F.nll_loss(o, y)
        if train:
            m.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(m.parameters(), 0.25)
            for p in m.parameters():
                p.data.add_(p.grad, alpha=-20.0)
        out.append(loss.item())
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=20)
    ap.add_argument("--only", default="", help="run only the phases whose name has this")
    a = ap.parse_args()
    torch.manual_seed(0)
    model = TinyGPT()
    tmodel = copy.deepcopy(model).to("tpu")
    p2 = torch.randint(0, 40, (2, 3), generator=torch.Generator().manual_seed(2))

    def sample(x):
        return lambda m, d: m.eval().sample(x.to(d), a.tokens).flatten().tolist()
    phases = [("train, batch 8", lambda m, d: train(m.train(), d, 8)),
              ("evaluate, batch 8", lambda m, d: evaluate(m, d, 8)),
              ("evaluate, batch 3", lambda m, d: evaluate(m, d, 3)),
              ("evaluate, batch 5", lambda m, d: evaluate(m, d, 5)),
              ("train, batch 3", lambda m, d: train(m.train(), d, 3)),
              ("train, batch 5", lambda m, d: train(m.train(), d, 5)),
              ("sample, batch 1 from 1 token", sample(torch.zeros((1, 1), dtype=torch.long))),
              ("sample, batch 2 from 3 tokens", sample(p2)),
              ("sample, batch 2 from 3 tokens, again", sample(p2))]
    torch.manual_seed(0)
    lstm = WlmLSTM()
    tlstm = copy.deepcopy(lstm).to("tpu")

    def lm(b, train):
        return lambda m, d: wlm(tlstm if d == "tpu" else lstm, d, b, train)
    phases += [(f"wlm LSTM: {'train' if t else 'evaluate'}, batch {b}", lm(b, t))
               for b, t in ((20, True), (20, False), (10, False), (7, False), (10, False),
                            (10, True), (7, True))]
    # one corpus batchified at each batch (N // B rows: NOTE [window bases])
    torch.manual_seed(0)
    lstm2 = WlmLSTM()
    tlstm2 = copy.deepcopy(lstm2).to("tpu")

    def lm2(b, train):
        return lambda m, d: wlm(tlstm2 if d == "tpu" else lstm2, d, b, train, corpus_len=1800)
    phases += [(f"wlm LSTM, one corpus: {'train' if t else 'evaluate'}, batch {b} "
                f"({1800 // b} rows)", lm2(b, t))
               for b, t in ((20, True), (10, False), (7, False), (8, False), (10, False),
                            (10, True), (7, True))]
    phases = [(name, f) for name, f in phases if a.only in name]
    print(f"new bases: {time.strftime('%Y-%m-%dT%H:%M:%S')}, load {os.getloadavg()[0]:.1f}, "
          f"{a.tokens} tokens\n")
    print("| phase | compiles | bucketed runs | shape splits | max diff from CPU | s |")
    print("|---|---:|---:|---:|---:|---:|")
    total = 0
    for name, f in phases:
        want = f(model, "cpu")
        deferfuse.reset_metrics()
        t0 = time.perf_counter()
        got = f(tmodel, "tpu")
        dt = time.perf_counter() - t0
        m = deferfuse.metrics()
        n = m["compiles"] + m["disk_cache_hits"]
        total += n
        diff = max(abs(x - y) for x, y in zip(got, want))
        print(f"| {name} | {n} | {m['bucketed_runs']} | {m['shape_splits']} | {diff:.1e} | "
              f"{dt:.1f} |", flush=True)
    print(f"\ntotal compiles: {total}")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
