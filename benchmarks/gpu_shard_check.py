#!/usr/bin/env python3
"""GPU check of what the TorchRec path hands TorchRec (issue 44, GPU path v3).

On a GPU TorchRec places a ``fused_uvm_caching`` shard on ``rank:r/cuda:r`` and checks that
every tensor it builds a ``ShardedTensor`` over is there (the fused optimizer, ``state_dict``,
the sharded module's ``_initialize_torch_state``, DCP). The proactive kernel hands it CUDA
views of its host tier (FBGEMM's host-mapped rows and the host-mapped optimizer state: the
same bytes the store reads through CPU aliases). ``tests/test_device_shard_placement.py``
checks that on fake CUDA tensors; this runs the real thing - TorchRec, FBGEMM, DMP - on one
GPU, one rank (about a minute), and reports:

1. ``sharded``: DMP built the model (the fused optimizer's shard check passed);
2. ``placements_ok``: every local shard of ``state_dict()`` and of the fused optimizer's
   ``state_dict()`` is on its placement's device, and so is each registered
   ``embedding_bags[t].weight``;
3. ``views_equal_store``: after a few training steps each table's ``state_dict()`` weight
   and optimizer state equal the store's host tier (read through the CPU alias, after a
   flush): the views are the trained table;
4. ``write_lands``: a row written through a ``state_dict()`` shard is in the store's host
   tier at once (same bytes) and is what the next lookup pools (the cache took it);
5. ``dcp_round_trip``: ``dcp.save`` of ``state_dict()``, the table zeroed in place, then
   ``dcp.load`` into ``state_dict()`` gives back the saved weights, as the next lookup reads.

``--device cpu`` runs the same steps on CPU (placements ``cpu``: a dry run of the script).
Run from the repository root:  python benchmarks/gpu_shard_check.py [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from typing import Any, Dict, List

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

ROWS, DIM, BATCH = 2000, 16, 64


def _kjt(names: List[str], ids: List[torch.Tensor], device: torch.device) -> Any:
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    values = torch.cat(ids)
    lengths = torch.ones(values.numel(), dtype=torch.int64)
    return KeyedJaggedTensor.from_lengths_sync(names, values.to(device), lengths.to(device))


def _local(value: Any) -> List[torch.Tensor]:
    return [s.tensor for s in value.local_shards()] if hasattr(value, "local_shards") else [value]


def _placed(value: Any) -> List[List[str]]:
    return [[str(s.metadata.placement.device()), str(s.tensor.device)] for s in value.local_shards()]


def run(device: torch.device) -> Dict[str, Any]:
    import torch.distributed.checkpoint as dcp
    from torchrec import EmbeddingBagCollection, EmbeddingBagConfig

    from torchrec_proactive.integration.sharder import ProactiveEmbeddingBagCollectionSharder
    from torchrec_proactive.planning import build_plan, shard_model

    if not dist.is_initialized():
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", rank=0, world_size=1,
                                store=dist.HashStore())
    if device.type == "cuda":
        torch.cuda.set_device(device)
    torch.manual_seed(0)
    names = ["f0", "f1"]
    tables = [EmbeddingBagConfig(name=f"t{i}", embedding_dim=DIM, num_embeddings=ROWS, feature_names=[f])
              for i, f in enumerate(names)]
    ebc = EmbeddingBagCollection(tables=tables, device=torch.device("meta"))
    sharder = ProactiveEmbeddingBagCollectionSharder(fused_params={"optimizer": "adam", "learning_rate": 0.01})
    plan = build_plan(ebc, sharder, "table_wise", device_type=device.type, world_size=1, local_size=1,
                      cache_load_factor=0.1)
    res: Dict[str, Any] = {"device": str(device)}
    try:
        dmp = shard_model(ebc, sharder, plan, device)
    except Exception as e:  # (the check this script is for: report it, do not hide it)
        res.update(sharded=False, error=f"{type(e).__name__}: {e}"[:2000])
        return res
    res["sharded"] = True
    sharded = dmp.module
    kernels = sharded.proactive_kernels
    res["kernels"] = len(kernels)

    def placements() -> Dict[str, Any]:
        out = {k: _placed(v) for k, v in dmp.state_dict().items() if hasattr(v, "local_shards")}
        for t, per in dmp.fused_optimizer.state_dict()["state"].items():
            out.update({f"optim {t} {k}": _placed(v) for k, v in per.items() if hasattr(v, "local_shards")})
        want = torch.device(device.type, torch.cuda.current_device()) if device.type == "cuda" else device
        out.update({f"embedding_bags.{t.name}.weight": [[str(want), str(sharded.embedding_bags[t.name].weight.device)]]
                    for t in tables})
        return out

    placed = placements()
    res["placements"] = placed
    res["placements_ok"] = bool(placed) and all(a == b for pairs in placed.values() for a, b in pairs)

    # Train a few steps (the fused update runs in backward).
    g = torch.Generator().manual_seed(1)
    for _ in range(5):
        ids = [torch.randint(0, ROWS, (BATCH,), generator=g) for _ in names]
        dmp(_kjt(names, ids, device)).values().pow(2).sum().backward()

    # The views TorchRec holds are the trained table: equal to the store's host tier (weights
    # and each optimizer state, under TorchRec's names: momentum1, then FBGEMM's).
    from torchrec_proactive.integration.embedding_kernel import _FBGEMM_STATE_NAMES

    sd = dmp.state_dict()
    osd = dmp.fused_optimizer.state_dict()["state"]
    diffs: Dict[str, float] = {}
    for kernel in kernels:
        kernel.flush()
        store = kernel.store
        names_of = _FBGEMM_STATE_NAMES[kernel.optimizer_config.optim]
        for seg in store.segments:
            rows = slice(seg.start, seg.start + seg.num_rows)
            key = f"embedding_bags.{seg.name}.weight"
            view = torch.cat([t.detach().cpu() for t in _local(sd[key])])
            diffs[key] = float((view - store.host_weight[rows]).abs().max())
            for i, (fbgemm, ours) in enumerate(names_of):
                name = f"{seg.name}.{'momentum1' if i == 0 else fbgemm}"
                mine = torch.cat([t.detach().cpu() for t in _local(osd[key][name])])
                diffs[name] = float((mine.reshape(seg.num_rows, -1)
                                     - store.host_state[ours][rows].reshape(seg.num_rows, -1)).abs().max())
    res["views_vs_store_max_diff"] = diffs
    res["views_equal_store"] = len(diffs) == len(tables) * 3 and max(diffs.values()) == 0.0

    # A row written through a state_dict shard: in the store's host tier at once, and pooled next.
    key = next(k for k in sd if k.endswith("t0.weight"))
    shard = _local(sd[key])[0]
    with torch.no_grad():
        shard[7].fill_(3.25)
    kernel0 = next(k for k in kernels if "t0" in k.table_names())
    seg0 = next(s for s in kernel0.store.segments if s.name == "t0")
    in_host = bool((kernel0.store.host_weight[seg0.start + 7] == 3.25).all())
    dmp.eval()
    with torch.no_grad():
        pooled = dmp(_kjt(names, [torch.tensor([7]), torch.tensor([0])], device)).to_dict()["f0"]
    dmp.train()
    res["write_in_host_tier"] = in_host
    res["write_lands"] = in_host and bool((pooled.cpu() == 3.25).all())

    # DCP: save, zero the table in place, load into the state_dict's own tensors.
    with tempfile.TemporaryDirectory() as tmp:
        saved = {k: torch.cat([t.detach().cpu() for t in _local(v)]) for k, v in dmp.state_dict().items()}
        dcp.save(dmp.state_dict(), checkpoint_id=tmp)
        for name, p in dmp.named_parameters():
            if name.endswith("t0.weight"):
                with torch.no_grad():
                    p.zero_()
        state = dmp.state_dict()
        dcp.load(state, checkpoint_id=tmp)
        back = {k: torch.cat([t.detach().cpu() for t in _local(v)]) for k, v in dmp.state_dict().items()}
        dmp.eval()
        with torch.no_grad():
            pooled = dmp(_kjt(names, [torch.tensor([7]), torch.tensor([0])], device)).to_dict()["f0"]
        dmp.train()
    res["dcp_round_trip"] = all(torch.equal(saved[k], back[k]) for k in saved) and bool((pooled.cpu() == 3.25).all())
    return res


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda" if torch.cuda.is_available() else "cpu",
                   help="where to run (default: cuda when available, else cpu: a dry run)")
    p.add_argument("--json", default=None, metavar="PATH", help="write the results here (default: none)")
    args = p.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("argument --device: 'cuda' needs a CUDA device (use --device cpu for the dry run)")
    res = run(torch.device("cuda", 0) if args.device == "cuda" else torch.device("cpu"))
    print(json.dumps(res, indent=1, default=str))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=2, default=str)
    keys = ("sharded", "placements_ok", "views_equal_store", "write_lands", "dcp_round_trip")
    return 0 if all(res.get(k) for k in keys) else 1


if __name__ == "__main__":
    sys.exit(main())
