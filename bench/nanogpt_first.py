"""nanoGPT's own ``model.py``, unmodified: the first ``generate`` call in a fresh process, and in a
second process on the warm cache folder (issue 33's goals: under 3 s and under 0.5 s).

    python bench/nanogpt_first.py PATH/TO/nanoGPT/model.py [--rounds 2]

``model.py`` is not vendored: take it from a checkout of github.com/karpathy/nanoGPT. Each round
makes an empty cache folder, runs one process (call 1: compiles included; call 2: identical) and a
second process on that folder. Every call's tokens are compared with CPU eager's from the same
seeded model. Wall seconds are printed, with programs compiled and whether ``torch._dynamo`` was
imported; the machine's load average is printed with them (a shared machine moves the seconds).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

CHILD = r"""
import json, sys, time
sys.path.insert(0, sys.argv[1])
import torch, deferfuse
from model import GPT, GPTConfig
torch.manual_seed(0)
m = GPT(GPTConfig(n_layer=2, n_head=2, n_embd=64, block_size=64, vocab_size=256, dropout=0.0)).eval()
ref = m.generate(torch.zeros((1, 1), dtype=torch.long), 50, top_k=1)
m = m.to("tpu")
calls = []
for _ in range(2):
    before = deferfuse.metrics().get("compiles", 0)
    t = time.perf_counter()
    out = m.generate(torch.zeros((1, 1), dtype=torch.long, device="tpu"), 50, top_k=1).cpu()
    calls.append(dict(seconds=time.perf_counter() - t, equal=bool(torch.equal(out, ref)),
                      compiles=deferfuse.metrics().get("compiles", 0) - before))
print("NANOGPT " + json.dumps(dict(calls=calls, dynamo="torch._dynamo" in sys.modules)))
"""


def one(folder: str, cache: str) -> dict:
    env = dict(os.environ, DEFERFUSE_CACHE_DIR=cache)
    r = subprocess.run([sys.executable, "-c", CHILD, folder], env=env, capture_output=True, text=True)
    for line in r.stdout.splitlines():
        if line.startswith("NANOGPT "):
            return json.loads(line[len("NANOGPT "):])
    raise RuntimeError(f"the child failed:\n{r.stderr[-3000:]}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("model_py", help="nanoGPT's model.py")
    p.add_argument("--rounds", type=int, default=2)
    a = p.parse_args()
    folder = os.path.dirname(os.path.abspath(a.model_py))
    for k in range(a.rounds):
        with tempfile.TemporaryDirectory() as cache:
            load = os.getloadavg()[0]
            first, second = one(folder, cache), one(folder, cache)
        c1, c2, s1 = first["calls"][0], first["calls"][1], second["calls"][0]
        print(f"round {k + 1} (load {load:.1f}): first call {c1['seconds']:.2f} s ({c1['compiles']} "
              f"compiled), second call {c2['seconds']:.2f} s ({c2['compiles']}), second process "
              f"{s1['seconds']:.2f} s ({s1['compiles']}); tokens equal CPU's: "
              f"{all(c['equal'] for c in (c1, c2, s1))}; torch._dynamo imported: "
              f"{first['dynamo'] or second['dynamo']}")


if __name__ == "__main__":
    main()
