"""Ray Train's training loop for tests/test_frameworks.py: plain PyTorch DDP, never importing
deferfuse (the ``tpu`` process group and device come from deferfuse's autoload entry point at
``import torch``). Each rank writes its losses and first weights to ``{out}.{rank}.json``."""
import json

import torch
import torch.distributed as dist


def train_loop(config):
    dev = config["device"]
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    # Ray's get_device() is CPU without a GPU resource: name the device (DDP without device_ids)
    from ray.train.torch import prepare_model
    ddp = prepare_model(model, move_to_device=torch.device(dev))
    model = ddp.module
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
