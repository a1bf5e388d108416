"""The scaling study: validate the step model on held-out CPU runs, then project it to GPU systems.

1. **Validation on held-out runs.** The bench's measured runs (gloo ranks, emulated link) are
   modelled with each run's measured resident and 100%-cache steps, gloo collectives and
   link parameters as the "hardware", at each configuration's counted effective depth
   (``mean_prefetch_lead``). Two inputs are fitted on :data:`CALIBRATION` only
   (:func:`fit`); every other configuration is a prediction (``held_out``): other depths,
   the 1% cache, other rank counts, and the skewed straggler runs. Entries beyond their
   target are reported with the reason (:func:`miss_reason`), never hidden by a wider gate.
2. **Stragglers**: the straggler runs (1/2/4 ranks, skewed tables, table-wise) give
   reactive, depth 1 (TorchRec's prefetch pipeline) and the best depth
   (:func:`straggler_rows`); the model scales each copy by the slowest rank's factor
   (:func:`~.step_model.straggler_factor`) from counted per-rank, per-step bytes.
3. **Workload figures** that no hardware changes, counted by replaying batches through the
   real store (:mod:`.cache_replay`) on Zipf ids over tables of real size, on generated
   Criteo-format ids, or on an owner's trace: rows fetched and written back per id, hit rate,
   the mean lead of a prefetch, per-step loads; and the planning time per id (this host's CPU).
4. **Projection**: :func:`~.step_model.gpu_stage_costs` per hardware profile (achievable
   figures with sources, TorchRec's cost rules) and scale, :func:`~.step_model.step_s` per
   depth, every speed-up against reactive and against depth 1 with ``{value, low, high}``
   over the corners of the stated uncertainties.

:func:`verdicts` turns the projection into the answer a cluster owner needs: at which scale,
cache size and depth proactive fetching pays, when it stops paying and why, against the
paper's claim (Cho et al., IEEE CAL 2024: +46% on average, scaling better than reactive) and
against what TorchRec ships (depth 1).
"""

from __future__ import annotations

import json
import hashlib
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

from .cache_replay import CachePoint, criteo_id_stream, replay, zipf_fill, zipf_id_stream
from ..model.hardware import PROFILES, HardwareProfile
from ..model.step_model import DLRMShape, StageCosts, gpu_stage_costs, step_s, straggler_factor

__all__ = ["StudySettings", "validate", "workload_figures", "project", "verdicts", "write_study",
           "PAPER_CLAIM", "PAYS_ABOVE"]

PAPER_CLAIM = ("Cho et al., IEEE CAL 2024: proactive fetching of cold rows speeds DLRM training up by 46% on "
               "average over reactive fetching, and scales better with more GPUs")
#: A speed-up below this is "does not pay" (within what a step's noise hides).
PAYS_ABOVE = 1.05


@dataclass(frozen=True)
class StudySettings:
    """What the study replays and projects (defaults: a few seconds of replay on one core)."""

    world_sizes: Tuple[int, ...] = (1, 8, 16, 32, 64, 128, 256, 512, 1024)
    cache_fractions: Tuple[float, ...] = (0.01, 0.05, 0.2)
    depths: Tuple[int, ...] = (0, 1, 2, 4, 8)
    shape: DLRMShape = field(default_factory=DLRMShape)
    #: Zipf ids over tables of Criteo Terabyte's size: its largest tables have 40M rows
    #: (MLPerf DLRM-dcnv2's row cap), so a 1% cache is 400k rows. The replay keeps only the
    #: rows it touches (cache_replay.replay_table), so this costs no 40M-row tensors.
    zipf_tables: int = 4
    zipf_rows: int = 40_000_000
    zipf_alpha: float = 1.05
    #: Criteo-format stand-in: generated Kaggle-layout TSV, preprocessed, its largest tables
    criteo_tables: int = 8
    criteo_batch: int = 1024
    #: Long enough that the cache of a 200k-row table fills and writes back (issue 29: at 16
    #: steps a 20% cache never did); each point says whether its cache filled (``cache_filled``)
    replay_steps: int = 80
    replay_warmup: int = 30
    #: a cache of up to ``max_fill_ids / fill_ids_per_slot`` rows is first filled with that many
    #: earlier Zipf ids per slot, so that it runs full and writes back as in steady state (a
    #: 1% cache of 40M rows needs 400k rows; 80 steps of 4096 ids touch under 200k); larger
    #: caches replay cold and say so (``cache_filled``)
    fill_ids_per_slot: float = 4.0
    max_fill_ids: int = 8_000_000
    profiles: Tuple[HardwareProfile, ...] = PROFILES
    #: an owner's id trace (``[samples, tables]`` .npy) to replay instead of Zipf ids
    trace: Optional[Path] = None
    #: the slowest rank's mean copy over the mean rank's (table-wise shards of unequal tables);
    #: 1.0: row-wise or balanced shards. The band's high end is reported in every speed-up's band.
    rank_imbalance: float = 1.0
    rank_imbalance_high: float = 1.25


# --------------------------------------------------------------------------------------------
# 1. validation

#: The calibration set: the (ranks, configuration) pairs whose measured steps fit the model's
#: two free inputs (host planning seconds per requested row, and per copied row what a lookup
#: waiting for its own copy pays beyond the link).
#: Every other validated configuration is held out: other depths, the 1% cache, 2 ranks, and
#: the skewed multi-rank straggler runs.
CALIBRATION: Tuple[Tuple[int, str], ...] = ((1, "reactive"), (1, "depth_2"))
#: Targets (issue 29): calibration within 10%, held out within 15%. Not gates to widen: a
#: held-out miss is reported with its reason (``validation_misses``).
CALIBRATION_TARGET, HELD_OUT_TARGET = 0.10, 0.15
#: Bench configurations the validation models (depth from the name; cache1*: the 1% cache).
_VALIDATED = ("reactive", "cache1_reactive", "cache1")


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


def _validation_costs(run: Mapping[str, Any], config: Mapping[str, Any], fitted: Fitted) -> StageCosts:
    """The CPU run as "hardware": the run's measured stock all-resident step plus the store's
    own overhead (its 100%-cache step minus that, less the exposed planning), the run's gloo
    collectives, the emulated link (latency + bytes / bandwidth, the slowest rank's bytes:
    :func:`straggler_factor` of the counted per-rank bytes; the engine's host copies run
    inside the link's time), the fitted cost per copied row of a lookup that waits for its
    copy (``wait_s``, reactive only), the fitted planning cost per requested row;
    forward : backward = 1 : 2."""
    world = run["world_size"]
    comm = run.get("comm_s") or {}
    input_a2a, output_a2a, allreduce = (comm.get(k, 0.0) if world > 1 else 0.0
                                        for k in ("input_a2a_s", "output_a2a_s", "allreduce_s"))
    by_name = {c["name"]: c for c in run["configs"]}
    resident_s = by_name["resident"]["step_ms_median"] / 1e3
    full = by_name.get("cache100")
    store_s = 0.0 if full is None else max(
        0.0, full["step_ms_median"] / 1e3 - resident_s - max(0.0, full["plan_ms_per_step"] / 1e3 - output_a2a))
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


#: What :func:`validate` reads of a bench report (kept in projection.json and the fixture, so a
#: validation can be re-checked without re-running anything).
RUN_KEYS = ("world_size", "link", "comm_s", "skew", "label")
CONFIG_KEYS = ("name", "prefetch_depth", "step_ms_median", "bytes_moved_per_step", "plan_ms_per_step",
               "rows_requested_per_step", "rows_fetched_per_step", "rows_written_back_per_step",
               "rows_fetched_at_lookup_per_step",
               "deferred_batches_per_step", "mean_prefetch_lead", "cache_load_factor", "bytes_moved_by_rank_step")


def validation_inputs(run: Mapping[str, Any]) -> Dict[str, Any]:
    """The part of a bench report that :func:`validate` reads."""
    settings = run.get("settings") or {}
    skew = (settings.get("workload") or {}).get("skew", run.get("skew", 0.0))
    return {**{k: run.get(k) for k in RUN_KEYS}, "skew": skew or 0.0,
            "cache_load_factor": settings.get("cache_load_factor", run.get("cache_load_factor")),
            "configs": [{k: c.get(k) for k in CONFIG_KEYS} for c in run["configs"] if "error" not in c]}


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
        return sum((step_s(_validation_costs(r, c, f), _effective_depth(r, c)) / (c["step_ms_median"] / 1e3) - 1) ** 2
                   for r, c in cal)

    grid = [i * 2e-8 for i in range(0, 501)]  # 0 .. 10 us per row
    return Fitted(plan, min(grid, key=sq))


def validate(runs: Sequence[Mapping[str, Any]], fitted: Optional[Fitted] = None) -> List[Dict[str, Any]]:
    """``{ranks, config, depth, skew, cache, measured_step_ms, modelled_step_ms, error, held_out}``
    for the reactive, fixed-depth and 1%-cache configurations of each bench report in ``runs``.
    The model's two free inputs are fitted on :data:`CALIBRATION` only (``held_out`` false);
    every other entry is a prediction. Each run's resident and 100%-cache steps and gloo
    collectives are measured inputs (the machine), so they are not listed."""
    fitted = fitted or fit(runs)
    rows = []
    for run, c in _validated_configs(runs):
        depth = _effective_depth(run, c)
        modelled = 1e3 * step_s(_validation_costs(run, c, fitted), depth)
        rows.append({"ranks": run["world_size"], "config": c["name"], "depth": int(c["prefetch_depth"]),
                     "effective_depth": depth, "skew": run.get("skew") or 0.0,
                     "cache": c.get("cache_load_factor") or (run.get("cache_load_factor") or None),
                     "run": run.get("label") or "bench",
                     "measured_step_ms": c["step_ms_median"], "modelled_step_ms": modelled,
                     "error": modelled / c["step_ms_median"] - 1.0, "held_out": not _is_calibration(run, c)})
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
    if entry["ranks"] > 1 and entry["skew"]:
        return ("skewed multi-rank: the straggler factor comes from one round's counted bytes, and the model gives "
                "every rank's copy engine its own core while the ranks, their fetch workers and link emulations "
                "share 2 (a rank's copy waits for a core the model does not see)")
    if entry["depth"] == 0:
        return ("reactive: what a lookup waiting for its copy pays beyond the link (waking the thread, binding "
                "rows) differs from the fitted per-row cost")
    return ("proactive: the fetch worker and the link emulation compete with the ranks for 2 cores; the model "
            "gives the copy engine a core of its own")


def validation_summary(checks: Sequence[Mapping[str, Any]]) -> Dict[str, Any]:
    """Max |error| in calibration and held out, and every entry beyond its target with its reason."""
    cal = [abs(c["error"]) for c in checks if not c["held_out"]]
    held = [abs(c["error"]) for c in checks if c["held_out"]]
    misses = [{"ranks": c["ranks"], "config": c["config"], "run": c.get("run"), "error": c["error"],
               "why": miss_reason(c)}
              for c in checks if abs(c["error"]) > (HELD_OUT_TARGET if c["held_out"] else CALIBRATION_TARGET)]
    return {"calibration_max_abs_error": max(cal, default=None), "held_out_max_abs_error": max(held, default=None),
            "held_out_count": len(held), "targets": {"calibration": CALIBRATION_TARGET, "held_out": HELD_OUT_TARGET},
            "misses": misses}


# --------------------------------------------------------------------------------------------
# 1b. stragglers: measured multi-rank runs (1, 2, 4 gloo ranks, skewed tables, table-wise)


def straggler_rows(runs: Sequence[Mapping[str, Any]], fitted: Fitted) -> List[Dict[str, Any]]:
    """``{ranks, skew, reactive_ms, depth1_ms, best_depth, best_depth_ms}`` per straggler run,
    measured, with the model's figures and the counted straggler factors next to them.
    Depth 1 is the schedule of TorchRec's prefetch pipeline (``PrefetchTrainPipelineSparseDist``
    with FBGEMM's UVM cache: the next batch's misses fetched during this one)."""
    out = []
    for run in runs:
        by = {c["name"]: c for c in run["configs"] if "error" not in c}
        if "reactive" not in by or "depth_1" not in by:
            continue
        deeper = {n: c for n, c in by.items() if n.startswith("depth_")}
        best = min(deeper.values(), key=lambda c: c["step_ms_median"])
        per_rank = lambda c: c.get("bytes_moved_by_rank_step") or []  # noqa: E731
        model = {n: 1e3 * step_s(_validation_costs(run, c, fitted), _effective_depth(run, c))
                 for n, c in by.items() if n == "reactive" or n.startswith("depth_")}
        out.append({
            "ranks": run["world_size"], "skew": run.get("skew") or 0.0,
            "reactive_ms": by["reactive"]["step_ms_median"], "depth1_ms": by["depth_1"]["step_ms_median"],
            "best_depth": best["prefetch_depth"], "best_depth_ms": best["step_ms_median"],
            "best_vs_reactive": by["reactive"]["step_ms_median"] / best["step_ms_median"],
            "best_vs_depth1": by["depth_1"]["step_ms_median"] / best["step_ms_median"],
            "straggler_factor": {n: (straggler_factor(per_rank(c), int(c["prefetch_depth"]))
                                     if len(per_rank(c)) > 1 else 1.0)
                                 for n, c in by.items() if n in model},
            "modelled_ms": model,
            "depth1_is": "TorchRec's prefetch pipeline schedule (next batch's misses fetched during this step)",
        })
    return out


# --------------------------------------------------------------------------------------------
# 2. workload figures


def _replay_ids_per_step(settings: StudySettings) -> int:
    return max(1, int(round(settings.shape.batch_per_gpu * settings.shape.ids_per_feature)))


def check_trace(settings: StudySettings) -> None:
    """Raises ``ValueError`` naming the trace, the value and the limit when ``settings.trace``
    cannot be replayed (shape, dtype, negative or too-large ids in the steps replayed): the
    CLI calls it before any bench runs."""
    if settings.trace is not None:
        trace_id_stream(settings.trace, _replay_ids_per_step(settings), settings.replay_steps, settings.zipf_rows)


def workload_figures(settings: StudySettings, work_dir: Path) -> List[CachePoint]:
    """Replays the study's ids at every cache fraction and depth of ``settings``: the owner's
    trace when given (``trace``: an ``[samples, tables]`` id array, e.g. a TorchRec-
    preprocessed Criteo day's ``*_sparse.npy``), else Zipf ids over tables of
    ``zipf_rows`` rows and Criteo-format generated data."""
    steps = settings.replay_steps
    ids = _replay_ids_per_step(settings)
    if settings.trace is not None:
        sources = {"trace": trace_id_stream(settings.trace, ids, steps, settings.zipf_rows)}
    else:
        sources = {
            "zipf": zipf_id_stream(settings.zipf_tables, settings.zipf_rows, ids, steps, settings.zipf_alpha),
            "criteo": criteo_id_stream(work_dir, settings.criteo_batch, min(steps, 24), settings.criteo_tables,
                                       max_cardinality=200_000),
        }
    out = []
    for name, tables in sources.items():
        warmup = min(settings.replay_warmup, len(tables[0][1]) // 2)
        for fraction in settings.cache_fractions:
            fills = None
            slots = fraction * settings.zipf_rows
            if name == "zipf" and settings.fill_ids_per_slot and slots * settings.fill_ids_per_slot <= settings.max_fill_ids:
                # steady state: a history of fill_ids_per_slot ids per cache row runs first
                n = int(slots * settings.fill_ids_per_slot)
                fills = [zipf_fill(rows, settings.zipf_alpha, n, seed=1 + i) for i, (rows, _) in enumerate(tables)]
            for depth in settings.depths:
                out.append(replay(name, tables, fraction, depth, warmup=warmup, fills=fills))
    return out


def trace_id_stream(path: Path, ids_per_step: int, num_steps: int, rows: Optional[int] = None
                    ) -> List[Tuple[int, List[Any]]]:
    """Per table and step, the ids of an owner's trace: ``.npy`` of shape ``[samples, tables]``
    (TorchRec's Criteo preprocessing writes ``day_N_sparse.npy`` so). A table's rows: ``rows``
    if given, else its largest id + 1."""
    import numpy as np

    try:
        data = np.load(path, mmap_mode="r")
    except (OSError, ValueError) as e:
        raise ValueError(f"--scaling-trace {str(path)!r}: not a readable .npy id array ({e})") from None
    if data.ndim != 2 or data.shape[0] < ids_per_step * 2:
        raise ValueError(f"--scaling-trace {str(path)!r}: expected [samples, tables] with at least "
                         f"{ids_per_step * 2} samples (2 steps of {ids_per_step}), got shape {tuple(data.shape)}")
    if data.dtype.kind not in "iu":  # (a float id would be truncated into another row, silently)
        raise ValueError(f"--scaling-trace {str(path)!r}: expected integer ids, got dtype {data.dtype}")
    steps = min(num_steps, data.shape[0] // ids_per_step)
    block = np.asarray(data[: steps * ids_per_step], dtype=np.int64)
    if (block < 0).any():
        raise ValueError(f"--scaling-trace {str(path)!r}: ids must be >= 0, found {int(block.min())}")
    out = []
    for f in range(block.shape[1]):
        col = block[:, f]
        n = rows if rows is not None else int(col.max()) + 1
        if int(col.max()) >= n:
            raise ValueError(f"--scaling-trace {str(path)!r}: table {f} has id {int(col.max())} >= rows {n}")
        out.append((n, [col[t * ids_per_step:(t + 1) * ids_per_step] for t in range(steps)]))
    return out


# --------------------------------------------------------------------------------------------
# 3. projection


#: Where planning runs in a projection: ``host`` as built (this CPU's measured cost per id,
#: from the replay through the real store; hidden only behind the output all-to-all),
#: ``device`` as FBGEMM's UVM cache plans (on the GPU, off the host: free here).
PLANNING = ("host", "device")
#: The host planning cost's band: this CPU's measured cost, x0.5 (a faster host) to x2 (a
#: busier one: data loading shares it).
PLAN_BAND = (0.5, 2.0)


def plan_cost_per_id(figures: Sequence[CachePoint]) -> float:
    """The median planning seconds per id over every replay (one figure: it is host CPU time,
    noisy on a shared machine, and nearly independent of cache size and depth)."""
    costs = sorted(p.plan_s_per_id for p in figures)
    return costs[len(costs) // 2]


def _rank_load(point: CachePoint) -> List[float]:
    """One rank's rows moved per step (its tables summed)."""
    series = point.moved_rows_by_table
    if not series:
        return []
    length = min(len(x) for x in series)
    return [sum(x[t] for x in series) for t in range(length)]


def copy_factor(point: CachePoint, world: int, imbalance: float) -> float:
    """The slowest of ``world`` ranks' copy over the mean rank's at this point's depth:
    ``imbalance`` (persistent: table-wise shards of unequal tables) x ``E[max]`` over ranks of
    the replayed per-step load's ``depth + 1``-step means (batch-to-batch variance)."""
    load = _rank_load(point)
    depth = int(round(point.mean_lead))
    spread = straggler_factor([load], depth, ranks=world) if load and sum(load) else 1.0
    return max(1.0, imbalance * spread)


def _corners(profile: HardwareProfile, planning: str, imbalance_band: Tuple[float, float]) -> List[Tuple[Any, float, float]]:
    """(profile, plan scale, imbalance) at every corner of the stated uncertainties."""
    import itertools

    axes = [[(name, lo), (name, hi)] for name, lo, hi in profile.bands]
    out = []
    for combo in itertools.product(*axes) if axes else [()]:
        p = replace(profile, **dict(combo))
        for plan in (PLAN_BAND if planning == "host" else (1.0,)):
            for imb in sorted(set(imbalance_band)):
                out.append((p, plan, imb))
    return out


def project(settings: StudySettings, figures: Sequence[CachePoint], source: Optional[str] = None) -> List[Dict[str, Any]]:
    """Step time per profile, planning place, scale, cache fraction and depth (one row each),
    from the ``source`` data's workload figures, with stragglers (:func:`copy_factor`): reactive
    waits for the slowest rank's copy of each batch, depth k for its k + 1-batch mean.
    Speed-ups against reactive and against depth 1 (TorchRec's prefetch pipeline) carry
    ``{value, low, high}`` over the corners of the profile's ``bands``, the planning band and
    the imbalance band. ``resident_step_ms``: every row in device memory."""
    source = source or ("trace" if settings.trace is not None else "zipf")
    rows = []
    points = {(p.cache_fraction, p.depth): p for p in figures if p.source == source}
    host_plan = plan_cost_per_id(figures)
    imb_band = (settings.rank_imbalance, settings.rank_imbalance_high)
    for profile in settings.profiles:
        for planning in PLANNING:
            corners = _corners(profile, planning, imb_band)
            for world in settings.world_sizes:
                resident = gpu_stage_costs(profile, settings.shape, world, 0.0, 0.0, 0.0)
                for fraction in settings.cache_fractions:
                    def step_ms(prof: HardwareProfile, plan_scale: float, imb: float, depth: int) -> Tuple[float, Any]:
                        p = points[(fraction, depth)]
                        costs = gpu_stage_costs(prof, settings.shape, world, p.fetched_rows_per_id,
                                                p.written_back_rows_per_id,
                                                host_plan * plan_scale if planning == "host" else 0.0,
                                                copy_factor(p, world, imb))
                        return 1e3 * step_s(costs, p.mean_lead), costs

                    nominal = {d: step_ms(profile, 1.0, settings.rank_imbalance, d) for d in settings.depths}
                    corner = [{d: step_ms(p, ps, imb, d)[0] for d in settings.depths} for p, ps, imb in corners]
                    for depth in sorted(settings.depths):
                        p = points[(fraction, depth)]
                        ms, costs = nominal[depth]

                        def band(base: int) -> Optional[Dict[str, float]]:
                            if base not in nominal:
                                return None
                            vals = [c[base] / c[depth] for c in corner]
                            return {"value": nominal[base][0] / ms, "low": min(vals), "high": max(vals)}

                        vs_reactive, vs_depth1 = band(0), band(1)
                        rows.append({"profile": profile.name, "planning": planning, "world_size": world,
                                     "cache_fraction": fraction, "depth": depth, "effective_depth": p.mean_lead,
                                     "hit_rate": p.hit_rate, "cache_filled": p.cache_filled,
                                     "cache_rows_per_table": p.cache_rows_per_table,
                                     "copy_factor": copy_factor(p, world, settings.rank_imbalance),
                                     "step_ms": ms, "resident_step_ms": 1e3 * resident.main_s,
                                     "speedup_vs_reactive": vs_reactive["value"] if vs_reactive else None,
                                     "speedup_vs_reactive_band": vs_reactive,
                                     "speedup_vs_depth1": vs_depth1,
                                     "stages_ms": {k: 1e3 * v for k, v in costs.to_dict().items()}})
    return rows


def profile_projections(settings: StudySettings, rows: Sequence[Mapping[str, Any]]) -> List[Dict[str, Any]]:
    """``profiles``: each profile's figures, sources and assumptions, with its projections
    ``{scale, cache, depth, planning, step_ms, speedup_vs_reactive: {value, low, high},
    speedup_vs_depth1: {value, low, high}}``."""
    out = []
    for profile in settings.profiles:
        mine = [r for r in rows if r["profile"] == profile.name]
        out.append({**profile.to_dict(), "copy_gbps_used": profile.copy_gbps, "network_gbps_used": profile.nic_gbps,
                    "projections": [{"scale": r["world_size"], "cache": r["cache_fraction"], "depth": r["depth"],
                                     "planning": r["planning"], "step_ms": r["step_ms"],
                                     "speedup_vs_reactive": r["speedup_vs_reactive_band"],
                                     "speedup_vs_depth1": r["speedup_vs_depth1"]} for r in mine]})
    return out


def _why(row: Mapping[str, Any]) -> str:
    st = row["stages_ms"]
    main = sum(st[k] for k in ("input_a2a_s", "forward_s", "output_a2a_s", "backward_s", "allreduce_s"))
    if row["effective_depth"] < 0.5:
        return "the cache cannot hold the rows of k+1 batches, so prefetches wait until their own step"
    if st["plan_s"] > max(st["copy_s"], st["output_a2a_s"]):
        return (f"host planning ({st['plan_s']:.2f} ms a step) outlasts both the copy ({st['copy_s']:.2f} ms) and "
                f"the output all-to-all ({st['output_a2a_s']:.2f} ms) it hides behind: both pipelines wait for it")
    if st["copy_s"] < 0.05 * main:
        return (f"the copy ({st['copy_s']:.2f} ms) is under 5% of the step ({main:.2f} ms): there is little to hide "
                f"(collectives and compute dominate)")
    if st["copy_s"] > main:
        return f"the copy engine ({st['copy_s']:.2f} ms a batch) is the bottleneck: hiding it cannot go below it"
    return (f"the copy ({st['copy_s']:.2f} ms, the slowest rank's) is hidden behind a {main:.2f} ms step: the gain "
            f"is about 1 + reactive's copy / step; reactive's copy grows with the ranks it waits for (stragglers) "
            f"while the collectives lengthen the step")


def verdicts(rows: Sequence[Mapping[str, Any]]) -> List[Dict[str, Any]]:
    """Per profile, planning place and cache fraction: the best depth's speed-up at each scale,
    where it pays (> :data:`PAYS_ABOVE`), where it stops and why, against :data:`PAPER_CLAIM`."""
    out = []
    keys = sorted({(r["profile"], r["planning"], r["cache_fraction"]) for r in rows})
    for profile, planning, fraction in keys:
        best: Dict[int, Mapping[str, Any]] = {}
        for r in rows:
            if (r["profile"], r["planning"], r["cache_fraction"]) != (profile, planning, fraction) or r["depth"] == 0:
                continue
            w = r["world_size"]
            if w not in best or r["speedup_vs_reactive"] > best[w]["speedup_vs_reactive"]:
                best[w] = r
        scales = sorted(best)
        gains = [best[w]["speedup_vs_reactive"] for w in scales]
        pays = [w for w in scales if best[w]["speedup_vs_reactive"] > PAYS_ABOVE]
        stops = next((w for w in scales if pays and w > pays[0] and w not in pays), None)
        mean_gain = sum(gains) / len(gains)
        reason_at = stops if stops is not None else (scales[-1] if pays else scales[0])
        out.append({
            "profile": profile, "planning": planning, "cache_fraction": fraction,
            "speedup_by_scale": {w: best[w]["speedup_vs_reactive"] for w in scales},
            "speedup_band_by_scale": {w: best[w].get("speedup_vs_reactive_band") for w in scales},
            # against TorchRec's prefetch pipeline (depth 1), the baseline users run today
            "speedup_vs_depth1_by_scale": {w: best[w].get("speedup_vs_depth1") for w in scales},
            "best_depth_by_scale": {w: best[w]["depth"] for w in scales},
            "pays_at": pays, "stops_paying_at": stops, "why": _why(best[reason_at]), "mean_speedup": mean_gain,
            "vs_paper": (f"{100 * (mean_gain - 1):+.0f}% on average over {scales[0]}-{scales[-1]} GPUs (paper: +46%); "
                         f"{gains[0]:.2f}x at {scales[0]} -> {gains[-1]:.2f}x at {scales[-1]} GPUs"),
        })
    return out


# --------------------------------------------------------------------------------------------
# the files


#: The files whose code computes the validation and the projection: the fixture records their
#: hash, and tests/test_scaling_model.py fails when they change without regenerating it.
MODEL_SOURCES = ("model/step_model.py", "bench/scaling_study.py", "model/hardware.py", "bench/cache_replay.py")
FIXTURE_COMMAND = "python -m torchrec_proactive.bench.scaling_study fixture [projection.json]"


def model_source_hash() -> str:
    """sha256 over :data:`MODEL_SOURCES` (their bytes, in that order)."""
    h = hashlib.sha256()
    for name in MODEL_SOURCES:
        h.update((Path(__file__).parents[1] / name).read_bytes())
    return h.hexdigest()


def write_study(out_dir: Path, runs: Sequence[Mapping[str, Any]], settings: Optional[StudySettings] = None,
                figures: Optional[Sequence[CachePoint]] = None,
                straggler_runs: Sequence[Mapping[str, Any]] = ()) -> Dict[str, Any]:
    """Writes ``projection.json`` and ``projection.png`` into ``out_dir``; returns the JSON document
    (with ``files``). ``runs``: the bench reports to validate on (1 and 2 ranks, the calibration
    set among them); ``straggler_runs``: the skewed 1/2/4-rank runs (held out)."""
    from .scaling_plot import plot_study

    settings = settings or StudySettings()
    out_dir.mkdir(parents=True, exist_ok=True)
    figures = list(figures) if figures is not None else workload_figures(settings, out_dir / "criteo_data")
    all_runs = [validation_inputs(r) for r in runs] + [
        {**validation_inputs(r), "label": "stragglers"} for r in straggler_runs]
    fitted = fit(all_runs)
    checks = validate(all_runs, fitted)
    summary = validation_summary(checks)
    rows = project(settings, figures)
    doc: Dict[str, Any] = {
        "validation": checks,
        "validation_runs": all_runs,
        "calibration_set": [{"ranks": r, "config": c} for r, c in CALIBRATION],
        "fitted": fitted.to_dict(),
        **summary,
        "validation_max_abs_error": max((abs(c["error"]) for c in checks), default=None),
        "stragglers": straggler_rows([r for r in all_runs if r.get("label") == "stragglers"], fitted),
        "profiles": profile_projections(settings, rows),
        "workload": settings.shape.to_dict(),
        "workload_figures": [p.to_dict() for p in figures],
        # A cache fraction is a share of the table's real rows; whether a cache holds k + 1
        # batches depends on its absolute size.
        "replay": {"zipf_tables": settings.zipf_tables, "zipf_rows_per_table": settings.zipf_rows,
                   "zipf_alpha": settings.zipf_alpha, "steps": settings.replay_steps,
                   "warmup": settings.replay_warmup, "trace": str(settings.trace) if settings.trace else None,
                   "reduced": settings.zipf_rows < StudySettings().zipf_rows},
        "plan_s_per_id": plan_cost_per_id(figures),
        "plan_source": ("host planning as built: TieredTable.plan timed in the replay on this CPU (median per id); "
                        "band x0.5-x2. 'device': planned on the GPU as FBGEMM's UVM cache does, taken as free"),
        "rank_imbalance": [settings.rank_imbalance, settings.rank_imbalance_high],
        "projection": rows,
        "verdicts": verdicts(rows),
        "paper_claim": PAPER_CLAIM,
        "model_source_sha256": model_source_hash(),
        "note": ("a model, not a measurement: two inputs fitted on the named calibration runs, errors reported on "
                 "held-out CPU gloo runs with an emulated link; projected with achievable bandwidths (sources in "
                 "profiles), TorchRec's planner cost rules, and stragglers from the replay's per-step loads"),
    }
    png = plot_study(doc, out_dir / "projection.png")
    path = out_dir / "projection.json"
    doc["files"] = [str(png), str(path)]
    path.write_text(json.dumps(doc, indent=2, default=str))
    return doc


def fixture_document(runs: Sequence[Mapping[str, Any]]) -> Dict[str, Any]:
    """The validation fixture: the recorded runs' inputs, the validation the current model
    gives on them, and the hash of the model's source it was computed with."""
    fitted = fit(runs)
    checks = validate(runs, fitted)
    return {"note": f"regenerate with: {FIXTURE_COMMAND} (the runs of a bench --scaling projection.json, or, "
                    "without one, the runs already recorded here)",
            "model_source_sha256": model_source_hash(), "fitted": fitted.to_dict(), "validation": checks,
            **validation_summary(checks), "validation_runs": list(runs)}


def main(argv: Optional[Sequence[str]] = None) -> int:
    """``fixture [projection.json]``: rewrites tests/fixtures/scaling_validation.json."""
    import sys

    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] != "fixture" or len(args) > 2:
        print(f"usage: {FIXTURE_COMMAND}", file=sys.stderr)
        return 2
    target = Path(__file__).resolve().parents[2] / "tests" / "fixtures" / "scaling_validation.json"
    source = Path(args[1]) if len(args) == 2 else target
    try:
        runs = json.loads(source.read_text())["validation_runs"]
    except (OSError, ValueError, KeyError) as e:
        print(f"scaling fixture: cannot read validation_runs from {source}: {e}", file=sys.stderr)
        return 2
    doc = fixture_document(runs)
    target.write_text(json.dumps(doc, indent=1) + "\n")
    print(f"wrote {target}: held-out max |error| {doc['held_out_max_abs_error']:.3f}, "
          f"calibration {doc['calibration_max_abs_error']:.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
