"""One rank of tests/test_torchrec.py's sharded run: ``python tests/torchrec_worker.py MODE [OPTIM
[MODEL]]`` (OPTIM ``sgd``, the default, or ``rowwise_adagrad``; MODEL ``ebc``, the default, or
``dlrm``: the tables under a DLRM whose dense part DistributedModelParallel wraps in DDP) with
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
from torchrec.distributed.model_parallel import DefaultDataParallelWrapper  # noqa: E402
from torchrec.models.dlrm import DLRM  # noqa: E402
from torchrec.optim.keyed import KeyedOptimizerWrapper  # noqa: E402
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
if len(sys.argv) > 3 and sys.argv[3] == "dlrm":     # DLRM's tables share one width
    TABLES[0] = EmbeddingBagConfig(name="t0", embedding_dim=8, num_embeddings=10,
                                   feature_names=["f0", "f2"])
CONSTRAINTS = {t.name: ParameterConstraints(sharding_types=[ShardingType.TABLE_WISE.value])
               for t in TABLES}


def batch(step: int, rank: int) -> KeyedJaggedTensor:
    g = torch.Generator().manual_seed(100 * step + rank)
    lengths = torch.randint(0, 4, (len(KEYS) * BATCH,), generator=g)
    values = torch.randint(0, 10, (int(lengths.sum()),), generator=g)
    return KeyedJaggedTensor.from_lengths_sync(keys=KEYS, values=values, lengths=lengths)


OPTIMS = {"sgd": (torch.optim.SGD, {"lr": LR}),
          "rowwise_adagrad": (RowWiseAdagrad, {"lr": LR, "eps": 1e-3})}


def model(device: str, world: int, init: dict, optim: str, dlrm: bool, pg=None):
    ebc = EmbeddingBagCollection(tables=TABLES, device=torch.device("meta"))
    cls, kw = OPTIMS[optim]
    apply_optimizer_in_backward(cls, ebc.parameters(), dict(kw))   # it writes into the dict
    m = ebc
    if dlrm:
        torch.manual_seed(1)        # the same dense weights on every rank
        m = DLRM(embedding_bag_collection=ebc, dense_in_features=5, dense_arch_layer_sizes=[16, 8],
                 over_arch_layer_sizes=[8, 1], dense_device=torch.device(device))
    sharders = [EmbeddingBagCollectionSharder()]
    # DistributedModelParallel's own data-parallel wrapper: DDP with static_graph=True, whose first
    # backward stages a map in pinned memory (NOTE [pinned memory] in deferfuse/_tpu_hooks.cpp).
    wrapper = DefaultDataParallelWrapper()
    if device == "tpu":
        plan = deferfuse.torchrec.plan(m, sharders, world, CONSTRAINTS,
                                       local_world_size=int(os.environ.get("LOCAL_WORLD_SIZE", world)))
        m = DistributedModelParallel(m, device=torch.device("tpu"), plan=plan,
                                     data_parallel_wrapper=wrapper)
    else:
        topology = Topology(world_size=world, compute_device="cpu")
        plan = EmbeddingShardingPlanner(topology=topology, constraints=CONSTRAINTS).plan(m, sharders)
        m = DistributedModelParallel(m, device=torch.device("cpu"), plan=plan,
                                     env=ShardingEnv.from_process_group(pg),
                                     data_parallel_wrapper=wrapper)
    with torch.no_grad():
        for key, st in m.state_dict().items():
            name = key[key.index("embedding_bags."):] if "embedding_bags." in key else None
            if name is None:
                continue
            for shard in st.local_shards():
                o = shard.metadata.shard_offsets
                s = shard.metadata.shard_sizes
                shard.tensor.copy_(init[name][o[0]:o[0] + s[0], o[1]:o[1] + s[1]])
    return m


def shards(m) -> dict:
    """The rank's shards and the dense (replicated) weights, on CPU."""
    return {k: [s.tensor.detach().cpu() for s in v.local_shards()] if hasattr(v, "local_shards")
            else [v.detach().cpu()] for k, v in m.state_dict().items()}


def main(mode: str, optim: str, dlrm: bool):
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("tpu", rank=rank, world_size=world)
    gloo = dist.new_group(backend="gloo")
    torch.manual_seed(0)
    init = {f"embedding_bags.{t.name}.weight": torch.randn(t.num_embeddings, t.embedding_dim)
            for t in TABLES}
    deferfuse.reset_metrics()
    worst = 0.0
    losses = []
    with deferfuse.mode(mode):
        m_tpu, m_cpu = model("tpu", world, init, optim, dlrm), model("cpu", world, init, optim, dlrm, gloo)
        with torch.no_grad():       # the dense weights: CPU's (tpu's generator draws others)
            dense = m_cpu.state_dict()
            for key, v in m_tpu.state_dict().items():
                if not hasattr(v, "local_shards"):
                    v.copy_(dense[key])
        opts = [KeyedOptimizerWrapper(dict(m.named_parameters()), lambda p: torch.optim.SGD(p, lr=LR))
                for m in (m_tpu, m_cpu)] if dlrm else [None, None]
        for step in range(STEPS):
            k = batch(step, rank)
            g = torch.Generator().manual_seed(7 + 100 * step + rank)
            x, y = torch.randn(BATCH, 5, generator=g), torch.rand(BATCH, 1, generator=g)
            w = torch.randn(BATCH, sum(t.embedding_dim * len(t.feature_names) for t in TABLES),
                            generator=g)
            outs = []
            for m, dev, opt in ((m_tpu, "tpu", opts[0]), (m_cpu, "cpu", opts[1])):
                kk = copy.copy(k).to(dev)
                if dlrm:
                    out = torch.nn.functional.binary_cross_entropy_with_logits(
                        m(x.to(dev), kk), y.to(dev))
                    opt.zero_grad()
                    out.backward()
                    opt.step()
                    outs.append(out.detach().cpu())
                    continue
                out = m(kk)
                out = out.wait() if hasattr(out, "wait") else out
                (out.values() * w.to(dev)).sum().backward()
                outs.append(out.values().detach().cpu())
            assert outs[0].shape == outs[1].shape
            if dlrm:
                torch.testing.assert_close(outs[0], outs[1], atol=0, rtol=1e-5)
                losses.append([outs[0].item(), outs[1].item()])
            else:
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
    n_shards = sum(len(v) for k, v in shards(m_tpu).items() if "embedding_bags." in k)
    print("RESULT " + json.dumps({"rank": rank, "worst": worst, "shards": n_shards,
                                  "losses": losses}), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else "sgd",
         len(sys.argv) > 3 and sys.argv[3] == "dlrm")
