"""One rank of tests/test_torchrec.py's sharded run: ``python tests/torchrec_worker.py MODE [OPTIM]``
(OPTIM ``sgd``, the default, or ``rowwise_adagrad``) with
torchrun's variables (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT).

A table-wise sharded ``EmbeddingBagCollection`` (3 features over 2 tables, sum and mean pooling,
fused SGD or row-wise Adagrad from ``apply_optimizer_in_backward``) under ``DistributedModelParallel``, twice in this
process from the same weights: on ``tpu`` (the ``tpu`` process group, ``deferfuse.torchrec.plan``)
and on CPU (a gloo group, TorchRec's own planner, FBGEMM's CPU kernels). Three steps on the same
batches; the pooled outputs and the rank's shards after each step must agree within 1e-6. Prints
``RESULT {json}`` and exits 0.
"""
import copy
import json
import logging
import os
import sys
import warnings

import torch
import torch.distributed as dist

import deferfuse

warnings.filterwarnings("ignore")
logging.disable(logging.WARNING)        # the planner's advice on building topologies

from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor, PoolingType  # noqa: E402
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder  # noqa: E402
from torchrec.distributed.model_parallel import DistributedModelParallel  # noqa: E402
from torchrec.distributed.planner import EmbeddingShardingPlanner, Topology  # noqa: E402
from torchrec.distributed.planner.types import ParameterConstraints  # noqa: E402
from torchrec.distributed.types import ShardingEnv, ShardingType  # noqa: E402
from torchrec.optim import RowWiseAdagrad  # noqa: E402
from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward  # noqa: E402

import deferfuse.torchrec  # noqa: E402

KEYS, BATCH, LR, STEPS = ["f0", "f1", "f2"], 3, 0.5, 3
TABLES = [EmbeddingBagConfig(name="t0", embedding_dim=4, num_embeddings=10, feature_names=["f0", "f2"]),
          EmbeddingBagConfig(name="t1", embedding_dim=8, num_embeddings=12, feature_names=["f1"],
                             pooling=PoolingType.MEAN)]
CONSTRAINTS = {t.name: ParameterConstraints(sharding_types=[ShardingType.TABLE_WISE.value])
               for t in TABLES}


def batch(step: int, rank: int) -> KeyedJaggedTensor:
    g = torch.Generator().manual_seed(100 * step + rank)
    lengths = torch.randint(0, 4, (len(KEYS) * BATCH,), generator=g)
    values = torch.randint(0, 10, (int(lengths.sum()),), generator=g)
    return KeyedJaggedTensor.from_lengths_sync(keys=KEYS, values=values, lengths=lengths)


OPTIMS = {"sgd": (torch.optim.SGD, {"lr": LR}),
          "rowwise_adagrad": (RowWiseAdagrad, {"lr": LR, "eps": 1e-3})}


def model(device: str, world: int, init: dict, optim: str, pg=None):
    ebc = EmbeddingBagCollection(tables=TABLES, device=torch.device("meta"))
    cls, kw = OPTIMS[optim]
    apply_optimizer_in_backward(cls, ebc.parameters(), kw)
    sharders = [EmbeddingBagCollectionSharder()]
    if device == "tpu":
        plan = deferfuse.torchrec.plan(ebc, sharders, world, CONSTRAINTS,
                                       local_world_size=int(os.environ.get("LOCAL_WORLD_SIZE", world)))
        m = DistributedModelParallel(ebc, device=torch.device("tpu"), plan=plan)
    else:
        topology = Topology(world_size=world, compute_device="cpu")
        plan = EmbeddingShardingPlanner(topology=topology, constraints=CONSTRAINTS).plan(ebc, sharders)
        m = DistributedModelParallel(ebc, device=torch.device("cpu"), plan=plan,
                                     env=ShardingEnv.from_process_group(pg))
    with torch.no_grad():
        for key, st in m.state_dict().items():
            for shard in st.local_shards():
                o = shard.metadata.shard_offsets
                s = shard.metadata.shard_sizes
                shard.tensor.copy_(init[key][o[0]:o[0] + s[0], o[1]:o[1] + s[1]])
    return m


def shards(m) -> dict:
    return {k: [s.tensor.detach().cpu() for s in v.local_shards()] for k, v in m.state_dict().items()}


def main(mode: str, optim: str):
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("tpu", rank=rank, world_size=world)
    gloo = dist.new_group(backend="gloo")
    torch.manual_seed(0)
    init = {f"embedding_bags.{t.name}.weight": torch.randn(t.num_embeddings, t.embedding_dim)
            for t in TABLES}
    deferfuse.reset_metrics()
    worst = 0.0
    with deferfuse.mode(mode):
        m_tpu, m_cpu = model("tpu", world, init, optim), model("cpu", world, init, optim, gloo)
        for step in range(STEPS):
            k = batch(step, rank)
            g = torch.Generator().manual_seed(7 + step)
            outs = []
            for m, dev in ((m_tpu, "tpu"), (m_cpu, "cpu")):
                out = m(copy.copy(k).to(dev))
                out = out.wait() if hasattr(out, "wait") else out
                w = torch.randn(out.values().shape, generator=g).to(dev)
                (out.values() * w).sum().backward()
                outs.append(out.values().detach().cpu())
                g = torch.Generator().manual_seed(7 + step)
            assert outs[0].device.type == "cpu" and outs[0].shape == outs[1].shape
            torch.testing.assert_close(outs[0], outs[1], atol=1e-6, rtol=0)
            worst = max(worst, (outs[0] - outs[1]).abs().max().item())
            st, sc = shards(m_tpu), shards(m_cpu)
            assert st.keys() == sc.keys()
            for key in sc:
                for a, b in zip(st[key], sc[key]):
                    torch.testing.assert_close(a, b, atol=1e-6, rtol=0, msg=f"step {step} {key}")
                    worst = max(worst, (a - b).abs().max().item())
        deferfuse.sync()
    fallbacks = dict(deferfuse.metrics()["cpu_fallbacks"])
    assert fallbacks == {}, fallbacks
    n_shards = sum(len(v) for v in shards(m_tpu).values())
    print("RESULT " + json.dumps({"rank": rank, "worst": worst, "shards": n_shards}), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else "sgd")
