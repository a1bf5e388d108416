"""The scaling study: validate the step model on held-out CPU runs, then project it to GPU systems.

1. **Validation on held-out runs** (:func:`validate`). The bench's measured runs (gloo ranks,
   emulated link) are modelled with each run's measured resident and 100%-cache steps, gloo
   collectives and link parameters as the "hardware", the counted per-rank, per-step bytes
   (``bytes_moved_by_rank_step``) as the loads of the schedule
   (:func:`~torchrec_proactive.model.step_model.schedule_step_s`), at each configuration's
   counted effective depth (``mean_prefetch_lead``). Two inputs are fitted on
   :data:`CALIBRATION` only (:func:`fit`); every other configuration is a prediction
   (``held_out``). Beside each entry stands the **null model**
   (:func:`~torchrec_proactive.model.step_model.null_step_s`: no parameters, no schedule) and
   the validation counts the held-out entries that the null model misses by more than the
   target (``discriminating``): only there does the validation test the model rather than
   identities of its inputs. :data:`VARIANTS` are deliberately wrong models: a test builds a
   set on which the validation rejects each; the recorded runs reject the null and mean-copy
   models, and the one without depth 1's issue delay only in some runs (``wrong_models``).
2. **Stragglers** (:func:`straggler_rows`): the skewed 1/2/4-rank runs, reactive, depth 1
   and deeper.
3. **Counted checks, no timing** (:func:`counter_checks`, :func:`locality_checks`): the
   bench's own batches replayed through the real store (:mod:`.cache_replay`) against the
   bench's counters (prefetch leads, rows moved, the slowest rank's share), and the
   projection's steady-state traffic model
   (:func:`~torchrec_proactive.model.workloads.shard_traffic`) against the real store on
   multi-hot ids.
4. **Projection** (:func:`project`): per hardware profile
   (:mod:`~torchrec_proactive.model.hardware`) and workload
   (:mod:`~torchrec_proactive.model.workloads`), per scale: what a planner would tier and the
   caches the budgets allow, the per-rank loads of those caches in steady state, the step of
   reactive fetching, of TorchRec's prefetch pipeline (depth 1) and of this product's
   lookahead (depths 2..8), every speed-up with ``{value, low, high}`` over the stated
   uncertainties. Compute is calibrated on MLPerf Training's DLRM-dcnv2 step
   (:data:`~torchrec_proactive.model.workloads.MLPERF_STEP`); the step overhead beyond it is
   the headline's sensitivity (:func:`sensitivity`).

:func:`verdicts` says, per system, workload and tier, where proactive fetching pays against
reactive fetching and against TorchRec's depth 1, and beside the paper's claim (Cho et al.,
IEEE CAL 2024: +46% on average, scaling better than reactive).
"""

from __future__ import annotations

import functools
import hashlib
import json
import math
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

import numpy as np

from ..model.hardware import PROFILES, HardwareProfile, profile_named
from ..model.step_model import (DLRMShape, StageCosts, gpu_rates, gpu_stage_costs, null_step_s, schedule_step_s,
                                step_s, straggler_factor)
from ..model.workloads import (MLPERF_SOURCE, MLPERF_STEP, WORKLOADS, Popularity, ShardTraffic, TierPlan, Workload,
                               multi_hot, multi_hot_ids, shard_traffic, tier_plan, trace_popularity, workload_named,
                               zipf_popularity)

__all__ = ["StudySettings", "validate", "fit", "project", "verdicts", "write_study", "PAPER_CLAIM", "PAYS_ABOVE",
           "VARIANTS", "sensitivity", "counter_checks", "locality_checks", "calibrate_efficiency"]

PAPER_CLAIM = ("Cho et al., IEEE CAL 2024: proactive fetching of cold rows speeds DLRM training up by 46% on "
               "average over reactive fetching, and scales better with more GPUs")
#: Bench configurations the validation models (depth from the name; cache1*: the 1% cache).
_VALIDATED = ("reactive", "cache1_reactive", "cache1")


@dataclass(frozen=True)
class StudySettings:
    """What the study projects (defaults: a few minutes on one core)."""

    world_sizes: Tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
    #: 0: reactive; 1: TorchRec's prefetch pipeline; 2..: this product's lookahead
    depths: Tuple[int, ...] = (0, 1, 2, 4, 8)
    workloads: Tuple[Workload, ...] = WORKLOADS
    profiles: Tuple[HardwareProfile, ...] = PROFILES
    planning: Tuple[str, ...] = ("device", "host")
    #: an owner's id trace (``[samples, tables]`` .npy, e.g. a TorchRec-preprocessed Criteo day)
    trace: Optional[Path] = None
    #: the slowest rank's persistent share over the mean rank's (1.0: row-wise shards of
    #: hashed rows); the band's high end is in every speed-up's band
    rank_imbalance: Tuple[float, float] = (1.0, 1.25)
    #: steps of per-rank loads the schedule runs (independent draws per rank and step)
    load_steps: int = 48
    seed: int = 0
    #: the step overhead (ms) beyond the sourced step the sensitivity runs through
    overheads_ms: Tuple[float, ...] = (0.0, 0.5, 1.0, 2.0, 4.0, 8.0)
    #: the headline: (profile key, workload, GPUs)
    headline: Tuple[str, str, int] = ("dgx_h100", "dcnv2_multi_hot_scaled", 8)
    #: NVMe: disk reads queued this many times the host->device depth ahead (bench --tier ssd's defaults)
    disk_depth_factor: int = 4
    #: the host planning cost's band around the measured cost per id
    plan_band: Tuple[float, float] = (0.5, 2.0)
    #: locality check: the traffic model against the real store on multi-hot ids
    check_rows: int = 500_000
    check_batch: int = 1024
    check_hotness: Tuple[int, ...] = (1, 4, 16)
    check_fractions: Tuple[float, ...] = (0.02, 0.1, 0.3)
    check_steps: int = 50
    check_warmup: int = 20
    #: --quick: fewer scales and checks (a smoke test of the study)
    quick: bool = False
    #: host planning seconds per id when no replay measured it (the store's plan on this CPU)
    plan_s_per_id: Optional[float] = None
    #: the per-rank loads' step-to-step spread over the traffic model's (:func:`load_spread`)
    load_sd_scale: float = 1.0


# --------------------------------------------------------------------------------------------
# 1. validation

#: The calibration set: the (ranks, configuration) pairs of the main bench run whose measured
#: steps fit the model's two free inputs (host planning seconds per requested row, and per
#: copied row what a lookup waiting for its own copy pays beyond the link). Every other
#: validated configuration, and every configuration of a labelled run, is held out.
CALIBRATION: Tuple[Tuple[int, str], ...] = ((1, "reactive"), (1, "depth_2"))
#: Targets (issue 29): calibration within 10%, held out within 15%. Not gates to widen: a
#: held-out miss is reported with its reason (``validation_misses``).
CALIBRATION_TARGET, HELD_OUT_TARGET = 0.10, 0.15
#: The issue 43 bar: at least this many held-out entries that the null model misses by more
#: than :data:`HELD_OUT_TARGET`, the model within it on every one of them.
MIN_DISCRIMINATING = 6
#: A projected speed-up counts as paying (``pays_at``) only above what the validation resolves
#: (its held-out target); a smaller one is a sketch, not a finding.
PAYS_ABOVE = 1.0 + HELD_OUT_TARGET
#: The model and the deliberately wrong ones the validation must tell from it:
#: ``null`` (no parameters, no schedule), ``no_issue_delay`` (a copy issued at the lookup and
#: due at the next: depth 1 gets a whole step), ``mean_load`` (every batch the mean copy:
#: no bursts, no per-step stragglers).
VARIANTS = ("model", "null", "no_issue_delay", "mean_load")


def _modelled_config(name: str) -> bool:
    return name in _VALIDATED or name.startswith("depth_")


@dataclass(frozen=True)
class Fitted:
    """What the calibration set fits (everything else is measured per run or known)."""

    plan_s_per_row: float
    #: per copied row, what a lookup that waits for its copy pays beyond the link's time
    #: (``StageCosts.wait_s``; the emulated engine itself takes ``max(link, host copy)``)
    wait_s_per_row: float

    def to_dict(self) -> Dict[str, float]:
        return {"plan_s_per_row": self.plan_s_per_row, "wait_s_per_row": self.wait_s_per_row}


def _measured_ms(config: Mapping[str, Any]) -> float:
    """A configuration's step: the median over rounds of each round's mean step (a period:
    a burst that stalls one step in four moves the mean, not the median step), or the
    median step where a report has no per-round steps (older fixtures)."""
    rounds = [r for r in (config.get("step_ms_per_round") or []) if r]
    if rounds:
        means = sorted(sum(r) / len(r) for r in rounds)
        mid = len(means) // 2
        return means[mid] if len(means) % 2 else 0.5 * (means[mid - 1] + means[mid])
    return float(config["step_ms_median"])


def _effective_depth(run: Mapping[str, Any], config: Mapping[str, Any]) -> float:
    """The lead the bench counted (``mean_prefetch_lead``: per batch, how many lookups ahead
    its fetch was issued, 0 for rows copied at lookup). Reports from before that counter
    infer it: rows copied at lookup (``s`` of the copies) ran reactive; the rest ran at the
    nominal depth less the share of prefetches that waited for pins (``w`` per rank and
    step), but at least 1: ``(1 - s) * max(1, k * (1 - w))``."""
    depth = float(config["prefetch_depth"])
    if depth == 0:
        return 0.0
    if config.get("mean_prefetch_lead") is not None:
        return float(config["mean_prefetch_lead"])
    fetched = config.get("rows_fetched_per_step") or 0.0
    at_lookup = min(1.0, (config.get("rows_fetched_at_lookup_per_step") or 0.0) / fetched) if fetched else 0.0
    waited = min(1.0, (config.get("deferred_batches_per_step") or 0.0) / run["world_size"])
    return (1.0 - at_lookup) * max(1.0, depth * (1.0 - waited))


def _full_step_ms(run: Mapping[str, Any]) -> Tuple[float, Optional[Mapping[str, Any]]]:
    by_name = {c["name"]: c for c in run["configs"]}
    full = by_name.get("cache100")
    return _measured_ms(full if full is not None else by_name["resident"]), full


def _validation_costs(run: Mapping[str, Any], config: Mapping[str, Any], fitted: Fitted) -> StageCosts:
    """The CPU run as "hardware": the run's measured stock all-resident step plus the store's
    own overhead (its 100%-cache step minus that, less the exposed planning), the run's gloo
    collectives, the emulated link (latency + bytes / bandwidth, the slowest rank's mean bytes:
    :func:`straggler_factor` of the counted per-rank bytes), the fitted cost per copied row of
    a lookup that waits for its copy (``wait_s``, reactive only), the fitted planning cost per
    requested row; forward : backward = 1 : 2."""
    world = run["world_size"]
    comm = run.get("comm_s") or {}
    input_a2a, output_a2a, allreduce = (comm.get(k, 0.0) if world > 1 else 0.0
                                        for k in ("input_a2a_s", "output_a2a_s", "allreduce_s"))
    by_name = {c["name"]: c for c in run["configs"]}
    resident_s = _measured_ms(by_name["resident"]) / 1e3
    full = by_name.get("cache100")
    store_s = 0.0 if full is None else max(
        0.0, _measured_ms(full) / 1e3 - resident_s - max(0.0, full["plan_ms_per_step"] / 1e3 - output_a2a))
    compute = max(0.0, resident_s - input_a2a - output_a2a - allreduce) + store_s
    link = run["link"]
    depth = _effective_depth(run, config)
    per_rank = config.get("bytes_moved_by_rank_step") or []
    factor = straggler_factor(per_rank, int(round(depth))) if len(per_rank) > 1 else 1.0
    moved = factor * config["bytes_moved_per_step"] / world  # the report sums over ranks
    rows = factor * (config.get("rows_fetched_per_step", 0.0) + config.get("rows_written_back_per_step", 0.0)) / world
    copy = link["latency_us"] * 1e-6 + moved / (link["bandwidth_gbps"] * 1e9) if moved else 0.0
    plan = fitted.plan_s_per_row * config.get("rows_requested_per_step", 0.0) / world
    return StageCosts(input_a2a_s=input_a2a, forward_s=compute / 3, output_a2a_s=output_a2a,
                      backward_s=2 * compute / 3, allreduce_s=allreduce, copy_s=copy, plan_s=plan,
                      wait_s=rows * fitted.wait_s_per_row)


def _validation_loads(run: Mapping[str, Any], config: Mapping[str, Any], fitted: Fitted
                      ) -> Tuple[Optional[np.ndarray], Optional[np.ndarray]]:
    """Per rank and step: the copy's seconds on the emulated link and a reactive lookup's
    hand-off, from the counted bytes (None: no per-rank counts in the report)."""
    per_rank = config.get("bytes_moved_by_rank_step") or []
    if not per_rank or not any(any(s) for s in per_rank):
        return None, None
    b = np.asarray(per_rank, dtype=float)
    link = run["link"]
    copy = np.where(b > 0, link["latency_us"] * 1e-6 + b / (link["bandwidth_gbps"] * 1e9), 0.0)
    rows_step = (config.get("rows_fetched_per_step", 0.0) or 0.0) + (config.get("rows_written_back_per_step", 0.0) or 0.0)
    per_row = config["bytes_moved_per_step"] / rows_step if rows_step else 0.0
    waits = (b / per_row) * fitted.wait_s_per_row if per_row else np.zeros_like(b)
    return copy, waits


def _null_ms(run: Mapping[str, Any], config: Mapping[str, Any]) -> float:
    """The null model: the run's 100%-cache step and its link time for the counted bytes,
    times the counted straggler factor at the counted lead (reactive below a lead of 1)."""
    full_ms, _ = _full_step_ms(run)
    link = run["link"]
    depth = _effective_depth(run, config)
    per_rank = config.get("bytes_moved_by_rank_step") or []
    factor = straggler_factor(per_rank, int(round(depth))) if len(per_rank) > 1 else 1.0
    moved = factor * config["bytes_moved_per_step"] / run["world_size"]
    copy_ms = 1e3 * (link["latency_us"] * 1e-6 + moved / (link["bandwidth_gbps"] * 1e9)) if moved else 0.0
    return null_step_s(full_ms, copy_ms, depth)


def _modelled_ms(run: Mapping[str, Any], config: Mapping[str, Any], fitted: Fitted, variant: str = "model") -> float:
    if variant == "null":
        return _null_ms(run, config)
    costs = _validation_costs(run, config, fitted)
    depth = _effective_depth(run, config)
    if variant == "no_issue_delay":
        # (wrong on purpose: the copy of batch N+k issued at batch N's lookup, due k steps later)
        loads, waits = _validation_loads(run, config, fitted)
        return 1e3 * schedule_step_s(costs, depth, loads, waits=waits, window=(costs.input_a2a_s, costs.input_a2a_s))
    if variant == "mean_load":
        return 1e3 * step_s(costs, depth)
    if variant != "model":
        raise ValueError(f"validation variant must be one of {VARIANTS}, got {variant!r}")
    loads, waits = _validation_loads(run, config, fitted)
    return 1e3 * schedule_step_s(costs, depth, loads, waits=waits)


#: What :func:`validate` reads of a bench report (kept in projection.json and the fixture, so a
#: validation can be re-checked without re-running anything).
RUN_KEYS = ("world_size", "link", "comm_s", "skew", "label")
CONFIG_KEYS = ("name", "prefetch_depth", "step_ms_median", "step_ms_per_round", "bytes_moved_per_step",
               "plan_ms_per_step", "rows_requested_per_step", "rows_fetched_per_step", "rows_written_back_per_step",
               "rows_fetched_at_lookup_per_step", "deferred_batches_per_step", "mean_prefetch_lead",
               "cache_load_factor", "bytes_moved_by_rank_step", "hit_rate")


def validation_inputs(run: Mapping[str, Any], label: Optional[str] = None) -> Dict[str, Any]:
    """The part of a bench report that :func:`validate` and :func:`counter_checks` read."""
    settings = run.get("settings") or {}
    workload = settings.get("workload") or {}
    skew = workload.get("skew", run.get("skew", 0.0))
    out = {**{k: run.get(k) for k in RUN_KEYS}, "skew": skew or 0.0,
           "cache_load_factor": settings.get("cache_load_factor", run.get("cache_load_factor")),
           "configs": [{k: c.get(k) for k in CONFIG_KEYS} for c in run["configs"] if "error" not in c]}
    if label is not None:
        out["label"] = label
    if settings:
        out["bench_settings"] = {k: settings.get(k) for k in ("sharding", "cache_load_factor", "warmup_steps",
                                                              "measure_steps", "depths", "target_fetch_fraction")}
        out["bench_settings"]["workload"] = workload
    elif run.get("bench_settings"):
        out["bench_settings"] = run["bench_settings"]
    return out


def _validated_configs(runs: Sequence[Mapping[str, Any]]):
    for run in runs:
        for c in run["configs"]:
            if "error" not in c and _modelled_config(c["name"]) and c.get("prefetch_depth") is not None:
                yield run, c


def _is_calibration(run: Mapping[str, Any], config: Mapping[str, Any]) -> bool:
    return (run["world_size"], config["name"]) in CALIBRATION and not run.get("skew") and not run.get("label")


def fit(runs: Sequence[Mapping[str, Any]]) -> Fitted:
    """Fits :class:`Fitted` on the :data:`CALIBRATION` configurations of ``runs`` only:
    planning per requested row as their ratio of sums; the wait per copied row by
    least squares of the relative step error (a grid: the model is piecewise linear)."""
    cal = [(r, c) for r, c in _validated_configs(runs) if _is_calibration(r, c)]
    if not cal:
        raise ValueError(f"validation: no calibration run among the runs (need {CALIBRATION})")
    rows = sum(c.get("rows_requested_per_step") or 0.0 for _, c in cal)
    plan = sum((c.get("plan_ms_per_step") or 0.0) / 1e3 * r["world_size"] for r, c in cal) / rows if rows else 0.0

    def sq(x: float) -> float:
        f = Fitted(plan, x)
        return sum((_modelled_ms(r, c, f) / _measured_ms(c) - 1) ** 2 for r, c in cal)

    grid = [i * 2e-8 for i in range(0, 501)]  # 0 .. 10 us per row
    return Fitted(plan, min(grid, key=sq))


def validate(runs: Sequence[Mapping[str, Any]], fitted: Optional[Fitted] = None,
             variant: str = "model") -> List[Dict[str, Any]]:
    """``{ranks, config, run, depth, effective_depth, skew, cache, measured_step_ms,
    modelled_step_ms, null_model_step_ms, error, null_error, held_out, discriminating}`` for
    the reactive, fixed-depth and 1%-cache configurations of each bench report in ``runs``.
    ``variant``: the model (default) or one of the wrong ones in :data:`VARIANTS` as the
    modelled figure. The two free inputs are fitted on :data:`CALIBRATION` only."""
    fitted = fitted or fit(runs)
    rows = []
    for run, c in _validated_configs(runs):
        measured = _measured_ms(c)
        modelled = _modelled_ms(run, c, fitted, variant)
        null = _null_ms(run, c)
        held = not _is_calibration(run, c)
        null_error = null / measured - 1.0
        rows.append({"ranks": run["world_size"], "config": c["name"], "depth": int(c["prefetch_depth"]),
                     "effective_depth": _effective_depth(run, c), "skew": run.get("skew") or 0.0,
                     "cache": c.get("cache_load_factor") or (run.get("cache_load_factor") or None),
                     "run": run.get("label") or "bench",
                     "measured_step_ms": measured, "modelled_step_ms": modelled, "null_model_step_ms": null,
                     "error": modelled / measured - 1.0, "null_error": null_error, "held_out": held,
                     "discriminating": held and abs(null_error) > HELD_OUT_TARGET})
    return rows


def miss_reason(entry: Mapping[str, Any]) -> str:
    """Why a validation entry misses its target, from what the model leaves out (stated, not
    fitted away)."""
    if entry["config"] == "cache1_reactive":
        return ("1% cache, reactive: a full small cache evicts on every miss, and what its lookups pay beyond the "
                "link per copied row differs from the per-row cost fitted on the 5% cache (the model has one)")
    if entry["config"] == "cache1":
        return ("1% cache: prefetches wait for pins, so leads spread between 0 and k; the model takes their counted "
                "mean (mean_prefetch_lead) and mixes the two neighbouring depths, not the spread itself")
    if "burst" in str(entry.get("run")):
        return ("bursts: the schedule runs the first round's counted per-step bytes; a burst's copy also waits for "
                "the host gather, which the emulated link hides in its own time on an idle machine only")
    if entry["ranks"] > 1 and entry["skew"]:
        return ("skewed multi-rank: the loads come from one round's counted bytes, and the model gives every rank's "
                "copy engine its own core while the ranks, their fetch workers and link emulations share 2 (a "
                "rank's copy waits for a core the model does not see)")
    if entry["depth"] == 0:
        return ("reactive: what a lookup waiting for its copy pays beyond the link (waking the thread, binding "
                "rows) differs from the fitted per-row cost")
    return ("proactive: the fetch worker and the link emulation compete with the ranks for 2 cores; the model "
            "gives the copy engine a core of its own")


def validation_summary(checks: Sequence[Mapping[str, Any]]) -> Dict[str, Any]:
    """Max |error| in calibration and held out, every entry beyond its target with its reason,
    and the falsifiability count: held-out entries the null model misses by more than the
    target (``discriminating``), and whether the model stays within it on all of them."""
    cal = [abs(c["error"]) for c in checks if not c["held_out"]]
    held = [c for c in checks if c["held_out"]]
    disc = [c for c in held if c.get("discriminating")]
    misses = [{"ranks": c["ranks"], "config": c["config"], "run": c.get("run"), "error": c["error"],
               "why": miss_reason(c)}
              for c in checks if abs(c["error"]) > (HELD_OUT_TARGET if c["held_out"] else CALIBRATION_TARGET)]
    model_ok = all(abs(c["error"]) <= HELD_OUT_TARGET for c in disc)
    part = [c for c in held
            if abs(c["modelled_step_ms"] - c["null_model_step_ms"]) > HELD_OUT_TARGET * c["measured_step_ms"]]
    runs = sorted({(c.get("run") or "bench", c["ranks"]) for c in held})
    distinct = len({round(c["modelled_step_ms"], 3) for c in held})
    if len(disc) < MIN_DISCRIMINATING:
        verdict = (f"not falsifiable yet: {len(disc)} held-out entries tell the model from the null model (need "
                   f"{MIN_DISCRIMINATING})")
    elif model_ok:
        verdict = (f"passes: the model stays within {100 * HELD_OUT_TARGET:.0f}% on all {len(disc)} held-out entries "
                   f"the null model misses")
    else:
        verdict = (f"fails: the model misses {sum(abs(c['error']) > HELD_OUT_TARGET for c in disc)} of the "
                   f"{len(disc)} held-out entries the null model misses")
    return {"calibration_max_abs_error": max(cal, default=None),
            "held_out_max_abs_error": max((abs(c["error"]) for c in held), default=None),
            "held_out_count": len(held), "held_out_runs": len(runs), "held_out_distinct_predictions": distinct,
            "null_held_out_max_abs_error": max((abs(c["null_error"]) for c in held), default=None),
            "discriminating": {"count": len(disc), "needed": MIN_DISCRIMINATING,
                               "model_max_abs_error": max((abs(c["error"]) for c in disc), default=None),
                               "null_min_abs_error": min((abs(c["null_error"]) for c in disc), default=None),
                               "entries": [{"run": c.get("run"), "ranks": c["ranks"], "config": c["config"],
                                            "error": c["error"], "null_error": c["null_error"]} for c in disc]},
            # the stricter reading, beside the verdict: entries where the two predictions themselves
            # part by more than the target (a null model's miss may be the measurement's)
            "models_part": {"count": len(part),
                            "model_max_abs_error": max((abs(c["error"]) for c in part), default=None),
                            "within_target": sum(abs(c["error"]) <= HELD_OUT_TARGET for c in part)},
            "validation_verdict": verdict,
            "targets": {"calibration": CALIBRATION_TARGET, "held_out": HELD_OUT_TARGET,
                        "discriminating": MIN_DISCRIMINATING},
            "misses": misses}


def variant_summaries(runs: Sequence[Mapping[str, Any]], fitted: Fitted) -> Dict[str, Dict[str, Any]]:
    """Per :data:`VARIANTS` entry, its held-out max |error| and how many held-out entries it
    misses: the wrong models must miss where the model does not."""
    out = {}
    for v in VARIANTS:
        held = [c for c in validate(runs, fitted, v) if c["held_out"]]
        worst = max((abs(c["error"]) for c in held), default=None)
        out[v] = {"held_out_max_abs_error": None if worst is None else float(worst),
                  "held_out_misses": int(sum(abs(c["error"]) > HELD_OUT_TARGET for c in held)),
                  "validation_verdict": validation_summary(validate(runs, fitted, v))["validation_verdict"]}
    return out


# --------------------------------------------------------------------------------------------
# 1b. stragglers: measured multi-rank runs (1, 2, 4 gloo ranks, skewed tables, table-wise)


def straggler_rows(runs: Sequence[Mapping[str, Any]], fitted: Fitted) -> List[Dict[str, Any]]:
    """``{ranks, skew, reactive_ms, depth1_ms, best_depth, best_depth_ms}`` per straggler run,
    measured, with the model's figures and the counted straggler factors next to them.
    Depth 1 here is this product's pipeline one batch ahead (the CPU bench has no TorchRec
    prefetch pipeline to run)."""
    out = []
    for run in runs:
        by = {c["name"]: c for c in run["configs"] if "error" not in c}
        if "reactive" not in by or "depth_1" not in by:
            continue
        deeper = {n: c for n, c in by.items() if n.startswith("depth_")}
        best = min(deeper.values(), key=_measured_ms)
        per_rank = lambda c: c.get("bytes_moved_by_rank_step") or []  # noqa: E731
        model = {n: _modelled_ms(run, c, fitted) for n, c in by.items() if n == "reactive" or n.startswith("depth_")}
        out.append({
            "ranks": run["world_size"], "skew": run.get("skew") or 0.0,
            "reactive_ms": _measured_ms(by["reactive"]), "depth1_ms": _measured_ms(by["depth_1"]),
            "best_depth": best["prefetch_depth"], "best_depth_ms": _measured_ms(best),
            "best_vs_reactive": _measured_ms(by["reactive"]) / _measured_ms(best),
            "best_vs_depth1": _measured_ms(by["depth_1"]) / _measured_ms(best),
            "straggler_factor": {n: (straggler_factor(per_rank(c), int(c["prefetch_depth"]))
                                     if len(per_rank(c)) > 1 else 1.0)
                                 for n, c in by.items() if n in model},
            "modelled_ms": model,
            "depth1_is": ("this product's pipeline one batch ahead: the next batch's copy issued after this forward and "
                          "its planning, due at the next lookup; TorchRec's own prefetch pipeline (due at the start of "
                          "the next step) has no CPU run: the projection models it"),
        })
    return out


# --------------------------------------------------------------------------------------------
# 1c. counted checks (no timing): the replay against the bench's counters


def counter_checks(runs: Sequence[Mapping[str, Any]], max_configs: int = 64) -> List[Dict[str, Any]]:
    """For every validated configuration of a table-wise bench run: its batches replayed
    through the real store (the bench's own ids, each rank's tables in one cache as the
    kernel holds them, the bench's cache size, warm-up and depth) against
    the bench's counters: the mean prefetch lead, rows moved per step, and the slowest rank's
    rows over the mean rank's (tables on ranks as the bench places them: table ``i`` on rank
    ``i mod world``). Counts only: this validates what the projection's leads and rank
    imbalance come from, held out (nothing here was fitted)."""
    from .cache_replay import replay_table
    from .workload import Workload

    out: List[Dict[str, Any]] = []
    for run in runs:
        bs = run.get("bench_settings") or {}
        w = bs.get("workload")
        if not w or bs.get("sharding") != "table_wise":
            continue
        world = run["world_size"]
        wl = Workload(**{k: v for k, v in w.items() if k in Workload.__dataclass_fields__})
        steps = int(bs["warmup_steps"]) + int(bs["measure_steps"])
        per_rank = [wl.batches(steps, r) for r in range(world)]
        cards = wl.cardinalities()
        # each rank's store: its tables (table i on rank i mod world) in one cache, as the
        # kernel groups them (one slot pool: no per-table ranges), every rank's ids of them
        stores = []
        for rank in range(world):
            mine = [i for i in range(len(cards)) if i % world == rank]
            if not mine:
                continue
            offsets = np.cumsum([0] + [cards[i] for i in mine])
            series = []
            for t in range(steps):
                ids = [per_rank[q][t].sparse_features.to_dict()[f"cat_{i}"].values().numpy() + offsets[j]
                       for j, i in enumerate(mine) for q in range(world)]
                series.append(np.concatenate(ids))
            stores.append((rank, mine, int(offsets[-1]), series))
        for c in run["configs"]:
            if "error" in c or not _modelled_config(c["name"]) or c.get("prefetch_depth") is None:
                continue
            if len(out) >= max_configs:
                return out
            depth = int(c["prefetch_depth"])
            fraction = c.get("cache_load_factor") or bs.get("cache_load_factor") or run.get("cache_load_factor")
            moved_rank = np.zeros((world, int(bs["measure_steps"])))
            leads, batches, moved_total = 0.0, 0.0, 0.0
            for rank, mine, rows, series in stores:
                # the bench's slots: round(load factor x rows) a table (ProactiveOptions.num_slots_for)
                slots = sum(max(1, int(round(float(fraction) * cards[i]))) for i in mine)
                r = replay_table(series, rows, min(1.0, (slots + 1e-6) / rows), depth, warmup=int(bs["warmup_steps"]))
                leads += r["leads"]
                batches += r["batches"]
                moved_total += r["fetched"] + r["written_back"]
                m = np.asarray(r["moved_by_step"], dtype=float)
                moved_rank[rank, :m.size] += m
            counted = c.get("bytes_moved_by_rank_step") or []
            rows_step = (c.get("rows_fetched_per_step") or 0.0) + (c.get("rows_written_back_per_step") or 0.0)
            per_row = c["bytes_moved_per_step"] / rows_step if rows_step else 0.0
            counted_factor = (straggler_factor(counted, 0) if len(counted) > 1 and per_row else None)
            replay_factor = straggler_factor(moved_rank.tolist(), 0) if world > 1 else 1.0
            measured_steps = int(bs["measure_steps"])
            out.append({
                "run": run.get("label") or "bench", "ranks": world, "config": c["name"],
                "lead_counted": c.get("mean_prefetch_lead"), "lead_replayed": leads / batches if batches else None,
                "rows_moved_counted": rows_step, "rows_moved_replayed": moved_total / measured_steps,
                "slowest_rank_counted": counted_factor, "slowest_rank_replayed": replay_factor,
            })
    return out


def counter_summary(checks: Sequence[Mapping[str, Any]]) -> Dict[str, Any]:
    def err(a: Optional[float], b: Optional[float]) -> Optional[float]:
        return None if a is None or b is None or not a else b / a - 1.0

    leads = [abs(c["lead_replayed"] - c["lead_counted"]) for c in checks
             if c["lead_counted"] is not None and c["lead_replayed"] is not None]
    moved = [abs(e) for e in (err(c["rows_moved_counted"], c["rows_moved_replayed"]) for c in checks) if e is not None]
    slow = [abs(e) for e in (err(c["slowest_rank_counted"], c["slowest_rank_replayed"]) for c in checks)
            if e is not None]
    return {"count": len(checks), "lead_max_abs_diff": max(leads, default=None),
            "rows_moved_max_abs_error": max(moved, default=None),
            "slowest_rank_max_abs_error": max(slow, default=None)}


# --------------------------------------------------------------------------------------------
# 2. workload figures: the steady-state traffic model, checked against the real store


def locality_checks(settings: StudySettings) -> List[Dict[str, Any]]:
    """The traffic model (:func:`~torchrec_proactive.model.workloads.shard_traffic` on MLPerf's
    uniform multi-hot expansion) against the real store replaying the same kind of ids in
    steady state (a history of 4 ids per cache row first, not counted): rows fetched per
    step, hit rate, their step-to-step spread, and the host planning time per id (the one
    timed figure here, for the host-planning projection)."""
    from .cache_replay import replay_table

    out = []
    n, b, alpha = settings.check_rows, settings.check_batch, 1.05
    for h in settings.check_hotness:
        pop = multi_hot(zipf_popularity(n, alpha), h)
        for fraction in settings.check_fractions:
            model = shard_traffic(pop, b, fraction)
            rng = np.random.default_rng(settings.seed)
            steps = [multi_hot_ids(rng, n, alpha, b, h).ravel() for _ in range(settings.check_steps)]
            # a history long enough that the cache is full and its rows are the steady state's
            # (12 ids a slot, at most 4M): a replay that never filled is reported, not counted
            fill = multi_hot_ids(np.random.default_rng(settings.seed + 7), n, alpha,
                                 max(1, min(4_000_000, int(fraction * n * 12)) // h), h).ravel()
            r = replay_table(steps, n, fraction, 2, warmup=settings.check_warmup, fill=fill)
            counted = r["steps"]
            fetched = r["fetched"] / counted
            moved = np.asarray(r["moved_by_step"], dtype=float)
            out.append({"hotness": h, "cache_fraction": fraction, "rows": n, "batch": b,
                        "fetched_per_step_model": model.fetched_rows, "fetched_per_step_store": fetched,
                        "fetched_error": model.fetched_rows / fetched - 1.0 if fetched else None,
                        "hit_rate_model": model.hit_rate, "hit_rate_store": r["hits"] / r["unique_rows"],
                        "moved_sd_model": 2.0 * math.sqrt(model.fetched_var), "moved_sd_store": float(moved.std()),
                        "cache_filled": bool(r["cache_filled"]),
                        "plan_s_per_id": r["plan_s"] / r["ids"] if r["ids"] else None})
    return out


@functools.lru_cache(maxsize=512)
def _zipf_multi_hot(rows: int, alpha: float, hotness: int, seed: int) -> Popularity:
    return multi_hot(zipf_popularity(rows, alpha), hotness, seed=seed)


def load_spread(locality: Sequence[Mapping[str, Any]]) -> float:
    """How much more the real store's rows moved vary from step to step than the traffic
    model's independent draws give (median ratio over the locality checks that filled, at
    least 1): the per-rank loads' spread is scaled by it (LRU's evictions come in waves)."""
    ratios = sorted(c["moved_sd_store"] / c["moved_sd_model"] for c in locality
                    if c.get("cache_filled") and c.get("moved_sd_model"))
    return max(1.0, ratios[len(ratios) // 2]) if ratios else 1.0


def _popularities(workload: Workload, plan: TierPlan, trace: Optional[Path], seed: int
                  ) -> Dict[str, Popularity]:
    pops: Dict[str, Popularity] = {}
    data = np.load(trace, mmap_mode="r") if trace is not None else None
    for i, t in enumerate(plan.tables):
        if t.name not in plan.tiered:
            continue
        if data is not None and i < data.shape[1]:
            pops[t.name] = multi_hot(trace_popularity(np.asarray(data[:, i])), t.hotness, seed=seed + i)
        else:
            pops[t.name] = _zipf_multi_hot(t.rows, workload.zipf_alpha, t.hotness, seed + i)
    return pops


@dataclass(frozen=True)
class RankTraffic:
    """One GPU's steady-state traffic over its tiered shards, per step."""

    fetched: float
    fetched_sd: float
    disk_reads: float  # NVMe: rows read from disk (host-cache misses) a step
    disk_sd: float
    ids: float  # ids of the tiered tables
    leads: Tuple[int, ...]  # effective lead at depth 0..8
    hit_rate: float
    per_table: Dict[str, Dict[str, float]]


def rank_traffic(workload: Workload, plan: TierPlan, pops: Mapping[str, Popularity]) -> RankTraffic:
    """Sums a GPU's tiered shards (row-wise: each shard at the table's cache fraction sees
    the whole table's traffic at a fixed batch per GPU, module docstring of
    :mod:`~torchrec_proactive.model.workloads`)."""
    batch = workload.shape.batch_per_gpu
    fetched = var = reads = rvar = ids = unique = 0.0
    leads = [9] * 9
    per: Dict[str, Dict[str, float]] = {}
    for name, pop in pops.items():
        st: ShardTraffic = shard_traffic(pop, batch, plan.cache_fraction)
        fetched += st.fetched_rows
        var += st.fetched_var
        ids += st.ids
        unique += st.unique_rows
        leads = [min(leads[k], st.lead(k)) for k in range(9)]
        d = 0.0
        if plan.host_cache_fraction < 1.0:
            both = shard_traffic(pop, batch, min(1.0, plan.cache_fraction + plan.host_cache_fraction))
            d = both.fetched_rows
            reads += both.fetched_rows
            rvar += both.fetched_var
        per[name] = {"fetched_per_step": st.fetched_rows, "hit_rate": st.hit_rate, "unique_rows": st.unique_rows,
                     "disk_reads_per_step": d}
    hit = 1.0 - fetched / unique if unique else 1.0
    return RankTraffic(fetched, math.sqrt(var), reads, math.sqrt(rvar), ids, tuple(leads), hit, per)


# --------------------------------------------------------------------------------------------
# 3. projection


#: Where planning runs: ``device`` (on the GPU, as FBGEMM's UVM cache and this product's
#: DevicePlanner do: off the host, free here), ``host`` (the store's host planner as built,
#: its measured cost per id, hidden only behind the output all-to-all).
PLANNING = ("device", "host")


def calibrate_efficiency(step_ms: float, profile: Optional[HardwareProfile] = None,
                         workload: Optional[Workload] = None, world: int = 8) -> float:
    """The share of the dense peak at which the modelled resident step of MLPerf's DLRM-dcnv2
    on 8 GPUs of a DGX H100 equals ``step_ms`` (the step MLPerf's result implies), capped at 1."""
    profile = profile or profile_named("dgx_h100")
    workload = workload or workload_named("dcnv2_multi_hot")
    shape = workload.shape

    def resident_ms(eff: float) -> float:
        return 1e3 * gpu_stage_costs(replace(profile, dense_efficiency=eff, step_overhead_s=0.0), shape, world,
                                     0.0, 0.0, 0.0).main_s

    lo, hi = 1e-3, 1.0
    if resident_ms(hi) >= step_ms:
        return 1.0
    for _ in range(100):
        mid = 0.5 * (lo + hi)
        if resident_ms(mid) > step_ms:
            lo = mid
        else:
            hi = mid
    return 0.5 * (lo + hi)


@dataclass(frozen=True)
class _Corner:
    profile: HardwareProfile
    imbalance: float
    plan_scale: float
    label: str


def _loads(traffic: RankTraffic, world: int, steps: int, seed: int, sd_scale: float = 1.0
           ) -> Tuple[np.ndarray, np.ndarray]:
    """Rows fetched and disk reads per rank and step: independent normal draws around the
    steady-state mean with its step-to-step spread (sums of many rows: the central limit;
    scaled by ``sd_scale``, :func:`load_spread`), never below 0; one array per (workload,
    scale), common to every corner. (At 1024 ranks the expected slowest rank comes from the
    fitted law, not from the largest of a few replayed steps.)"""
    rng = np.random.default_rng(seed)
    z = rng.standard_normal((world, steps))
    rows = np.maximum(0.0, traffic.fetched + sd_scale * traffic.fetched_sd * z)
    disk = (np.maximum(0.0, traffic.disk_reads + sd_scale * traffic.disk_sd * z) if traffic.disk_reads
            else np.zeros_like(rows))
    return rows, disk


def _corner_steps(corners: Sequence[_Corner], shape: DLRMShape, world: int, traffic: RankTraffic,
                  rows: np.ndarray, disk: np.ndarray, plan_s_per_id: float, depth: int,
                  settings: StudySettings) -> np.ndarray:
    """Step seconds of ``depth`` at every corner (0 reactive, 1 TorchRec, else this product)."""
    pipeline = "torchrec" if depth == 1 else "proactive"
    lead = traffic.leads[min(depth, 8)] if depth else 0
    mains, wins_a, wins_b, copies, disks, plans = [], [], [], [], [], []
    base = None
    # TorchRec's depth 1 plans on the device (FBGEMM's cache lookup in its prefetch stream) and
    # its UVM cache reads host rows over the link; this product's rows move the same way when
    # planned on the device (row_moves), through pinned staging when planned on the host
    per_id = 0.0 if pipeline == "torchrec" else plan_s_per_id * traffic.ids / shape.ids_per_step
    moves = "staged" if (plan_s_per_id and pipeline != "torchrec") else "mapped"
    for c in corners:
        costs = gpu_stage_costs(c.profile, shape, world, 0.0, 0.0, per_id * c.plan_scale, moves=moves)
        rates = gpu_rates(c.profile, shape, world, 1.0, moves)
        r = rows.copy()
        r[0] *= c.imbalance
        copies.append(rates.copy_s(r))
        if traffic.disk_reads:
            d = disk.copy()
            d[0] *= c.imbalance
            disks.append(rates.disk_s(2.0 * d))  # a page read a row, and a page written for the dirty row it evicts
        else:
            disks.append(np.zeros_like(r))
        if lead == 0:
            mains.append(costs.main_s)
        else:
            mains.append(costs.prefetched_main_s(pipeline))
        a, b = costs.window(pipeline)
        wins_a.append(a)
        wins_b.append(b)
        plans.append(costs.plan_s)
        base = base or costs
    loads = np.stack(copies)
    dl = np.stack(disks)
    if lead == 0:
        main = np.asarray(mains) + np.asarray(plans) - base.plan_s  # schedule adds base.plan_s
        return schedule_step_s(base, 0, loads, disk_loads=dl, waits=np.zeros_like(loads), main_s=main)
    kd = settings.disk_depth_factor * lead if pipeline == "proactive" else lead
    return schedule_step_s(base, lead, loads, disk_loads=dl, pipeline=pipeline, disk_depth=kd,
                           main_s=np.asarray(mains), window=(np.asarray(wins_a), np.asarray(wins_b)))


def _band_params(profile: HardwareProfile, eff_band: Tuple[float, float, float], planning: str,
                 settings: StudySettings) -> List[Tuple[str, Any, Any]]:
    params: List[Tuple[str, Any, Any]] = [(name, lo, hi) for name, lo, hi in profile.bands]
    params.append(("dense_efficiency", eff_band[1], eff_band[2]))
    params.append(("rank_imbalance", settings.rank_imbalance[0], settings.rank_imbalance[1]))
    if planning == "host":
        params.append(("plan_scale", settings.plan_band[0], settings.plan_band[1]))
    return params


def _corner(profile: HardwareProfile, eff: float, values: Mapping[str, float], settings: StudySettings) -> _Corner:
    fields_ = {k: v for k, v in values.items() if k not in ("rank_imbalance", "plan_scale")}
    p = replace(profile, dense_efficiency=eff, **fields_) if "dense_efficiency" not in fields_ else replace(profile, **fields_)
    return _Corner(p, values.get("rank_imbalance", settings.rank_imbalance[0]), values.get("plan_scale", 1.0),
                   ",".join(f"{k}={v:g}" for k, v in values.items()))


def _applies_not(plan: TierPlan) -> Dict[str, float]:
    return {"value": 1.0, "low": 1.0, "high": 1.0}


def project(settings: StudySettings, plan_s_per_id: float) -> List[Dict[str, Any]]:
    """One row per profile, workload, planning place, scale and depth: step time, effective
    lead, the tier plan, and speed-ups against reactive and against TorchRec's depth 1 with
    ``{value, low, high}`` over one-at-a-time corners of every stated uncertainty (the
    profile's bands, the MLPerf step's band through the compute calibration, the rank
    imbalance, host planning) and the two corners that combine every input's direction
    against and for proactive fetching."""
    eff_nominal, eff_lo_step, eff_hi_step = (calibrate_efficiency(x) for x in MLPERF_STEP)
    # a longer sourced step is slower compute: the lower efficiency
    eff_band = (eff_nominal, min(eff_lo_step, eff_hi_step), max(eff_lo_step, eff_hi_step))
    worlds = settings.world_sizes
    rows_out: List[Dict[str, Any]] = []
    for profile in settings.profiles:
        for workload in settings.workloads:
            wname = workload.name
            shape = workload.shape
            for world in worlds:
                plan = tier_plan(workload, profile, world)
                resident = gpu_stage_costs(replace(profile, dense_efficiency=eff_nominal), shape, world, 0.0, 0.0, 0.0)
                base_row = {"profile": profile.name, "profile_key": profile.key, "workload": wname,
                            "world_size": world, "tier": profile.tier, "plan": plan.kind, "why": plan.why,
                            "cache_fraction": plan.cache_fraction, "host_cache_fraction": plan.host_cache_fraction,
                            "resident_step_ms": 1e3 * resident.main_s}
                if plan.kind != "tiered":
                    for planning in settings.planning:
                        for depth in settings.depths:
                            rows_out.append({**base_row, "planning": planning, "depth": depth,
                                             "pipeline": _pipeline_name(depth), "effective_depth": float(depth),
                                             "step_ms": 1e3 * resident.main_s if plan.kind == "resident" else None,
                                             "speedup_vs_reactive": _applies_not(plan),
                                             "speedup_vs_depth1": _applies_not(plan), "applies": False})
                    continue
                pops = _popularities(workload, plan, settings.trace, settings.seed)
                traffic = rank_traffic(workload, plan, pops)
                rows, disk = _loads(traffic, world, settings.load_steps, settings.seed + world, settings.load_sd_scale)
                for planning in settings.planning:
                    pcost = plan_s_per_id if planning == "host" else 0.0
                    params = _band_params(profile, eff_band, planning, settings)
                    nominal_c = _corner(profile, eff_nominal, {}, settings)

                    def steps_at(corners: Sequence[_Corner]) -> Dict[int, np.ndarray]:
                        return {d: np.atleast_1d(_corner_steps(corners, shape, world, traffic, rows, disk, pcost, d,
                                                               settings)) for d in settings.depths}

                    oat = [nominal_c] + [_corner(profile, eff_nominal, {name: v}, settings)
                                         for name, lo, hi in params for v in (lo, hi)]
                    s_oat = steps_at(oat)
                    best_d = [d for d in settings.depths if d >= 2] or [max(settings.depths)]
                    gain = np.max(np.stack([s_oat[0] / s_oat[d] for d in best_d]), axis=0)
                    against, favour = {}, {}
                    for i, (name, lo, hi) in enumerate(params):
                        g_lo, g_hi = gain[1 + 2 * i], gain[2 + 2 * i]
                        against[name], favour[name] = (lo, hi) if g_lo <= g_hi else (hi, lo)
                    combined = [_corner(profile, eff_nominal, against, settings),
                                _corner(profile, eff_nominal, favour, settings)]
                    s_comb = steps_at(combined)
                    steps = {d: np.concatenate([s_oat[d], s_comb[d]]) for d in settings.depths}
                    for depth in settings.depths:
                        s = steps[depth]

                        def band(base: int) -> Optional[Dict[str, float]]:
                            if base not in steps:
                                return None
                            vals = steps[base] / s
                            return {"value": float(vals[0]), "low": float(vals.min()), "high": float(vals.max())}

                        lead = traffic.leads[min(depth, 8)] if depth else 0
                        rates = gpu_rates(profile, shape, world, 1.0,
                                          "staged" if planning == "host" and depth != 1 else "mapped")
                        rows_out.append({
                            **base_row, "planning": planning, "depth": depth, "pipeline": _pipeline_name(depth),
                            "effective_depth": float(lead), "step_ms": 1e3 * float(s[0]),
                            "step_ms_corners": [1e3 * float(x) for x in (s.min(), s.max())],
                            "speedup_vs_reactive": band(0), "speedup_vs_depth1": band(1), "applies": True,
                            "fetched_rows_per_step": traffic.fetched, "fetched_rows_sd": traffic.fetched_sd,
                            "hit_rate": traffic.hit_rate, "disk_reads_per_step": traffic.disk_reads,
                            "copy_ms_mean_rank": 1e3 * float(rates.copy_s(traffic.fetched)),
                            "copy_bound": rates.copy_bound, "link_gbps": rates.link_gbps,
                            "disk_ms_mean_rank": 1e3 * float(rates.disk_s(2.0 * traffic.disk_reads))
                            if traffic.disk_reads else 0.0,
                        })
    return rows_out


def _pipeline_name(depth: int) -> str:
    return "reactive" if depth == 0 else ("torchrec_prefetch" if depth == 1 else "proactive")


def profile_projections(settings: StudySettings, rows: Sequence[Mapping[str, Any]]) -> List[Dict[str, Any]]:
    """``profiles``: one entry per hardware profile and workload, with the profile's figures,
    sources and assumptions, the workload's, and its projections ``{scale, cache, depth,
    pipeline, planning, step_ms, speedup_vs_reactive: {value, low, high}, speedup_vs_depth1:
    {value, low, high}, applies}``."""
    out = []
    for profile in settings.profiles:
        for workload in settings.workloads:
            wname = workload.name
            mine = [r for r in rows if r["profile"] == profile.name and r["workload"] == wname]
            out.append({**profile.to_dict(), "workload": wname, "workload_detail": workload.to_dict(),
                        "copy_gbps_used": profile.copy_gbps, "network_gbps_used": profile.nic_gbps,
                        "tier_plans": {r["world_size"]: {"plan": r["plan"], "why": r["why"],
                                                          "cache_fraction": r["cache_fraction"],
                                                          "host_cache_fraction": r["host_cache_fraction"]}
                                       for r in mine},
                        "projections": [{"scale": r["world_size"], "cache": r["cache_fraction"], "depth": r["depth"],
                                         "pipeline": r["pipeline"], "planning": r["planning"],
                                         "effective_depth": r["effective_depth"], "step_ms": r["step_ms"],
                                         "applies": r["applies"],
                                         "speedup_vs_reactive": r["speedup_vs_reactive"],
                                         "speedup_vs_depth1": r["speedup_vs_depth1"]} for r in mine]})
    return out


def _best(rows: Sequence[Mapping[str, Any]]) -> Optional[Mapping[str, Any]]:
    """This product's best depth (2 or deeper) among ``rows`` of one scale."""
    mine = [r for r in rows if r["depth"] >= 2 and r["applies"]]
    return max(mine, key=lambda r: r["speedup_vs_reactive"]["value"]) if mine else None


def _why(best: Mapping[str, Any]) -> str:
    if best["effective_depth"] < best["depth"]:
        return (f"the cache cannot pin {best['depth'] + 1} batches' rows: prefetches run {best['effective_depth']:.0f} "
                f"ahead")
    copy, step = best.get("copy_ms_mean_rank", 0.0), best["step_ms"]
    disk = best.get("disk_ms_mean_rank", 0.0)
    if disk and disk > copy:
        return (f"NVMe reads ({disk:.1f} ms a step at {best.get('disk_reads_per_step', 0):.0f} reads, bounded by reads in "
                f"flight) dominate; the copy takes {copy:.2f} ms")
    return (f"the mean rank's copy takes {copy:.2f} ms ({best.get('copy_bound')}-bound, {best.get('fetched_rows_per_step', 0):,.0f} "
            f"rows) of a {step:.2f} ms step; hit rate {best.get('hit_rate', 0):.2f}")


def verdicts(rows: Sequence[Mapping[str, Any]], planning: Optional[str] = None) -> List[Dict[str, Any]]:
    """Per profile, workload and planning place: per scale whether proactive fetching applies
    (a tier plan), the best depth (2..8, this product) and its speed-up against reactive and
    against TorchRec's depth 1 with bands, where it pays (> :data:`PAYS_ABOVE`), and the
    paper's claim beside it."""
    out = []
    keys = sorted({(r["profile"], r["workload"], r["planning"]) for r in rows})
    for profile, wname, plan_at in keys:
        if planning is not None and plan_at != planning:
            continue
        mine = [r for r in rows if (r["profile"], r["workload"], r["planning"]) == (profile, wname, plan_at)]
        scales = sorted({r["world_size"] for r in mine})
        by_scale: Dict[int, Dict[str, Any]] = {}
        for w in scales:
            at = [r for r in mine if r["world_size"] == w]
            best = _best(at)
            if best is None:
                by_scale[w] = {"applies": False, "why": at[0]["why"], "plan": at[0]["plan"]}
                continue
            by_scale[w] = {"applies": True, "best_depth": best["depth"], "effective_depth": best["effective_depth"],
                           "vs_reactive": best["speedup_vs_reactive"], "vs_depth1": best["speedup_vs_depth1"],
                           "depth1_vs_reactive": next(r for r in at if r["depth"] == 1)["speedup_vs_reactive"],
                           "step_ms": best["step_ms"], "why": _why(best), "cache_fraction": best["cache_fraction"]}
        applied = [w for w in scales if by_scale[w]["applies"]]
        pays = [w for w in applied if by_scale[w]["vs_reactive"]["value"] > PAYS_ABOVE]
        pays_d1 = [w for w in applied if by_scale[w]["vs_depth1"]["value"] > PAYS_ABOVE]
        gains = [by_scale[w]["vs_reactive"]["value"] for w in applied]
        mean = sum(gains) / len(gains) if gains else None
        if not applied:
            paper = "does not apply: no scale tiers this workload on this system (see why)"
        else:
            lo = min(by_scale[w]["vs_reactive"]["low"] for w in applied)
            hi = max(by_scale[w]["vs_reactive"]["high"] for w in applied)
            reproduced = lo <= 1.46 <= hi
            trend = gains[-1] - gains[0]
            paper = (f"{100 * (mean - 1):+.0f}% on average over {applied[0]}-{applied[-1]} GPUs (band "
                     f"{100 * (lo - 1):+.0f}% to {100 * (hi - 1):+.0f}%; paper +46%: "
                     f"{'within the band' if reproduced else 'outside the band'}); "
                     f"{gains[0]:.2f}x at {applied[0]} -> {gains[-1]:.2f}x at {applied[-1]} GPUs"
                     + (" (grows with scale)" if trend > 0.02 else " (does not grow with scale)"))
        out.append({"profile": profile, "workload": wname, "planning": plan_at, "by_scale": by_scale,
                    "applies_at": applied, "pays_at": pays, "pays_vs_depth1_at": pays_d1, "mean_speedup": mean,
                    "vs_paper": paper})
    return out


def sensitivity(settings: StudySettings, plan_s_per_id: float, profile_key: Optional[str] = None,
                workload: Optional[str] = None, world: Optional[int] = None) -> List[Dict[str, Any]]:
    """The headline (best depth of this product, planning on device) against the fixed step
    overhead beyond the sourced step: ``{overhead_ms, speedup_vs_reactive,
    speedup_vs_depth1}`` per overhead in ``settings.overheads_ms`` (everything else nominal)."""
    key, wname, w = settings.headline
    key, wname, w = profile_key or key, workload or wname, world or w
    profile = next((p for p in settings.profiles if p.key == key), None) or profile_named(key)
    wl = next((x for x in settings.workloads if x.name == wname), None) or workload_named(wname)
    out = []
    for ms in settings.overheads_ms:
        s = replace(settings, profiles=(replace(profile, step_overhead_s=ms / 1e3, bands=()),), workloads=(wl,),
                    world_sizes=(w,), planning=("device",), rank_imbalance=(settings.rank_imbalance[0],) * 2)
        rows = project(s, plan_s_per_id)
        best = _best(rows)
        out.append({"overhead_ms": ms, "profile": profile.key, "workload": wname, "scale": w,
                    "applies": best is not None,
                    "best_depth": best["depth"] if best else None,
                    "speedup_vs_reactive": best["speedup_vs_reactive"]["value"] if best else 1.0,
                    "speedup_vs_depth1": best["speedup_vs_depth1"]["value"] if best else 1.0,
                    "depth1_vs_reactive": next((r["speedup_vs_reactive"]["value"] for r in rows if r["depth"] == 1),
                                               1.0)})
    return out


# --------------------------------------------------------------------------------------------
# 3b. NVMe: held out on bench --tier ssd reports


def ssd_validation(reports: Sequence[Mapping[str, Any]]) -> List[Dict[str, Any]]:
    """Each disk configuration of a ``bench --tier ssd`` report (``F["ssd"]``) modelled from
    the report's own disk probe (read latency at one in flight, reads/s at the I/O threads'
    depth), its counted disk reads per step and its ``dram`` configuration's step (the same
    table in DRAM: the machine without the disk), nothing fitted: the step of the schedule
    with a disk hop bounded by reads in flight, against the null model (``dram`` + the reads
    at the probe's reads/s; prefetched: the larger of the two)."""
    from ..model.step_model import disk_read_s

    out = []
    for rep in reports:
        ssd = rep.get("ssd", rep)
        probe = ssd.get("disk_probe") or {}
        if not probe.get("latency_us_one") or not probe.get("reads_per_s_many"):
            continue
        by = {c["name"]: c for c in ssd.get("configs", []) if "error" not in c}
        dram = by.get("dram")
        if dram is None:
            continue
        dram_ms = float(dram["step_ms_mean"])
        lat = probe["latency_us_one"] * 1e-6
        in_flight = float(probe.get("in_flight") or ssd.get("io_threads") or 64)
        ceiling = float(probe["reads_per_s_many"])
        for c in ssd.get("configs", []):
            if c.get("tier") != "disk" or c["name"] == "best" or "error" in c:
                continue
            reads = float(c.get("disk_reads_per_step") or 0.0)
            disk_s = float(disk_read_s(reads, lat, in_flight, ceiling))
            depth, kd = int(c.get("depth") or 0), int(c.get("disk_depth") or c.get("depth") or 0)
            step = dram_ms / 1e3
            costs = StageCosts(0.0, step / 3, 0.0, 2 * step / 3, 0.0, copy_s=0.0, disk_s=disk_s)
            modelled = 1e3 * step_s(costs, depth, disk_depth=max(depth, kd) or None)
            null = null_step_s(dram_ms, 1e3 * reads / ceiling, depth)
            measured = float(c["step_ms_mean"])
            out.append({"report": ssd.get("tier_dir") or "ssd", "config": c["name"], "depth": depth, "disk_depth": kd,
                        "disk_reads_per_step": reads, "reads_in_flight_counted": c.get("reads_in_flight"),
                        "measured_step_ms": measured, "modelled_step_ms": modelled, "null_model_step_ms": null,
                        "error": modelled / measured - 1.0, "null_error": null / measured - 1.0, "held_out": True,
                        "filesystem": ssd.get("filesystem")})
    return out


# --------------------------------------------------------------------------------------------
# the files


#: The files whose code computes the validation and the projection: the fixture records their
#: hash, and tests/test_scaling_model.py fails when they change without regenerating it.
MODEL_SOURCES = ("model/step_model.py", "bench/scaling_study.py", "model/hardware.py", "bench/cache_replay.py")
FIXTURE_COMMAND = "python -m torchrec_proactive.bench.scaling_study fixture [projection.json [ssd.json ...]]"


def model_source_hash() -> str:
    """sha256 over :data:`MODEL_SOURCES` (their bytes, in that order)."""
    h = hashlib.sha256()
    for name in MODEL_SOURCES:
        h.update((Path(__file__).parents[1] / name).read_bytes())
    return h.hexdigest()


def _plan_cost(locality: Sequence[Mapping[str, Any]], settings: StudySettings) -> float:
    if settings.plan_s_per_id is not None:
        return settings.plan_s_per_id
    costs = sorted(c["plan_s_per_id"] for c in locality if c.get("plan_s_per_id"))
    return costs[len(costs) // 2] if costs else 1e-7


def write_study(out_dir: Path, runs: Sequence[Mapping[str, Any]], settings: Optional[StudySettings] = None,
                straggler_runs: Sequence[Mapping[str, Any]] = (),
                extra_runs: Sequence[Tuple[str, Mapping[str, Any]]] = (),
                ssd_reports: Sequence[Mapping[str, Any]] = (),
                validation_runs: Optional[Sequence[Mapping[str, Any]]] = None) -> Dict[str, Any]:
    """Writes ``projection.json`` and ``projection.png`` into ``out_dir``; returns the JSON document
    (with ``files``). ``runs``: the bench reports to validate on (1 and 2 ranks, the calibration
    set among them); ``straggler_runs``: the skewed 1/2/4-rank runs; ``extra_runs``: (label,
    report) of the runs built to tell the model from the null model (held out);
    ``ssd_reports``: ``bench --tier ssd`` JSON for the NVMe validation;
    ``validation_runs``: already reduced runs (a fixture's) instead of the three above."""
    from .scaling_plot import plot_study

    settings = settings or StudySettings()
    out_dir.mkdir(parents=True, exist_ok=True)
    if validation_runs is not None:
        all_runs = [dict(r) for r in validation_runs]
    else:
        all_runs = ([validation_inputs(r) for r in runs]
                    + [validation_inputs(r, "stragglers") for r in straggler_runs]
                    + [validation_inputs(r, label) for label, r in extra_runs])
    fitted = fit(all_runs)
    checks = validate(all_runs, fitted)
    summary = validation_summary(checks)
    if settings.quick:
        # one round of one held-out run: its figures are listed, not judged
        summary["validation_verdict"] = ("not judged: --quick measures one round of one held-out run (a smoke test); "
                                         "run without --quick on an idle machine to validate")
    counted = counter_checks(all_runs)
    locality = locality_checks(settings)
    plan_cost = _plan_cost(locality, settings)
    settings = replace(settings, load_sd_scale=load_spread(locality))
    rows = project(settings, plan_cost)
    ssd_checks = ssd_validation(ssd_reports)
    eff = [calibrate_efficiency(x) for x in MLPERF_STEP]
    doc: Dict[str, Any] = {
        "quick": settings.quick,
        "validation": checks,
        "validation_runs": all_runs,
        "calibration_set": [{"ranks": r, "config": c} for r, c in CALIBRATION],
        "fitted": fitted.to_dict(),
        **summary,
        "validation_max_abs_error": max((abs(c["error"]) for c in checks), default=None),
        "wrong_models": variant_summaries(all_runs, fitted),
        "stragglers": straggler_rows([r for r in all_runs if r.get("label") == "stragglers"], fitted),
        "counter_checks": counted,
        "counter_summary": counter_summary(counted),
        "locality_checks": locality,
        "ssd_validation": ssd_checks,
        "ssd_reports": [r.get("ssd", r) for r in ssd_reports],
        "profiles": profile_projections(settings, rows),
        "workloads": [w.to_dict() for w in settings.workloads],
        "compute_calibration": {"mlperf_step_ms": list(MLPERF_STEP), "dense_efficiency": eff[0],
                                "dense_efficiency_band": [min(eff[1:]), max(eff[1:])], "sources": list(MLPERF_SOURCE)},
        "plan_s_per_id": plan_cost,
        "load_sd_scale": settings.load_sd_scale,
        "plan_source": ("host planning as built: TieredTable.plan timed in the locality checks' replay on this CPU "
                        "(median per id); band x0.5-x2. 'device': planned on the GPU as FBGEMM's UVM cache and the "
                        "DevicePlanner do, taken as free"),
        "rank_imbalance": list(settings.rank_imbalance),
        "projection": rows,
        "verdicts": verdicts(rows),
        "sensitivity": sensitivity(settings, plan_cost),
        "sensitivity_by_workload": [e for w in settings.workloads for scale in (1, 8)
                                    if (w.name, scale) != tuple(settings.headline[1:])
                                    for e in sensitivity(settings, plan_cost, settings.headline[0], w.name, scale)]
        if not settings.quick else [],
        "headline": {"profile": settings.headline[0], "workload": settings.headline[1], "scale": settings.headline[2],
                     "planning": "device"},
        "paper_claim": PAPER_CLAIM,
        "model_source_sha256": model_source_hash(),
        "note": ("a model, not a measurement: two inputs fitted on the named calibration runs, errors reported on "
                 "held-out CPU gloo runs with an emulated link beside a parameter-free null model; projected with "
                 "achievable bandwidths (sources in profiles), compute calibrated on MLPerf's DLRM-dcnv2 step, "
                 "TorchRec's planner cost rules, steady-state cache traffic checked against the real store"),
    }
    png = plot_study(doc, out_dir / "projection.png")
    path = out_dir / "projection.json"
    doc["files"] = [str(png), str(path)]
    path.write_text(json.dumps(doc, indent=1, default=_json_default))
    return doc


def _json_default(x: Any) -> Any:
    if isinstance(x, (np.floating, np.integer)):
        return x.item()
    if isinstance(x, np.ndarray):
        return x.tolist()
    return str(x)


def fixture_document(runs: Sequence[Mapping[str, Any]], ssd_reports: Sequence[Mapping[str, Any]] = ()) -> Dict[str, Any]:
    """The validation fixture: the recorded runs' inputs, the validation the current model
    gives on them, and the hash of the model's source it was computed with."""
    fitted = fit(runs)
    checks = validate(runs, fitted)
    return {"note": f"regenerate with: {FIXTURE_COMMAND} (the runs of a bench --scaling projection.json, or, "
                    "without one, the runs already recorded here)",
            "model_source_sha256": model_source_hash(), "fitted": fitted.to_dict(), "validation": checks,
            **validation_summary(checks), "wrong_models": variant_summaries(runs, fitted),
            "ssd_validation": ssd_validation(ssd_reports), "counter_summary": counter_summary(counter_checks(runs)),
            "validation_runs": list(runs), "ssd_reports": list(ssd_reports)}


def main(argv: Optional[Sequence[str]] = None) -> int:
    """``fixture [projection.json [ssd.json ...]]``: rewrites tests/fixtures/scaling_validation.json
    from a ``bench --scaling`` projection's runs (and its ssd reports, plus any ``bench --tier
    ssd`` JSON given after it)."""
    import sys

    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] != "fixture":
        print(f"usage: {FIXTURE_COMMAND}", file=sys.stderr)
        return 2
    target = Path(__file__).resolve().parents[2] / "tests" / "fixtures" / "scaling_validation.json"
    source = Path(args[1]) if len(args) >= 2 else target
    try:
        doc_in = json.loads(source.read_text())
        runs = doc_in["validation_runs"]
        ssd = list(doc_in.get("ssd_reports") or [])
        for extra in args[2:]:
            rep = json.loads(Path(extra).read_text())
            ssd.append(rep.get("ssd", rep))
    except (OSError, ValueError, KeyError) as e:
        print(f"scaling fixture: cannot read validation_runs from {source}: {e}", file=sys.stderr)
        return 2
    doc = fixture_document(runs, ssd)
    target.write_text(json.dumps(doc, indent=1, default=_json_default) + "\n")
    print(f"wrote {target}: held-out max |error| {doc['held_out_max_abs_error']:.3f}, "
          f"calibration {doc['calibration_max_abs_error']:.3f}; {doc['validation_verdict']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
