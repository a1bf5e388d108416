"""``compare``: reactive (depth 0) vs. proactive (depth k) on the same data, model and caches.

Both runs start from the same seed, train the same steps on the same batches with the
same cache sizes (sized for depth k), and differ only in when cold rows are fetched. On
CPU the host-to-device link is emulated (``link=emulated``), so the table says so. The
final parameters are compared too: proactive fetching must not change a single bit.
Each rank holds both models; segments of the two runs alternate.
"""

from __future__ import annotations

import hashlib
from dataclasses import replace
from pathlib import Path
from typing import Any, Dict, List

import torch
import torch.distributed as dist

from ..config.schema import Config, PrefetchConfig
from .train import build_run, describe_link, format_steady


def state_digest(model: torch.nn.Module) -> str:
    """Hash of every local tensor in ``model.state_dict()`` (local shards of sharded ones)."""
    h = hashlib.sha256()
    for key, value in sorted(model.state_dict().items()):
        tensors = [s.tensor for s in value.local_shards()] if hasattr(value, "local_shards") else [value]
        for t in tensors:
            h.update(key.encode())
            h.update(t.detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()


INTERLEAVE_STEPS = 10


def run_compare(cfg: Config) -> Dict[str, Any]:
    """Trains both modes side by side, alternating segments of ``INTERLEAVE_STEPS`` steps,
    so that both see the same background load on a shared machine; each is timed only
    while its own steps run."""
    depth = cfg.prefetch.depth if cfg.prefetch.mode == "fixed" else 2
    # both arms' caches are sized for one depth: the proactive arm's (or cache.sized_for_depth)
    cache_depth = max(depth, cfg.cache.sized_for_depth or 0)
    modes = (("reactive", PrefetchConfig(mode="off", depth=0)), ("proactive", PrefetchConfig(mode="fixed", depth=depth)))
    trainers = []
    for label, prefetch in modes:
        train = replace(cfg.train, output_dir=str(Path(cfg.train.output_dir) / label), save_checkpoints=False,
                        resume=False)
        # one config line for the comparison: the two runs differ only in prefetch.*
        trainers.append(build_run(replace(cfg, prefetch=prefetch, train=train), cache_depth=cache_depth,
                                  log_config=not trainers))
    trainers[0].log.info("compare: reactive (prefetch off, depth 0) and proactive (depth %d) side by side on the "
                         "data and caches above", depth)
    for t in trainers:
        t.start()
    total = trainers[0].total
    for until in range(INTERLEAVE_STEPS, total + INTERLEAVE_STEPS, INTERLEAVE_STEPS):
        for t in trainers:
            t.run(until)
    rows: List[Dict[str, Any]] = []
    digests: List[str] = []
    for (label, prefetch), t in zip(modes, trainers):
        summary = t.finish()
        steady = dict(summary.steady)
        steady["measured_steps"] = steady.pop("steps", 0)
        rows.append({"mode": label, "depth": prefetch.depth, "steps": summary.steps, **steady,
                     "loss": summary.train_loss})
        digests.append(state_digest(t.dmp))
        t.log.info("%s (depth %d): %d steps, loss %.4f, %s", label, prefetch.depth, summary.steps,
                   summary.train_loss, format_steady(summary.steady))
    same = torch.tensor([int(digests[0] == digests[1])])
    dist.all_reduce(same, op=dist.ReduceOp.MIN)
    return {"rows": rows, "identical_parameters": bool(same.item()), "link": describe_link(cfg),
            "world_size": dist.get_world_size(), "batch_size": cfg.train.batch_size,
            "interleave_steps": INTERLEAVE_STEPS}


def format_table(result: Dict[str, Any]) -> str:
    """The comparison as the aligned text table the CLI prints."""
    rows = result["rows"]
    head = (f"{'mode':<10} {'depth':>5} {'samples/s':>11} {'ms/step':>9} {'stall ms/step':>14} {'hit rate':>9} "
            f"{'MB/step/rank':>13}")
    lines = [
        f"host-to-device link: {result['link']}",
        f"{result['world_size']} rank(s) x batch {result['batch_size']}, {rows[0]['steps']} steps each, "
        f"interleaved every {result['interleave_steps']} steps; timed over the last {rows[0]['measured_steps']}",
        head, "-" * len(head),
    ]
    for r in rows:
        lines.append(f"{r['mode']:<10} {r['depth']:>5} {r['samples_per_s']:>11.0f} {r['step_ms']:>9.2f} "
                     f"{r['stall_ms_per_step']:>14.2f} {r['hit_rate']:>9.3f} {r['mb_moved_per_step']:>13.3f}")
    speedup = rows[1]["samples_per_s"] / max(rows[0]["samples_per_s"], 1e-9)
    lines.append(f"speedup (proactive / reactive samples/s): {speedup:.2f}x")
    lines.append(f"final parameters bit-identical: {'yes' if result['identical_parameters'] else 'NO'}")
    return "\n".join(lines)
