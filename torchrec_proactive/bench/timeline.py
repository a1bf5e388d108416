"""Pipeline timelines from recorded trace events (Chrome trace JSON, PNG, summary numbers).

The training pipeline records, per rank, one :class:`TraceEvent` per phase of a batch (the
dict form ``{lane, name, batch, start_s, end_s, rank}`` is accepted everywhere an event is).
Lanes, top to bottom in every picture:

==============  ===================================================
``data_dist``   input all-to-all of the sparse ids ("a2a ids b5")
``disk``        disk -> host cache reads of the batch's rows (``bench --tier ssd``: "read b9")
``fetch``       host -> device copy of the batch's cold rows ("fetch b7")
``compute``     forward / backward ("fwd b3", "bwd b3")
``output_comm`` pooled-embedding all-to-all (forward and backward)
``allreduce``   dense-gradient all-reduce
==============  ===================================================

Unknown lanes are kept and placed after these, in alphabetical order; in pictures a lane
``"<lane>:<n>"`` (more rows of one lane, for events of it that overlap: ``disk:2``) is drawn
right below ``<lane>``.

* :func:`write_chrome_trace` - ``{"traceEvents": [...]}`` with ``"X"`` events, times in µs,
  one process per configuration, one thread per (rank, lane); opens in chrome://tracing and
  Perfetto.
* :func:`render_timeline_png` - the picture of the paper's Fig. 1: one subplot per
  configuration, one row per lane (per rank), bars coloured by batch index, each subplot
  stating its median step and stall per step (the bench table's, when given).
* :func:`summarize` - busy time per lane and how much of the fetch time is hidden.

Nothing here imports TorchRec or torch; matplotlib is used through its Agg canvas only (no
pyplot, no global backend switch).
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, Dict, Iterable, List, Mapping, Optional, Sequence, Tuple, Union

__all__ = [
    "LANES",
    "LANE_LABELS",
    "TraceEvent",
    "lane_order",
    "write_chrome_trace",
    "render_timeline_png",
    "timeline_figure",
    "batch_colour",
    "BATCH_COLOURS",
    "MIN_STALL_WIDTH",
    "summarize",
    "dump_events",
    "load_events",
]

#: Known lanes, in display order (top to bottom) and Chrome-trace thread order.
LANES: Tuple[str, ...] = ("data_dist", "disk", "fetch", "compute", "output_comm", "allreduce")

#: Human-readable lane names used as row labels.
LANE_LABELS: Dict[str, str] = {
    "data_dist": "data-dist comm",
    "disk": "disk read",
    "fetch": "row fetch",
    "compute": "compute",
    "output_comm": "output comm",
    "allreduce": "all-reduce",
}

# Lanes that do no useful work: time spent in them does not hide a fetch.
_IDLE_LANES = frozenset({"stall", "wait", "idle"})
# Lanes whose end marks the end of a training step of a batch.
_STEP_LANES = ("compute", "output_comm", "allreduce")

EventLike = Union["TraceEvent", Mapping[str, Any]]


@dataclass(frozen=True)
class TraceEvent:
    """One phase of one batch on one rank.

    Invariants (checked on construction): ``lane`` is a non-empty string, ``batch`` and
    ``rank >= 0`` are ints, ``start_s`` and ``end_s`` are finite and ``end_s >= start_s``.
    Times are ``time.perf_counter()`` seconds (any common origin per configuration).
    """

    lane: str
    name: str
    batch: int
    start_s: float
    end_s: float
    rank: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.lane, str) or not self.lane:
            raise ValueError(f"TraceEvent.lane = {self.lane!r} must be a non-empty string")
        if not isinstance(self.name, str):
            raise ValueError(f"TraceEvent.name = {self.name!r} must be a string")
        for fld in ("batch", "rank"):
            v = getattr(self, fld)
            if isinstance(v, bool) or not isinstance(v, int):
                raise ValueError(f"TraceEvent.{fld} = {v!r} must be an int")
        if self.rank < 0:
            raise ValueError(f"TraceEvent.rank = {self.rank} is below the limit 0")
        for fld in ("start_s", "end_s"):
            v = getattr(self, fld)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
                raise ValueError(f"TraceEvent.{fld} = {v!r} must be a finite number")
        if self.end_s < self.start_s:
            raise ValueError(
                f"TraceEvent.end_s = {self.end_s!r} is below the limit start_s = {self.start_s!r} "
                f"({self.name!r}, lane {self.lane!r})"
            )

    @property
    def duration_s(self) -> float:
        """``end_s - start_s`` (>= 0)."""
        return self.end_s - self.start_s

    def to_dict(self) -> Dict[str, Any]:
        """Plain JSON-able dict; ``TraceEvent.from_dict(e.to_dict()) == e``."""
        return asdict(self)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "TraceEvent":
        """Build from a dict with keys ``lane, name, batch, start_s, end_s`` (``rank`` optional,
        default 0). Numbers are coerced (``batch``/``rank`` to int, times to float); extra keys
        are ignored. Raises ``ValueError`` naming a missing key."""
        missing = [k for k in ("lane", "name", "batch", "start_s", "end_s") if k not in d]
        if missing:
            raise ValueError(f"trace event dict lacks key(s) {missing}: {dict(d)!r}")
        return cls(
            lane=str(d["lane"]),
            name=str(d["name"]),
            batch=int(d["batch"]),
            start_s=float(d["start_s"]),
            end_s=float(d["end_s"]),
            rank=int(d.get("rank", 0)),
        )


# --------------------------------------------------------------------------------------------
# helpers


def _coerce(events: Iterable[EventLike]) -> List[TraceEvent]:
    out: List[TraceEvent] = []
    for e in events:
        if isinstance(e, TraceEvent):
            out.append(e)
        elif isinstance(e, Mapping):
            out.append(TraceEvent.from_dict(e))
        else:
            raise ValueError(f"trace event must be a TraceEvent or a dict, got {type(e).__name__}")
    return out


def _coerce_configs(events_by_config: Mapping[str, Sequence[EventLike]]) -> Dict[str, List[TraceEvent]]:
    if not isinstance(events_by_config, Mapping):
        raise ValueError(
            f"events_by_config must be a mapping configuration -> events, got {type(events_by_config).__name__}"
        )
    if len(events_by_config) == 0:
        raise ValueError("events_by_config is empty: need at least one configuration")
    return {str(k): _coerce(v) for k, v in events_by_config.items()}


def lane_order(events: Iterable[EventLike]) -> List[str]:
    """Lanes present in ``events``: the known :data:`LANES` first (in that order), then the
    others alphabetically. Deterministic; every lane of ``events`` appears exactly once."""
    present = {e.lane for e in _coerce(events)}
    return [l for l in LANES if l in present] + sorted(present - set(LANES))


def _merge(intervals: Iterable[Tuple[float, float]]) -> List[Tuple[float, float]]:
    """Union of closed intervals as a sorted list of disjoint intervals."""
    merged: List[Tuple[float, float]] = []
    for s, e in sorted(intervals):
        if merged and s <= merged[-1][1]:
            if e > merged[-1][1]:
                merged[-1] = (merged[-1][0], e)
        else:
            merged.append((s, e))
    return merged


def _length(merged: Sequence[Tuple[float, float]]) -> float:
    return float(sum(e - s for s, e in merged))


def _intersection_length(a: Sequence[Tuple[float, float]], b: Sequence[Tuple[float, float]]) -> float:
    """Length of the intersection of two merged interval lists (two-pointer sweep)."""
    i = j = 0
    total = 0.0
    while i < len(a) and j < len(b):
        lo = max(a[i][0], b[j][0])
        hi = min(a[i][1], b[j][1])
        if hi > lo:
            total += hi - lo
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return total


def _step_starts(events: Sequence[TraceEvent]) -> List[Tuple[int, float]]:
    """(batch, first start on the compute lane) sorted by batch; all lanes if no compute."""
    pool = [e for e in events if e.lane == "compute"] or list(events)
    first: Dict[int, float] = {}
    for e in pool:
        if e.batch not in first or e.start_s < first[e.batch]:
            first[e.batch] = e.start_s
    return sorted(first.items())


def _mean_step(events: Sequence[TraceEvent]) -> Optional[float]:
    starts = _step_starts(events)
    if len(starts) < 2:
        return None
    return (starts[-1][1] - starts[0][1]) / (len(starts) - 1)


def _step_end(events: Sequence[TraceEvent], batch: int) -> float:
    """End of the training step of ``batch``: last end on the step lanes (any lane if none)."""
    pool = [e for e in events if e.batch == batch and e.lane in _STEP_LANES] or [
        e for e in events if e.batch == batch
    ]
    return max(e.end_s for e in pool)


def _skip_warmup(events: Sequence[TraceEvent], warmup_batches: int) -> List[TraceEvent]:
    """Events of one rank after the step of its ``warmup_batches``-th batch ended, clipped to
    start there (work of later batches that overlapped the warm-up is dropped with it)."""
    if warmup_batches <= 0:
        return list(events)
    batches = [b for b, _ in _step_starts(events)]
    if warmup_batches >= len(batches):
        return []
    cut = _step_end(events, batches[warmup_batches - 1])
    out: List[TraceEvent] = []
    for e in events:
        if e.end_s > cut or (e.end_s == cut and e.start_s == cut):
            out.append(e if e.start_s >= cut else replace(e, start_s=cut))
    return out


# --------------------------------------------------------------------------------------------
# summary


def _rank_summary(events: Sequence[TraceEvent]) -> Dict[str, Any]:
    by_lane: Dict[str, List[Tuple[float, float]]] = {}
    for e in events:
        by_lane.setdefault(e.lane, []).append((e.start_s, e.end_s))
    merged = {lane: _merge(iv) for lane, iv in by_lane.items()}
    fetch = merged.get("fetch", [])
    others = _merge(
        iv for lane, ivs in merged.items() if lane != "fetch" and lane not in _IDLE_LANES for iv in ivs
    )
    fetch_busy = _length(fetch)
    overlap = _intersection_length(fetch, others)
    return {
        "busy_s": {lane: _length(merged[lane]) for lane in lane_order(events)},
        "fetch_busy_s": fetch_busy,
        "fetch_overlap_s": overlap,
        "fetch_exposed_s": fetch_busy - overlap,
        "fetch_overlap_fraction": overlap / fetch_busy if fetch_busy > 0 else 0.0,
        "span_s": (max(e.end_s for e in events) - min(e.start_s for e in events)) if events else 0.0,
        "mean_step_s": _mean_step(events),
        "num_batches": len({e.batch for e in events}),
    }


def summarize(events: Sequence[EventLike], *, warmup_batches: int = 0) -> Dict[str, Any]:
    """Busy time per lane and the fetch/compute overlap of one configuration's events.

    All interval arithmetic is per rank, on the *union* of a lane's events (two overlapping
    events of one lane count once), and the per-rank figures are summed:

    * ``busy_s[lane]`` - time the lane is busy.
    * ``fetch_overlap_s`` - fetch time during which another lane of the same rank (compute or
      any communication; not a ``stall``/``wait``/``idle`` lane) is busy.
    * ``fetch_overlap_fraction = fetch_overlap_s / fetch_busy_s`` in [0, 1] (0.0 when there is
      no fetch at all; check ``fetch_busy_s``).
    * ``fetch_exposed_s`` (= ``stall_s``) - fetch time during which nothing else runs; when a
      ``stall`` lane (measured blocking waits) is present, its busy time instead.
    * ``mean_step_s`` - mean distance between first compute starts of consecutive batches,
      averaged over ranks (``None`` with fewer than two batches).

    ``warmup_batches`` drops, per rank, everything before the end of the step of the
    ``warmup_batches``-th batch (by compute order); events straddling that point are clipped.
    ``per_rank`` holds the same figures for each rank.
    """
    if isinstance(warmup_batches, bool) or not isinstance(warmup_batches, int) or warmup_batches < 0:
        raise ValueError(f"warmup_batches = {warmup_batches!r} must be an int >= 0")
    evs = _coerce(events)
    ranks = sorted({e.rank for e in evs})
    per_rank: Dict[int, Dict[str, Any]] = {}
    for r in ranks:
        per_rank[r] = _rank_summary(_skip_warmup([e for e in evs if e.rank == r], warmup_batches))
    kept = [e for r in ranks for e in _skip_warmup([e for e in evs if e.rank == r], warmup_batches)]
    lanes = lane_order(kept)
    busy = {lane: float(sum(p["busy_s"].get(lane, 0.0) for p in per_rank.values())) for lane in lanes}
    fetch_busy = float(sum(p["fetch_busy_s"] for p in per_rank.values()))
    overlap = float(sum(p["fetch_overlap_s"] for p in per_rank.values()))
    steps = [p["mean_step_s"] for p in per_rank.values() if p["mean_step_s"] is not None]
    exposed = fetch_busy - overlap
    if busy.get("stall", 0.0) > 0.0:
        # The pipeline records how long each lookup actually blocked on its rows: that is
        # the exposed fetch. (Inferring it from lane overlap would count the forward that
        # contains the wait as hiding the fetch.)
        exposed = min(busy["stall"], fetch_busy)
        overlap = fetch_busy - exposed
    return {
        "num_events": len(kept),
        "ranks": ranks,
        "lanes": lanes,
        "num_batches": len({e.batch for e in kept}),
        "span_s": (max(e.end_s for e in kept) - min(e.start_s for e in kept)) if kept else 0.0,
        "busy_s": busy,
        "fetch_busy_s": fetch_busy,
        "fetch_overlap_s": overlap,
        "fetch_overlap_fraction": overlap / fetch_busy if fetch_busy > 0 else 0.0,
        "fetch_exposed_s": exposed,
        "stall_s": exposed,
        "mean_step_s": (sum(steps) / len(steps)) if steps else None,
        "per_rank": per_rank,
    }


# --------------------------------------------------------------------------------------------
# Chrome trace


def _global_lanes(configs: Mapping[str, Sequence[TraceEvent]]) -> List[str]:
    extras = sorted({e.lane for evs in configs.values() for e in evs} - set(LANES))
    return list(LANES) + extras


def write_chrome_trace(events_by_config: Mapping[str, Sequence[EventLike]], path: Union[str, Path]) -> Path:
    """Write a Chrome trace (``{"traceEvents": [...]}``) and return its path.

    * one process per configuration: ``pid`` = 1-based position in ``events_by_config``, named
      by a ``process_name`` metadata event;
    * one thread per (rank, lane): ``tid = rank * stride + lane_index`` with ``stride = 10``
      (larger only if there are more than 10 lanes) and lane_index the position in
      :data:`LANES` followed by the unknown lanes (sorted); named ``"rank R / lane"``;
    * every event is a complete event ``ph="X"`` with ``ts``/``dur`` in microseconds relative
      to the earliest event of its configuration (so ``ts >= 0``, ``dur >= 0``).
    """
    configs = _coerce_configs(events_by_config)
    lanes = _global_lanes(configs)
    stride = 10 if len(lanes) <= 10 else 10 ** math.ceil(math.log10(len(lanes) + 1))
    lane_idx = {lane: i for i, lane in enumerate(lanes)}
    out: List[Dict[str, Any]] = []
    for pid, (cfg, evs) in enumerate(configs.items(), start=1):
        out.append({"name": "process_name", "ph": "M", "pid": pid, "tid": 0, "args": {"name": cfg}})
        out.append({"name": "process_sort_index", "ph": "M", "pid": pid, "tid": 0, "args": {"sort_index": pid}})
        if not evs:
            continue
        t0 = min(e.start_s for e in evs)
        threads = sorted({(e.rank, e.lane) for e in evs}, key=lambda rl: (rl[0], lane_idx[rl[1]]))
        for rank, lane in threads:
            tid = rank * stride + lane_idx[lane]
            out.append({"name": "thread_name", "ph": "M", "pid": pid, "tid": tid,
                        "args": {"name": f"rank {rank} / {lane}"}})
            out.append({"name": "thread_sort_index", "ph": "M", "pid": pid, "tid": tid,
                        "args": {"sort_index": tid}})
        for e in sorted(evs, key=lambda e: (e.start_s, e.rank, lane_idx[e.lane])):
            out.append({
                "name": e.name,
                "cat": e.lane,
                "ph": "X",
                "ts": round((e.start_s - t0) * 1e6, 3),
                "dur": round((e.end_s - e.start_s) * 1e6, 3),
                "pid": pid,
                "tid": e.rank * stride + lane_idx[e.lane],
                "args": {"batch": e.batch, "rank": e.rank, "lane": e.lane},
            })
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    doc = {"traceEvents": out, "displayTimeUnit": "ms", "otherData": {"configurations": list(configs)}}
    path.write_text(json.dumps(doc, allow_nan=False))
    return path


def dump_events(events_by_config: Mapping[str, Sequence[EventLike]], path: Union[str, Path]) -> Path:
    """Save raw events as ``{config: [event dict, ...]}`` JSON (round-trips via :func:`load_events`)."""
    configs = _coerce_configs(events_by_config)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({k: [e.to_dict() for e in v] for k, v in configs.items()}, allow_nan=False))
    return path


def load_events(path: Union[str, Path]) -> Dict[str, List[TraceEvent]]:
    """Inverse of :func:`dump_events` (configuration order preserved)."""
    raw = json.loads(Path(path).read_text())
    if not isinstance(raw, dict):
        raise ValueError(f"{path}: expected a JSON object config -> events, got {type(raw).__name__}")
    return {str(k): _coerce(v) for k, v in raw.items()}


# --------------------------------------------------------------------------------------------
# PNG


def _select_ranks(evs: Sequence[TraceEvent], ranks: Union[int, str, Sequence[int]]) -> List[int]:
    present = sorted({e.rank for e in evs})
    if isinstance(ranks, str):
        if ranks != "all":
            raise ValueError(f"ranks = {ranks!r}: expected an int, a list of ints or 'all'")
        return present
    if isinstance(ranks, int) and not isinstance(ranks, bool):
        if ranks in present or not present:
            return [ranks]
        return present[:1]  # the requested rank did not record: show the lowest one
    wanted = [int(r) for r in ranks]
    return [r for r in wanted if r in present] or present[:1]


def _default_skip(num_batches: int, max_batches: int) -> int:
    """Skip max(2, 20 %) of the batches as warm-up, but keep at least ``max_batches``."""
    return max(0, min(num_batches - max_batches, max(2, num_batches // 5)))


def _window(
    evs: Sequence[TraceEvent], max_batches: Optional[int], skip_batches: Optional[int]
) -> Tuple[float, float, int]:
    """(t0, t1, number of skipped warm-up batches) of the picture of one configuration."""
    batches = [b for b, _ in _step_starts(evs)]
    if max_batches is None and not skip_batches:
        return min(e.start_s for e in evs), max(e.end_s for e in evs), 0
    n = len(batches) if max_batches is None else max_batches
    skip = _default_skip(len(batches), n) if skip_batches is None else min(skip_batches, len(batches) - 1)
    chosen = batches[skip:skip + n]

    # The window opens where the previous batch's step ended (so the reactive data dist and
    # fetch of the first chosen batch are visible) and closes where the last chosen step ends.
    t0 = _step_end(evs, batches[skip - 1]) if skip > 0 else min(e.start_s for e in evs)
    t1 = _step_end(evs, chosen[-1])
    return t0, max(t1, t0 + 1e-9), skip


#: Drawn width of a ``stall`` event, at least this share of the window (a 10 us wait would
#: otherwise be thinner than a pixel); each stall also gets a marker above its bar.
MIN_STALL_WIDTH = 0.005
_STALL_COLOR = "crimson"
#: Hatches of the compute phases (event names "fwd b3", "bwd b3", "opt b3").
_PHASE_HATCH = {"fwd": "", "bwd": "////", "opt": "xxxx"}
_PHASE_LABEL = {"fwd": "fwd (forward)", "bwd": "bwd (backward)", "opt": "opt (optimizer)"}
_BWD_OPT_LABEL = "bwd (backward, then the dense optimizer step)"
#: Batches take colours in turn from this many: tab20's ten dark shades, then its ten light
#: ones. Batches fewer than 20 apart differ in colour, and fewer than 10 apart (every batch
#: in flight at once up to depth 8) in hue.
BATCH_COLOURS = 20


def batch_colour(batch: int) -> Tuple[float, float, float, float]:
    """The colour of ``batch``'s bars (RGBA): see :data:`BATCH_COLOURS`."""
    from matplotlib import colormaps

    i = batch % BATCH_COLOURS
    return colormaps["tab20"](2 * i if i < 10 else 2 * (i - 10) + 1)


def _join_optimizer_steps(events: Sequence[TraceEvent]) -> Tuple[List[TraceEvent], bool]:
    """Each ``opt`` bar joined to its batch's ``bwd`` bar (the dense optimizer step follows the
    backward and is far thinner than a pixel on a step's scale); ``opt`` bars without a
    backward of their batch stay. Returns the events and whether any was joined."""
    bwd = {(e.rank, e.batch): e for e in events if e.lane == "compute" and _phase(e) == "bwd"}
    ends: Dict[Tuple[int, int], float] = {}
    out: List[TraceEvent] = []
    for e in events:
        key = (e.rank, e.batch)
        if e.lane == "compute" and _phase(e) == "opt" and key in bwd:
            ends[key] = max(ends.get(key, bwd[key].end_s), e.end_s)
        else:
            out.append(e)
    return [replace(e, end_s=ends[(e.rank, e.batch)]) if e.lane == "compute" and _phase(e) == "bwd"
            and (e.rank, e.batch) in ends else e for e in out], bool(ends)


def _trace_figures(evs: Sequence[TraceEvent], warm: int) -> Dict[str, Any]:
    """The bench table's statistics from a trace: the median step (first compute start to the
    next one; per step the slowest rank) and the stall per step (the ``stall`` lane, else the
    fetch time nothing else hid; the slowest rank), over the same steps: those that start after
    ``warm`` warm-up batches and have a next step."""
    ranks = sorted({e.rank for e in evs})
    durations: Dict[int, float] = {}
    stalls: List[float] = []
    steps: List[int] = []
    for r in ranks:
        mine = _skip_warmup([e for e in evs if e.rank == r], warm)
        starts = _step_starts(mine)
        counted = {b for (b, _), _ in zip(starts, starts[1:])}
        for (b, s0), (_, s1) in zip(starts, starts[1:]):
            durations[b] = max(durations.get(b, 0.0), s1 - s0)
        if any(e.lane == "stall" for e in mine):
            stall = sum(e.duration_s for e in mine if e.lane == "stall" and e.batch in counted)
        else:
            stall = summarize([e for e in mine if e.batch in counted])["stall_s"]
        stalls.append(stall / len(counted) if counted else 0.0)
        steps = sorted(counted) if not steps else sorted(set(steps) | counted)
    ordered = sorted(durations.values())
    if not ordered:
        return {}
    n = len(ordered)
    median = ordered[n // 2] if n % 2 else (ordered[n // 2 - 1] + ordered[n // 2]) / 2
    return {"step_ms": median * 1e3, "stall_ms_per_step": max(stalls) * 1e3, "first": steps[0], "last": steps[-1],
            "ranks": ranks}


def _figures_text(figures: Optional[Mapping[str, Any]], traced: Dict[str, Any], window: Sequence[int]) -> str:
    """The box beside a configuration: the table's step and stall (``figures``, which steps
    they cover) or the same statistics from the trace (which steps), and what the bars show."""
    if figures:
        head = (f"median step {figures['step_ms']:.1f} ms\nstall {figures['stall_ms_per_step']:.2f} ms/step\n"
                f"(the table's: {figures['steps']} timed steps,\n{figures['rounds']} round"
                f"{'s' if figures['rounds'] != 1 else ''}, slowest rank)")
    elif traced:
        head = (f"median step {traced['step_ms']:.1f} ms\nstall {traced['stall_ms_per_step']:.2f} ms/step\n"
                f"(steps {traced['first']}-{traced['last']} of the trace,\nslowest of {len(traced['ranks'])} "
                f"rank(s))")
    else:
        head = "median step n/a"
    if not window:
        return head
    return head + f"\nbars: steps {min(window)}-{max(window)} of the trace"


def _display_key(lane: str) -> Tuple[int, int, str]:
    """Picture order: the known lanes, each followed by its extra rows (``"disk:2"``), then
    the others alphabetically."""
    parent, _, n = lane.partition(":")
    if lane in LANES:
        return LANES.index(lane), 0, ""
    if n and parent in LANES:
        return LANES.index(parent), 1, n.zfill(6)
    return len(LANES), 0, lane


def _lane_label(lane: str) -> str:
    parent, _, n = lane.partition(":")
    if lane not in LANE_LABELS and n and parent in LANE_LABELS:
        return f"{LANE_LABELS[parent]} {n}"
    return LANE_LABELS.get(lane, lane)


def _phase(e: TraceEvent) -> str:
    """The phase of a compute event ("fwd", "bwd", ...): its name without the batch."""
    head = e.name.split(" ")[0] if e.name else ""
    return head if head and head != f"b{e.batch}" else ""


def timeline_figure(
    events_by_config: Mapping[str, Sequence[EventLike]],
    max_batches: Optional[int] = None,
    title: Optional[str] = None,
    *,
    ranks: Union[int, str, Sequence[int]] = 0,
    skip_batches: Optional[int] = None,
    dpi: int = 120,
    figures: Optional[Mapping[str, Mapping[str, Any]]] = None,
) -> Any:
    """The matplotlib ``Figure`` of :func:`render_timeline_png` (no file written)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.collections import PolyCollection
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch

    if max_batches is not None and (isinstance(max_batches, bool) or not isinstance(max_batches, int) or max_batches < 1):
        raise ValueError(f"max_batches = {max_batches!r} must be None or an int >= 1")
    if skip_batches is not None and (isinstance(skip_batches, bool) or not isinstance(skip_batches, int) or skip_batches < 0):
        raise ValueError(f"skip_batches = {skip_batches!r} must be None or an int >= 0")
    configs = _coerce_configs(events_by_config)
    all_lanes = [l for l in _global_lanes(configs) if any(e.lane == l for evs in configs.values() for e in evs)]
    all_lanes = sorted(all_lanes, key=_display_key) or list(LANES)
    opt_joined = False

    # Lay out rows first so every subplot gets the height it needs.
    plan = []
    for cfg, evs in configs.items():
        shown = _select_ranks(evs, ranks)
        drawn, joined = _join_optimizer_steps([e for e in evs if e.rank in shown])
        opt_joined = opt_joined or joined
        plan.append((cfg, drawn, shown))
    rows_per = [max(1, len(shown)) * len(all_lanes) for _, _, shown in plan]
    height = 1.8 + sum(0.32 * r + 0.9 for r in rows_per)
    fig = Figure(figsize=(13, height), dpi=dpi)
    FigureCanvasAgg(fig)
    axes = fig.subplots(len(plan), 1, sharex=True, squeeze=False, gridspec_kw={"height_ratios": rows_per})[:, 0]

    # Windows first: the x axis is shared, so a minimum visible width is a share of the widest.
    windows = [_window(evs, max_batches, skip_batches) if evs else None for _, evs, _ in plan]
    x_max = max([(w[1] - w[0]) * 1e3 for w in windows if w] + [0.0])
    legend_batches: Dict[int, None] = {}
    phases_seen: Dict[str, None] = {}
    stalls_seen = False
    h = 0.36
    for ax, (cfg, evs, shown), window in zip(axes, plan, windows):
        ax.set_title(cfg, loc="left", fontsize=10, fontweight="bold")
        row_labels: List[str] = []
        row_of: Dict[Tuple[int, str], int] = {}
        for r in shown:
            for lane in all_lanes:
                row_of[(r, lane)] = len(row_labels)
                label = _lane_label(lane)
                row_labels.append(f"r{r} {label}" if len(shown) > 1 else label)
        ax.set_yticks(range(len(row_labels)))
        ax.set_yticklabels(row_labels, fontsize=8)
        ax.set_ylim(len(row_labels) - 0.5, -0.5)
        ax.grid(axis="x", linestyle=":", linewidth=0.5)
        if not evs:
            ax.text(0.5, 0.5, "no events", transform=ax.transAxes, ha="center", va="center")
            continue
        t0, t1, warm = window
        span_ms = x_max  # label thresholds and minimum widths: shares of the drawn axis
        bars: Dict[str, Tuple[List[Any], List[Any]]] = {}  # hatch -> (verts, colours)
        stall_verts: List[Any] = []
        stall_marks: Tuple[List[float], List[float]] = ([], [])
        for e in evs:
            s, t = max(e.start_s, t0), min(e.end_s, t1)
            if t < s or (t == s and e.duration_s > 0):
                continue
            left, width = (s - t0) * 1e3, (t - s) * 1e3
            y = row_of[(e.rank, e.lane)]
            if e.lane == "stall":
                shown_w = max(width, MIN_STALL_WIDTH * span_ms)
                stall_verts.append([(left, y - h), (left + shown_w, y - h), (left + shown_w, y + h), (left, y + h)])
                stall_marks[0].append(left + shown_w / 2)
                stall_marks[1].append(y - h - 0.08)
                stalls_seen = True
                continue
            phase = _phase(e) if e.lane == "compute" else ""
            hatch = _PHASE_HATCH.get(phase, "") if phase else ""
            if phase:
                phases_seen[phase] = None
            verts, colors = bars.setdefault(hatch, ([], []))
            verts.append([(left, y - h), (left + width, y - h), (left + width, y + h), (left, y + h)])
            colors.append(batch_colour(e.batch))
            legend_batches[e.batch] = None
            # compute bars name their phase first (the colour already gives the batch)
            if phase and width >= 0.045 * span_ms:
                text = f"{phase} b{e.batch}"
            elif phase and width >= 0.022 * span_ms:
                text = phase
            elif not phase and width >= 0.025 * span_ms:
                text = f"b{e.batch}"
            else:
                continue
            ax.text(left + width / 2, y, text, ha="center", va="center", fontsize=7, clip_on=True,
                    bbox={"boxstyle": "square,pad=0.1", "facecolor": "white", "alpha": 0.6, "linewidth": 0}
                    if hatch else None)
        # one collection per hatch (not one patch per bar): fast even for long traces drawn whole
        for hatch, (verts, colors) in bars.items():
            ax.add_collection(PolyCollection(verts, facecolors=colors, edgecolors="black", linewidths=0.4,
                                             hatch=hatch or None))
        if stall_verts:
            ax.add_collection(PolyCollection(stall_verts, facecolors=_STALL_COLOR, edgecolors="black", linewidths=0.4,
                                             gid="stall"))
            ax.plot(stall_marks[0], stall_marks[1], linestyle="none", marker="v", ms=5, color=_STALL_COLOR,
                    gid="stall_marker", clip_on=False)
        traced = {} if figures and cfg in figures else _trace_figures(evs, warm)
        window_steps = [b for b, s0 in _step_starts(evs) if t0 <= s0 < t1]
        txt = _figures_text(figures.get(cfg) if figures else None, traced, window_steps)
        ax.text(1.005, 0.98, txt, transform=ax.transAxes, ha="left", va="top", fontsize=8,
                bbox={"boxstyle": "round", "facecolor": "white", "alpha": 0.9, "linewidth": 0.5})
    for ax in axes:
        ax.set_xlim(0, x_max * 1.01 if x_max > 0 else 1.0)
    axes[-1].set_xlabel("time in window (ms)")
    handles: List[Any] = []
    batches_shown = sorted(legend_batches)
    if batches_shown and len(batches_shown) <= BATCH_COLOURS:
        handles += [Patch(facecolor=batch_colour(b), edgecolor="black", label=f"batch {b}") for b in batches_shown]
    elif batches_shown:  # (a whole long trace: colours repeat every BATCH_COLOURS batches)
        handles.append(Patch(facecolor="white", edgecolor="white",
                             label=f"bar colour: batch index mod {BATCH_COLOURS} ({len(batches_shown)} batches)"))
    labels = dict(_PHASE_LABEL, bwd=_BWD_OPT_LABEL) if opt_joined else _PHASE_LABEL
    handles += [Patch(facecolor="white", edgecolor="black", hatch=_PHASE_HATCH.get(ph, "") or None,
                      label=labels.get(ph, ph)) for ph in phases_seen]
    if stalls_seen:
        handles.append(Patch(facecolor=_STALL_COLOR, edgecolor="black",
                             label=f"stall: lookup waiting for its rows (drawn >= {MIN_STALL_WIDTH:.1%} of the window wide)"))
    if handles:
        fig.legend(handles=handles, loc="lower center", ncol=min(len(handles), 6), fontsize=7, frameon=False)
    fig.suptitle(title or "Pipeline timeline", fontsize=12)
    fig.subplots_adjust(left=0.12, right=0.84, top=1 - 0.55 / height, bottom=1.25 / height, hspace=0.45)
    return fig


def render_timeline_png(
    events_by_config: Mapping[str, Sequence[EventLike]],
    path: Union[str, Path],
    max_batches: Optional[int] = None,
    title: Optional[str] = None,
    *,
    ranks: Union[int, str, Sequence[int]] = 0,
    skip_batches: Optional[int] = None,
    dpi: int = 120,
    figures: Optional[Mapping[str, Mapping[str, Any]]] = None,
) -> Path:
    """Draw the pipeline timeline (paper Fig. 1 style) and return the PNG path.

    One subplot per configuration (mapping order, top to bottom), a shared x axis in ms
    measured from each configuration's window start, one row per lane (per displayed rank:
    rank 0 by default, every rank with ``ranks="all"``), bars coloured by batch
    (:func:`batch_colour`: batches fewer than 20 apart differ) and labelled ``b<batch>`` when
    wide enough; compute bars are hatched by phase (fwd / bwd) and labelled ``fwd b3`` when
    wide enough; a batch's dense optimizer step is drawn as the end of its backward bar (it
    is far thinner than a pixel). ``stall`` events (measured blocking waits) are red, drawn
    at least :data:`MIN_STALL_WIDTH` of the window wide and marked with a triangle, so even a
    10 us wait is visible. One legend, listing exactly what is drawn (batches, compute
    phases, stall).

    Each subplot states a median step time and a stall per step, and which steps they cover:
    ``figures[config]`` (``step_ms``, ``stall_ms_per_step``, ``steps``, ``rounds``: the bench
    table's figures, passed by the bench so that picture and table agree) or, for a
    configuration without them, the same statistics computed from its trace (steps after the
    skipped warm-up; per step the slowest displayed rank).

    With ``max_batches`` the picture shows that many steady-state steps after skipping
    ``skip_batches`` warm-up batches (default: max(2, 20 %) of them, never leaving fewer than
    ``max_batches``); events are clipped to the window. Without it, the whole trace is drawn.
    """
    fig = timeline_figure(events_by_config, max_batches, title, ranks=ranks, skip_batches=skip_batches, dpi=dpi,
                          figures=figures)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=dpi)
    return path
