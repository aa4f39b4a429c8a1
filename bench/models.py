"""The small models the benchmarks and the tests share: nanoGPT's shapes, pytorch/examples'
word_language_model and the truncated-BPTT language models. Each is plain PyTorch (nothing of
deferfuse): a bench or a test builds it on CPU, copies it to ``tpu`` and compares.

The tests import this file from ``bench/`` (``util.bench_module("models")``); the benches as
``import models`` (``bench/`` is on their path).
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F


class Block(nn.Module):
    """A pre-norm causal attention block with a GELU MLP."""

    def __init__(self, d, heads):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=-1)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, d))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """A GPT of ``Block``s with learnt positions (a parameter of ``t`` rows)."""

    def __init__(self, vocab, d, layers, heads, t):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.pos = nn.Parameter(torch.randn(t, d) * 0.02)
        self.blocks = nn.Sequential(*[Block(d, heads) for _ in range(layers)])
        self.head = nn.Linear(d, vocab)

    def forward(self, idx):
        return self.head(self.blocks(self.emb(idx) + self.pos[: idx.shape[1]]))


class NanoSampling:
    """nanoGPT's two loops over a model of ``block`` positions, the sequence growing by one token
    a step with ``torch.cat`` and the whole sequence run each step (no KV cache)."""

    @torch.no_grad()
    def generate(self, idx, n):
        """Greedy: the argmax of the last position."""
        for _ in range(n):
            cond = idx if idx.size(1) <= self.block else idx[:, -self.block:]
            nxt = self(cond)[:, -1, :].argmax(-1, keepdim=True)
            idx = torch.cat((idx, nxt), dim=1)
        return idx

    @torch.no_grad()
    def sample(self, idx, n, top_k=1, temperature=None):
        """nanoGPT's sampling loop as written there: the last position by a list index, top-k by a
        boolean-mask write, softmax and multinomial (top_k=1: one token has all the probability).
        Without a ``temperature`` the mask write goes through a view of the model's output."""
        for _ in range(n):
            cond = idx if idx.size(1) <= self.block else idx[:, -self.block:]
            logits = self(cond)[:, [-1], :][:, -1, :]
            if temperature is not None:
                logits = logits / temperature
            v, _ = torch.topk(logits, min(top_k, logits.size(-1)))
            logits[logits < v[:, [-1]]] = -float("Inf")
            nxt = torch.multinomial(F.softmax(logits, dim=-1), num_samples=1)
            idx = torch.cat((idx, nxt), dim=1)
        return idx


class TinyGPT(NanoSampling, nn.Module):
    """nanoGPT's shape at its smallest: token and position embeddings (positions from
    ``arange``), pre-norm causal attention blocks of two heads, no MLP."""

    def __init__(self, vocab=40, d=16, layers=2, block=64):
        super().__init__()
        self.block = block
        self.wte, self.wpe = nn.Embedding(vocab, d), nn.Embedding(block, d)
        self.ln1 = nn.ModuleList(nn.LayerNorm(d) for _ in range(layers))
        self.qkv = nn.ModuleList(nn.Linear(d, 3 * d) for _ in range(layers))
        self.proj = nn.ModuleList(nn.Linear(d, d) for _ in range(layers))
        self.head = nn.Linear(d, vocab, bias=False)

    def forward(self, idx):
        b, t = idx.shape
        x = self.wte(idx) + self.wpe(torch.arange(0, t, dtype=torch.long, device=idx.device))
        for ln, qkv, proj in zip(self.ln1, self.qkv, self.proj):
            q, k, v = qkv(ln(x)).split(x.shape[-1], dim=2)
            q, k, v = (z.view(b, t, 2, -1).transpose(1, 2) for z in (q, k, v))
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            x = x + proj(y.transpose(1, 2).contiguous().view(b, t, -1))
        return self.head(x)


class GrowGPT(NanoSampling, nn.Module):
    """nanoGPT's model: positions from ``arange``, ``Block``s, a final norm and an unbiased head."""

    def __init__(self, vocab=96, d=64, layers=2, heads=4, block=128):
        super().__init__()
        self.block, self.heads = block, heads
        self.wte, self.wpe = nn.Embedding(vocab, d), nn.Embedding(block, d)
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.ln, self.head = nn.LayerNorm(d), nn.Linear(d, vocab, bias=False)

    def forward(self, idx):
        t = idx.shape[1]
        x = self.wte(idx) + self.wpe(torch.arange(0, t, dtype=torch.long, device=idx.device))
        for b in self.blocks:
            x = b(x)
        return self.head(self.ln(x))


class LSTMLM(nn.Module):
    """An embedding, one LSTM layer and a linear decoder: ``(logits, hidden)``."""

    def __init__(self, vocab, d):
        super().__init__()
        self.emb, self.rnn, self.out = nn.Embedding(vocab, d), nn.LSTM(d, d), nn.Linear(d, vocab)

    def forward(self, x, h):
        y, h = self.rnn(self.emb(x), h)
        return self.out(y), h


class TransformerLM(nn.Module):
    """A causal ``nn.TransformerEncoder`` language model (the mask made on the input's device);
    ``h`` passes through, so it drops into an LSTM's loop."""

    def __init__(self, vocab, d, heads=4, ff=None, layers=2):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        layer = nn.TransformerEncoderLayer(d, heads, ff or 2 * d, dropout=0.0)
        self.enc = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.out = nn.Linear(d, vocab)

    def forward(self, x, h):
        n = x.shape[0]
        mask = torch.triu(torch.full((n, n), float("-inf"), device=x.device), 1)
        return self.out(self.enc(self.emb(x), mask=mask)), h


class WlmLSTM(nn.Module):
    """pytorch/examples' word_language_model ``RNNModel`` with its LSTM (dropout 0): the
    decoder's output flattened with ``decoded.view(-1, ntoken)``, merging the batch into the
    time dim."""

    def __init__(self, ntoken=50, d=16):
        super().__init__()
        self.ntoken, self.d = ntoken, d
        self.encoder, self.rnn = nn.Embedding(ntoken, d), nn.LSTM(d, d)
        self.decoder = nn.Linear(d, ntoken)

    def forward(self, x, hidden):
        output, hidden = self.rnn(self.encoder(x), hidden)
        decoded = self.decoder(output).view(-1, self.ntoken)
        return F.log_softmax(decoded, dim=1), hidden

    def init_hidden(self, bsz):
        w = next(self.parameters())
        return (w.new_zeros(1, bsz, self.d), w.new_zeros(1, bsz, self.d))
