"""deferfuse demo: a small MLP and a small transformer train on the tpu device, in strict eager and
in DeferAndFuse, with losses checked against CPU eager PyTorch. Prints what ran and how fast."""
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

import deferfuse


class Block(nn.Module):
    def __init__(self, d=64, heads=4):
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


class TinyGPT(nn.Module):
    def __init__(self, vocab=128, d=64, layers=2, t=32):
        super().__init__()
        self.emb, self.pos = nn.Embedding(vocab, d), nn.Parameter(torch.zeros(t, d))
        self.blocks = nn.Sequential(*[Block(d) for _ in range(layers)])
        self.head = nn.Linear(d, vocab)

    def forward(self, idx):
        return self.head(self.blocks(self.emb(idx) + self.pos[: idx.shape[1]]))


def train(make, batch, device, steps):
    torch.manual_seed(0)
    model = make().to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    x, y = (b.to(device) for b in batch)
    losses, times = [], []
    for _ in range(steps):
        t0 = time.perf_counter()
        opt.zero_grad()
        out = model(x)
        loss = F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))
        loss.backward()
        opt.step()
        losses.append(loss.item())         # a sync point every step
        times.append(time.perf_counter() - t0)
    return losses, times


def main():
    torch.manual_seed(0)
    mlp_batch = (torch.randn(64, 32), torch.randint(0, 10, (64,)))
    gpt_batch = (torch.randint(0, 128, (8, 32)), torch.randint(0, 128, (8, 32)))
    workloads = {
        "mlp": (lambda: nn.Sequential(nn.Linear(32, 128), nn.ReLU(), nn.Linear(128, 10)), mlp_batch),
        "gpt": (TinyGPT, gpt_batch),
    }
    print(f"deferfuse {deferfuse.__version__} on JAX platform '{deferfuse.platform()}'\n")
    steps = 12
    for name, (make, batch) in workloads.items():
        ref, ref_t = train(make, batch, "cpu", steps)
        row = [f"{name}: cpu eager {sorted(ref_t)[steps // 2] * 1e3:7.2f} ms/step"]
        for m in ("strict", "defer"):
            deferfuse.reset_metrics()
            with deferfuse.mode(m):
                got, t = train(make, batch, "tpu", steps)
            err = max(abs(a - b) for a, b in zip(ref, got))
            met = deferfuse.metrics()
            assert err < 1e-3, f"{name} {m}: losses differ from CPU by {err}"
            row.append(f"{m} {sorted(t)[steps // 2] * 1e3:7.2f} ms/step "
                       f"(first step {t[0]:.2f} s, {met['compiles']} compiles, loss diff {err:.1e})")
        print("\n   ".join(row))
        print(f"   losses: {ref[0]:.4f} -> {ref[-1]:.4f}\n")
    print("What the last defer run did:")
    deferfuse.report()


if __name__ == "__main__":
    main()
