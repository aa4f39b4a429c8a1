"""deferfuse demo: a small MLP and a small transformer train on the tpu device, in strict eager and
in DeferAndFuse, with losses checked against CPU eager PyTorch. Prints what ran and how fast."""
import os
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


def trainer(make, batch, device):
    """A training loop's step as a function: zero_grad, forward, loss, backward, AdamW, and the
    loss read with .item() (a sync point every step). Returns (loss, seconds) per call."""
    torch.manual_seed(0)
    model = make().to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    x, y = (b.to(device) for b in batch)

    def step():
        t0 = time.perf_counter()
        opt.zero_grad()
        out = model(x)
        loss = F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))
        loss.backward()
        opt.step()
        value = loss.item()
        return value, time.perf_counter() - t0
    return step


def main():
    torch.manual_seed(0)
    mlp_batch = (torch.randn(64, 32), torch.randint(0, 10, (64,)))
    gpt_batch = (torch.randint(0, 128, (8, 32)), torch.randint(0, 128, (8, 32)))
    workloads = {
        "mlp": (lambda: nn.Sequential(nn.Linear(32, 128), nn.ReLU(), nn.Linear(128, 10)), mlp_batch),
        "gpt": (TinyGPT, gpt_batch),
    }
    print(f"deferfuse {deferfuse.__version__} on JAX platform '{deferfuse.platform()}'")
    load, cores = os.getloadavg()[0], os.cpu_count() or 1
    if load > cores:
        # PyTorch's CPU thread pool slows down most of all when other processes hold the cores
        # (measured: a tiny MLP step 0.4 ms idle, 40+ ms at load 6 on 2 cores).
        print(f"NOTE: this machine is busy (load average {load:.1f} on {cores} cores): CPU eager "
              "times are then far slower than on an idle machine; compare on an idle one.")
    print("Each system trains its own copy of the model from the same weights. After 3 steps "
          "(compiles), they take turns, 3 steps each, 10 rounds, so that all see the same machine; "
          "ms/step is the median.\n")
    # (device, mode): CPU tensors run as usual in any mode.
    systems = {"cpu eager": ("cpu", "strict"), "strict": ("tpu", "strict"), "defer": ("tpu", "defer")}
    for name, (make, batch) in workloads.items():
        steps, losses, times, first, compiles = {}, {}, {}, {}, {}
        for s, (device, mode) in systems.items():
            deferfuse.reset_metrics()
            with deferfuse.mode(mode):
                steps[s] = trainer(make, batch, device)
                warm = [steps[s]() for _ in range(3)]
            losses[s], times[s] = [v for v, _ in warm], []
            first[s], compiles[s] = warm[0][1], deferfuse.metrics()["compiles"]
        for r in range(10):
            for s in (list(systems) if r % 2 == 0 else list(systems)[::-1]):
                with deferfuse.mode(systems[s][1]):
                    for _ in range(3):
                        v, dt = steps[s]()
                        losses[s].append(v)
                        times[s].append(dt)
        ref = losses["cpu eager"]
        med = {s: sorted(t)[len(t) // 2] for s, t in times.items()}
        row = [f"{name}: cpu eager {med['cpu eager'] * 1e3:7.2f} ms/step"]
        for s in ("strict", "defer"):
            err = max(abs(a - b) for a, b in zip(ref, losses[s]))
            assert err < 1e-3, f"{name} {s}: losses differ from CPU by {err}"
            row.append(f"{s:6s} {med[s] * 1e3:7.2f} ms/step (first step {first[s]:.2f} s, "
                       f"{compiles[s]} compiles in 3 steps, loss diff {err:.1e})")
        print("\n   ".join(row))
        print(f"   defer is {med['strict'] / med['defer']:.2f}x faster than strict eager; "
              f"losses {ref[0]:.4f} -> {ref[-1]:.4f} over {len(ref)} steps")
        vs_cpu = med["cpu eager"] / med["defer"]
        print(f"   defer vs plain PyTorch on CPU: " + (
            f"{vs_cpu:.2f}x faster" if vs_cpu >= 1 else
            f"{1 / vs_cpu:.2f}x slower (XLA's CPU backend on a model this small; "
            f"deferfuse pays off on a TPU or GPU)") + "\n")
    deferfuse.reset_metrics()
    with deferfuse.mode("defer"):
        for _ in range(3):
            steps["defer"]()
    print("What defer did in 3 more steps of the gpt workload (steady state: nothing compiles):")
    deferfuse.report()


if __name__ == "__main__":
    main()
