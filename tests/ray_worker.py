"""Ray Train's training loop for tests/test_frameworks.py: plain PyTorch DDP, never importing
deferfuse (the ``tpu`` process group and device come from deferfuse's autoload entry point at
``import torch``). Each rank writes its losses and first weights to ``{out}.{rank}.json``."""
import json

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel


def train_loop(config):
    dev = config["device"]
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(),
                                torch.nn.Linear(16, 1)).to(dev)
    ddp = DistributedDataParallel(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(100 + rank)      # each rank its own batches
    losses = []
    for _ in range(4):
        x, y = torch.randn(16, 8, generator=g), torch.randn(16, 1, generator=g)
        loss = torch.nn.functional.mse_loss(ddp(x.to(dev)), y.to(dev))
        opt.zero_grad()
        loss.backward()
        opt.step()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        losses.append(mean.item() / dist.get_world_size())
    with open(f"{config['out']}.{rank}.json", "w") as f:
        json.dump({"losses": losses, "backend": dist.get_backend(), "device": str(loss.device),
                   "weights": [p.detach().cpu().reshape(-1).tolist() for p in model.parameters()]},
                  f)
