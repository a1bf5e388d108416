"""``compare``: reactive (depth 0) vs. proactive (depth k) on the same data, model and caches.

Both runs start from the same seed, train the same steps on the same batches with the
same cache sizes (sized for depth k), and differ only in when cold rows are fetched. On
CPU the host-to-device link is emulated (``link=emulated``), so the table says so. The
final parameters are compared too: proactive fetching must not change a single bit.

Each rank holds both models. After a warm-up (the steps before the steady-state window:
lazy initialisation, cold caches), the two runs alternate in *rounds* of about
``INTERLEAVE_STEPS`` steps, each round running both back to back (which goes first
alternates), so both see the same background load; each is timed only while its own steps
run. The speed-up is the ratio of the two rates over the rounds' steps, and it is judged
the way the bench judges its ratios (``bench/noise.py``): the 95% t-interval of the
geometric mean of the per-round ratios, in which the machine's drift cancels, widened to
include the speed-up; "beyond noise" when it excludes 1. Fewer than
``noise.MIN_PAIRED_ROUNDS`` rounds give the speed-up with no interval and no verdict.

Where each run's step time went is measured over the same steps, per phase: the pipeline's
own timers (forward, backward, dense optimizer step; ``ProactiveTrainPipeline``'s tracer)
and the store's counters (time lookups waited for their rows, planning time), the rest of
the step being the measured step less the timed phases. Rank 0 writes it all to
``<train.output_dir>/compare.json``.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import replace
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional, Sequence

import torch
import torch.distributed as dist

from ..bench.noise import MIN_PAIRED_ROUNDS, format_ratio, paired_ratio
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


#: Steps per round, about (the rounds split the steps after the warm-up evenly). Every round
#: ends with both pipelines drained, so the proactive run's first batch of a round is fetched
#: at its lookup, as after an epoch's end: longer rounds pay that less often.
INTERLEAVE_STEPS = 10
ARMS = ("reactive", "proactive")
#: What compare measures of each run in each round (seconds summed over the round's steps).
_ROUND_KEYS = ("clock_s", "stall_s", "plan_s", "forward_s", "backward_s", "optimizer_s")
#: Compute events of the pipeline's tracer ("fwd b3", "bwd b3", "opt b3") -> round key.
_TRACED = {"fwd": "forward_s", "bwd": "backward_s", "opt": "optimizer_s"}


def round_ends(warmup: int, total: int, per_round: int = INTERLEAVE_STEPS) -> List[int]:
    """The last step of each round: the steps after ``warmup`` in rounds of about ``per_round``."""
    steps = total - warmup
    if steps <= 0:
        return []
    n = max(1, round(steps / per_round))
    return [warmup + round(steps * (i + 1) / n) for i in range(n)]


def _traced_seconds(events: Sequence[Dict[str, Any]]) -> Dict[str, float]:
    out = dict.fromkeys(_TRACED.values(), 0.0)
    for e in events:
        key = _TRACED.get(str(e.get("name", "")).split(" ")[0]) if e.get("lane") == "compute" else None
        if key:
            out[key] += float(e["end_s"]) - float(e["start_s"])
    return out


class _Rounds:
    """Measures one run's rounds: its trainer's clock, the store's stall and planning seconds
    and the pipeline's forward / backward / optimizer timers, all of training steps only (an
    evaluation at an epoch's end is timed by none of them: the trainer's clock skips it, the
    timers are off and its counters are taken out)."""

    def __init__(self, trainer: Any) -> None:
        self.trainer = trainer
        self.tracer = trainer.pipeline.tracer
        self.tracer.enabled = True
        self._evaluated = {"stall_s": 0.0, "plan_s": 0.0}
        evaluate = trainer.evaluate

        def untimed_evaluate() -> Any:
            before = trainer.pipeline.stats()
            self.tracer.enabled = False
            try:
                return evaluate()
            finally:
                self.tracer.enabled = True
                after = trainer.pipeline.stats()
                for k in self._evaluated:
                    self._evaluated[k] += after.get(k, 0.0) - before.get(k, 0.0)

        trainer.evaluate = untimed_evaluate

    def _counters(self) -> Dict[str, float]:
        stats = self.trainer.pipeline.stats()
        return {k: stats.get(k, 0.0) - v for k, v in self._evaluated.items()}

    def run(self, until: int) -> Dict[str, float]:
        """Trains to step ``until``; what that round cost (this rank's seconds)."""
        t = self.trainer
        self.tracer.events.clear()
        steps0, clock0, counters0 = t.pos.step, t.clock, self._counters()
        t.run(until)
        counters = self._counters()
        out = {"steps": float(t.pos.step - steps0), "clock_s": t.clock - clock0,
               **{k: counters[k] - counters0[k] for k in counters}, **_traced_seconds(self.tracer.events)}
        self.tracer.events.clear()
        return out


def run_compare(cfg: Config) -> Dict[str, Any]:
    """Trains both modes side by side in interleaved rounds (see the module), so that both
    see the same background load on a shared machine; each is timed only while its own
    steps run. Returns :func:`assemble`'s result (rank 0 also writes it to compare.json)."""
    depth = cfg.prefetch.depth if cfg.prefetch.mode == "fixed" else 2
    # both arms' caches are sized for one depth: the proactive arm's (or cache.sized_for_depth)
    cache_depth = max(depth, cfg.cache.sized_for_depth or 0)
    modes = (("reactive", PrefetchConfig(mode="off", depth=0)), ("proactive", PrefetchConfig(mode="fixed", depth=depth)))
    trainers = []
    for label, prefetch in modes:
        train = replace(cfg.train, output_dir=str(Path(cfg.train.output_dir) / label), save_checkpoints=False,
                        resume=False)
        # one config line for the comparison: the two runs differ only in prefetch.*
        # the reactive arm is reactive at both hops (tables on disk: no disk read ahead either)
        tier = cfg.tier if prefetch.depth else replace(cfg.tier, disk_depth=None)
        trainers.append(build_run(replace(cfg, prefetch=prefetch, train=train, tier=tier), cache_depth=cache_depth,
                                  log_config=not trainers,
                                  host_cache_depth=max(cache_depth, cfg.tier.disk_depth or 0)))
    trainers[0].log.info("compare: reactive (prefetch off, depth 0) and proactive (depth %d) side by side on the "
                         "data and caches above", depth)
    timers = [_Rounds(t) for t in trainers]
    for t in trainers:
        t.start()
    total = trainers[0].total
    warmup = trainers[0].steady_from  # the steady-state window is the rounds' steps, exactly
    for t in trainers:
        t.run(warmup)
    measured: List[List[Dict[str, float]]] = [[], []]
    for i, until in enumerate(round_ends(warmup, total)):
        for a in ((0, 1) if i % 2 == 0 else (1, 0)):
            measured[a].append(timers[a].run(until))
    rows: List[Dict[str, Any]] = []
    digests: List[str] = []
    slots: Dict[str, Dict[str, int]] = {}
    for (label, prefetch), t in zip(modes, trainers):
        summary = t.finish()
        steady = dict(summary.steady)
        steady["measured_steps"] = steady.pop("steps", 0)
        rows.append({"mode": label, "depth": prefetch.depth, "steps": summary.steps, **steady,
                     "loss": summary.train_loss})
        slots[label] = dict(summary.cache_slots)
        digests.append(state_digest(t.dmp))
        t.log.info("%s (depth %d): %d steps, loss %.4f, %s", label, prefetch.depth, summary.steps,
                   summary.train_loss, format_steady(summary.steady))
    same = torch.tensor([int(digests[0] == digests[1])])
    dist.all_reduce(same, op=dist.ReduceOp.MIN)
    world = dist.get_world_size()
    # every rank's rounds, as the table's figures are: seconds averaged over the ranks
    n = len(measured[0])
    table = torch.tensor([[[r[k] for k in ("steps", *_ROUND_KEYS)] for r in arm] for arm in measured],
                         dtype=torch.float64).reshape(2, n, 1 + len(_ROUND_KEYS))
    dist.all_reduce(table)
    rounds = {label: [{"steps": int(round(v[0] / world)), **{k: x / world for k, x in zip(_ROUND_KEYS, v[1:])}}
                      for v in table[a].tolist()] for a, label in enumerate(ARMS)}
    result = assemble(rows, rounds, warmup_steps=warmup, world_size=world, batch_size=cfg.train.batch_size,
                      link=describe_link(cfg), identical_parameters=bool(same.item()),
                      output_dir=str(Path(cfg.train.output_dir).absolute()), cache_slots=slots,
                      device=trainers[0].env.device.type)
    if cfg.tier.kind == "ssd":  # (both arms: the same tables on disk, the same host caches)
        size = (f"host caches planned from tier.host_budget_mb={cfg.tier.host_budget_mb:g} per rank"
                if cfg.tier.host_budget_mb else f"host cache {cfg.tier.host_cache_mb:g} MiB per table shard")
        result["tier"] = (f"tables on disk (tier=ssd) under {cfg.tier.dir}, {size}, disk reads queued "
                          f"{cfg.tier.disk_depth if cfg.tier.disk_depth is not None else 'prefetch.depth'} batch(es) "
                          f"ahead in the proactive arm")
    if trainers[0].env.is_main:
        path = Path(cfg.train.output_dir) / "compare.json"
        path.write_text(json.dumps(result, indent=2))
        trainers[0].log.info("compare: figures and rounds in %s", path)
    return result


def assemble(rows: List[Dict[str, Any]], rounds: Mapping[str, List[Dict[str, float]]], *, warmup_steps: int,
             world_size: int, batch_size: int, link: str, identical_parameters: bool, output_dir: str,
             cache_slots: Mapping[str, Mapping[str, int]], device: str = "cpu") -> Dict[str, Any]:
    """The comparison from its measurements: ``rows`` (per arm: mode, depth, steps and the
    steady-state counters) and ``rounds`` (per arm, per round: ``steps`` and the seconds of
    ``_ROUND_KEYS``, mean over ranks). Each row's rate, step and stall are the rounds' (the
    same steps as the phases), the speed-up their ratio, judged on the per-round ratios."""
    samples_per_step = world_size * batch_size
    rows = [dict(r) for r in rows]
    phases: Dict[str, Dict[str, float]] = {}
    rates: Dict[str, List[float]] = {}
    for row in rows:
        arm = rounds[row["mode"]]
        steps = sum(r["steps"] for r in arm)
        total = {k: sum(r[k] for r in arm) for k in _ROUND_KEYS}
        ms = {k: 1e3 * v / max(steps, 1) for k, v in total.items()}
        row.update(measured_steps=steps, step_ms=ms["clock_s"], stall_ms_per_step=ms["stall_s"],
                   samples_per_s=samples_per_step * steps / max(total["clock_s"], 1e-12))
        phases[row["mode"]] = {
            "step_ms": ms["clock_s"], "forward_ms": ms["forward_s"], "stall_ms": ms["stall_s"],
            "planning_ms": ms["plan_s"], "backward_ms": ms["backward_s"], "optimizer_ms": ms["optimizer_s"],
            "rest_ms": ms["clock_s"] - ms["forward_s"] - ms["backward_s"] - ms["optimizer_s"],
        }
        rates[row["mode"]] = [samples_per_step * r["steps"] / max(r["clock_s"], 1e-12) for r in arm]
    reactive, proactive = (next(r for r in rows if r["mode"] == arm) for arm in ARMS)
    value = proactive["samples_per_s"] / max(reactive["samples_per_s"], 1e-12)
    pairs = [p / r for p, r in zip(rates["proactive"], rates["reactive"])]
    speedup = paired_ratio(value, pairs)
    if speedup["within_noise"] is False:
        speedup["verdict"] += ": proactive is " + ("faster" if value > 1 else "slower")
    speedup["method"] = (f"95% t-interval of the geometric mean of the {len(pairs)} per-round ratios (both runs "
                         "back to back in every round, so the machine's drift cancels), widened to include the "
                         "speed-up; beyond noise = it excludes 1")
    return {"rows": rows, "identical_parameters": identical_parameters, "link": link, "world_size": world_size,
            "batch_size": batch_size, "warmup_steps": warmup_steps, "interleave_steps": INTERLEAVE_STEPS,
            "rounds": {arm: [dict(r) for r in rounds[arm]] for arm in ARMS}, "speedup": speedup, "phases": phases,
            "cache_slots": {arm: dict(cache_slots.get(arm, {})) for arm in ARMS}, "output_dir": output_dir,
            "device": device}


# (label, key, how it is measured) of the phase table, in print order
_PHASES = (
    ("step", "step_ms", "the trainer's clock: time in the run's own steps"),
    ("  forward", "forward_ms", "lookup, output all-to-all, dense layers (pipeline timer)"),
    ("    of which waiting for rows (stall)", "stall_ms", "store counter"),
    ("    of which planning fetches", "planning_ms", "store counter, wall time"),
    ("  backward", "backward_ms", "embedding-gradient all-to-all, fused update, dense all-reduce (pipeline timer)"),
    ("  dense optimizer step", "optimizer_ms", "pipeline timer"),
    ("  rest of the step", "rest_ms", "step less the three above: next batch's loading and id all-to-all, pipeline"),
)


def _phase_lines(result: Dict[str, Any]) -> List[str]:
    phases = result.get("phases")
    if not phases:
        return []
    r, p = phases["reactive"], phases["proactive"]
    width = max(len(label) for label, _, _ in _PHASES) + 2
    lines = [f"where the step time went (ms/step, mean over ranks, over the same steps as the table):",
             f"{'phase':<{width}}{'reactive':>9}{'proactive':>10}{'change':>9}  measured by"]
    for label, key, how in _PHASES:
        lines.append(f"{label:<{width}}{r[key]:>9.2f}{p[key]:>10.2f}{p[key] - r[key]:>+9.2f}  {how}")
    d = {k: p[f"{k}_ms"] - r[f"{k}_ms"] for k in ("step", "stall", "forward", "backward", "optimizer", "rest")}
    lines.append(f"step change {d['step']:+.2f} ms = stall {d['stall']:+.2f} + forward beyond the stall "
                 f"{d['forward'] - d['stall']:+.2f} + backward {d['backward']:+.2f} + optimizer {d['optimizer']:+.2f} "
                 f"+ rest {d['rest']:+.2f}")
    if result.get("device", "cpu") != "cpu":
        lines.append("(on a GPU the pipeline timers measure host time: kernels run asynchronously, so a phase is "
                     "the host's launches and waits in it, and the step's wait for its loss falls in the rest)")
    return lines


def _fetch_line(rows: Sequence[Dict[str, Any]]) -> Optional[str]:
    if not all("rows_fetched_per_step" in r for r in rows):
        return None
    parts = []
    for r in rows:
        fetched, at_lookup = r["rows_fetched_per_step"], r.get("rows_fetched_at_lookup_per_step", 0.0)
        share = f" ({100 * at_lookup / fetched:.0f}%)" if fetched else ""
        parts.append(f"{r['mode']} {at_lookup:.1f} of {fetched:.1f}{share}")
    return ("rows fetched at their lookup (on the critical path) per step and rank: " + ", ".join(parts)
            + " - at depth >= 1, the first batch after each drain (every round's and epoch's start) and any "
              "prefetch that waited for cache room")


def _files_line(result: Dict[str, Any]) -> Optional[str]:
    out = result.get("output_dir")
    if not out:
        return None
    root = Path(out)
    named = [("compare.json", "these figures and every round's"), ("compare.log", "the log"),
             ("reactive/", "the reactive run's config.yaml, metrics.jsonl and train.log, per rank"),
             ("proactive/", "the proactive run's, likewise")]
    shown = [f"{name} ({what})" for name, what in named if (root / name.rstrip("/")).exists()]
    return f"files: {out} - " + "; ".join(shown) if shown else f"files: {out}"


def format_table(result: Dict[str, Any]) -> str:
    """The comparison as the aligned text the CLI prints."""
    rows = result["rows"]
    head = (f"{'mode':<10} {'depth':>5} {'samples/s':>11} {'ms/step':>9} {'stall ms/step':>14} {'hit rate':>9} "
            f"{'MB/step/rank':>13}")
    n_rounds = len(result["rounds"]["reactive"]) if "rounds" in result else 0
    sizes = sorted({r["steps"] for r in result["rounds"]["reactive"]}) if n_rounds else []
    of = f"{sizes[0]}" if len(sizes) == 1 else f"{sizes[0]}-{sizes[-1]}"
    lines = [
        f"host-to-device link: {result['link']}",
        *([f"tier: {result['tier']}"] if result.get("tier") else []),
        f"{result['world_size']} rank(s) x batch {result['batch_size']}, {rows[0]['steps']} steps each: steps "
        f"1-{result.get('warmup_steps', 0)} warm-up, then {n_rounds} interleaved round{'s' if n_rounds != 1 else ''} "
        f"of {of} steps (each round runs both back to back, the first alternating); the figures are over the rounds' "
        f"{rows[0]['measured_steps']} steps",
        head, "-" * len(head),
    ]
    for r in rows:
        lines.append(f"{r['mode']:<10} {r['depth']:>5} {r['samples_per_s']:>11.0f} {r['step_ms']:>9.2f} "
                     f"{r['stall_ms_per_step']:>14.2f} {r['hit_rate']:>9.3f} {r['mb_moved_per_step']:>13.3f}")
    speed = result["speedup"]
    if speed["interval"] is None:  # (more steps make more rounds)
        speed = dict(speed, verdict=f"{speed['verdict']}: raise train.epochs or train.max_steps")
    lines.append(f"speed-up (proactive / reactive samples/s): {format_ratio(speed)}")
    if speed["interval"] is not None:
        lines.append(f"  interval: {speed['method']}")
    lines += _phase_lines(result)
    fetch = _fetch_line(rows)
    if fetch:
        lines.append(fetch)
    lines.append(f"final parameters bit-identical: {'yes' if result['identical_parameters'] else 'NO'}")
    files = _files_line(result)
    if files:
        lines.append(files)
    return "\n".join(lines)


__all__ = ["run_compare", "assemble", "format_table", "round_ends", "state_digest", "INTERLEAVE_STEPS",
           "MIN_PAIRED_ROUNDS"]
