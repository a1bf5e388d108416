#!/usr/bin/env python3
"""A DLRM trainer written the way TorchRec's examples write one; ``--proactive`` swaps in the plugin.

    python examples/torchrec_style/train.py --nproc 2                       # stock TorchRec
    python examples/torchrec_style/train.py --nproc 2 --proactive           # torchrec-proactive
    torchrun --nproc_per_node 2 examples/torchrec_style/train.py --proactive

Planner + ``ParameterConstraints`` + ``DistributedModelParallel`` + ``TrainPipelineSparseDist``,
periodic eval through ``pipeline.detach()`` and plain forwards, a ``torch.distributed.checkpoint``
at the end (``--resume DIR`` continues from one, stock or proactive, read with
``torchrec_proactive.checkpoint.load_checkpoint``: stock ``dcp.load`` unpickles ``.metadata``
as it is, so a crafted checkpoint could run code). Switching to the plugin
is the two lines marked ``# <- the plugin``. The constraint asks for ``fused_uvm_caching``
(the host tier + device cache) with the plugin; stock TorchRec has no UVM cache on CPU, so
there the same constraint names ``fused`` - that is the plan, not the code.
"""

from __future__ import annotations

import argparse
import json
import os
from typing import Iterator, List

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp
from fbgemm_gpu.split_embedding_configs import EmbOptimType
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor
from torchrec.datasets.utils import Batch
from torchrec.distributed import DistributedModelParallel
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
from torchrec.distributed.planner import EmbeddingShardingPlanner, ParameterConstraints, Topology
from torchrec.distributed.train_pipeline import TrainPipelineSparseDist
from torchrec.distributed.types import CacheParams
from torchrec.models.dlrm import DLRM, DLRMTrain
from torchrec.modules.embedding_configs import PoolingType
from torchrec.optim.keyed import CombinedOptimizer, KeyedOptimizerWrapper
from torchrec.optim.optimizers import in_backward_optimizer_filter

from torchrec_proactive.checkpoint import load_checkpoint

DENSE_IN, DIM = 8, 16


def tables() -> List[EmbeddingBagConfig]:
    return [
        EmbeddingBagConfig(name="user", embedding_dim=DIM, num_embeddings=2000, feature_names=["user", "friend"]),
        EmbeddingBagConfig(name="item", embedding_dim=DIM, num_embeddings=3000, feature_names=["item"]),
        EmbeddingBagConfig(name="cat", embedding_dim=DIM, num_embeddings=300, feature_names=["cat"],
                           pooling=PoolingType.MEAN),
    ]


def batches(rank: int, n: int, batch_size: int, seed: int) -> Iterator[Batch]:
    """Synthetic, skewed, reproducible per rank (a real job reads Criteo here)."""
    g = torch.Generator().manual_seed(seed * 1000 + rank)
    limits = {f: t.num_embeddings for t in tables() for f in t.feature_names}
    for _ in range(n):
        lengths = torch.randint(1, 4, (len(limits) * batch_size,), generator=g)
        ids = [((torch.rand(int(lengths[i * batch_size:(i + 1) * batch_size].sum()), generator=g) ** 3) * rows).long()
               for i, rows in enumerate(limits.values())]
        dense = torch.randn(batch_size, DENSE_IN, generator=g)
        labels = (dense[:, 0] + 0.1 * torch.randn(batch_size, generator=g) > 0).float()
        kjt = KeyedJaggedTensor.from_lengths_sync(keys=list(limits), values=torch.cat(ids), lengths=lengths)
        yield Batch(dense_features=dense, sparse_features=kjt, labels=labels)


def main(rank: int, world_size: int, args: argparse.Namespace) -> None:
    if not dist.is_initialized():
        dist.init_process_group("gloo", rank=rank, world_size=world_size)
    torch.manual_seed(0)
    device = torch.device("cpu")
    model = DLRMTrain(DLRM(
        embedding_bag_collection=EmbeddingBagCollection(tables=tables(), device=torch.device("meta")),
        dense_in_features=DENSE_IN, dense_arch_layer_sizes=[16, DIM], over_arch_layer_sizes=[16, 1],
    ))
    fused_params = {"optimizer": EmbOptimType.EXACT_ROWWISE_ADAGRAD, "learning_rate": 0.05, "eps": 1e-8}
    kernel = "fused_uvm_caching" if args.proactive else "fused"
    constraints = {t.name: ParameterConstraints(compute_kernels=[kernel],
                                                cache_params=CacheParams(load_factor=args.cache_load_factor))
                   for t in tables()}
    if args.proactive:
        from torchrec_proactive import ProactiveEmbeddingBagCollectionSharder, ProactiveTrainPipeline
        sharder = ProactiveEmbeddingBagCollectionSharder(fused_params=fused_params)  # <- the plugin
    else:
        sharder = EmbeddingBagCollectionSharder(fused_params=fused_params)
    planner = EmbeddingShardingPlanner(topology=Topology(world_size=world_size, compute_device="cpu"),
                                       constraints=constraints)
    plan = planner.collective_plan(model, [sharder], dist.GroupMember.WORLD)
    model = DistributedModelParallel(module=model, device=device, plan=plan, sharders=[sharder])
    dense = KeyedOptimizerWrapper(dict(in_backward_optimizer_filter(model.named_parameters())),
                                  lambda params: torch.optim.Adagrad(params, lr=0.05))
    optimizer = CombinedOptimizer([model.fused_optimizer, dense])
    step0 = 0
    if args.resume:
        state = {"model": model.state_dict(), "optim": optimizer.state_dict()}
        load_checkpoint(state, args.resume)  # dcp.load, with .metadata read safely and confined
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optim"])
        step0 = json.load(open(os.path.join(args.resume, "step.json")))["step"]
        optimizer.set_optimizer_step(step0)  # FBGEMM's convention: the step is not in the state

    def make_pipeline():
        if args.proactive:
            return ProactiveTrainPipeline(model, optimizer, device, prefetch_depth=args.prefetch_depth)  # <- the plugin
        return TrainPipelineSparseDist(model, optimizer, device)

    losses, evals = [], []
    train_iter = batches(rank, args.steps, args.batch_size, seed=1 + step0)
    done = False
    pipeline = make_pipeline()
    while not done:
        model.train()
        if args.pipeline_per_round:  # some jobs build a new pipeline per epoch: batches in flight are dropped
            pipeline = make_pipeline()
        for _ in range(args.eval_every):  # progress() re-attaches a detached pipeline
            try:
                loss, _logits, _labels = pipeline.progress(train_iter)  # DLRMTrain: (loss, logits, labels)
            except StopIteration:
                done = True
                break
            losses.append(float(loss.detach()))
        pipeline.detach()  # back to plain forwards for eval, as TorchRec users do
        model.eval()
        with torch.no_grad():
            eval_loss = [float(model(b)[0]) for b in batches(rank, 2, args.batch_size, seed=999)]
        evals.append(sum(eval_loss) / len(eval_loss))
    ckpt = os.path.join(args.out, "checkpoint")
    dcp.save({"model": model.state_dict(), "optim": optimizer.state_dict()}, checkpoint_id=ckpt)
    if rank == 0:
        json.dump({"step": step0 + len(losses)}, open(os.path.join(ckpt, "step.json"), "w"))
    # This rank's shards with their place in the global table, so that runs whose plans differ
    # (stock and proactive planners may shard a table differently) compare as whole tables.
    local = {
        k: {"size": tuple(v.size()),
            "shards": [(tuple(s.metadata.shard_offsets), s.tensor.detach().clone()) for s in v.local_shards()]}
        if hasattr(v, "local_shards") else v.detach().clone()
        for k, v in model.state_dict().items()
    }
    torch.save({"losses": losses, "evals": evals, "params": local}, os.path.join(args.out, f"rank{rank}.pt"))
    if rank == 0:
        print(json.dumps({"proactive": args.proactive, "steps": len(losses), "final_loss": losses[-1],
                          "eval_loss": evals[-1], "checkpoint": ckpt}))
    dist.barrier()
    dist.destroy_process_group()


def parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--proactive", action="store_true", help="use torchrec-proactive (the two marked lines)")
    p.add_argument("--prefetch-depth", type=int, default=2, help="batches fetched ahead (with --proactive)")
    p.add_argument("--cache-load-factor", type=float, default=0.05, help="device cache, fraction of rows")
    p.add_argument("--steps", type=int, default=40, help="training batches per rank")
    p.add_argument("--eval-every", type=int, default=20, help="training steps between evals")
    p.add_argument("--batch-size", type=int, default=64, help="samples per rank per step")
    p.add_argument("--nproc", type=int, default=2, help="local ranks to spawn when not under torchrun")
    p.add_argument("--resume", default=None, help="a checkpoint directory to continue from")
    p.add_argument("--pipeline-per-round", action="store_true", help="a new pipeline after every eval")
    p.add_argument("--out", default="outputs/torchrec_style", help="where the checkpoint and results go")
    return p.parse_args(argv)


if __name__ == "__main__":
    args = parse()
    os.makedirs(args.out, exist_ok=True)
    torch.set_num_threads(1)
    if "WORLD_SIZE" in os.environ:  # torchrun
        main(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), args)
    else:
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 1000))
        mp.spawn(main, args=(args.nproc, args), nprocs=args.nproc, join=True)
