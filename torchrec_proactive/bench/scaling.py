"""Reactive vs proactive step time of the DLRM training pipeline, projected to 8-1024 GPUs.

Pipeline model (one rank; weak scaling, so every rank looks the same)
--------------------------------------------------------------------
Each batch ``j`` goes through five phases::

    I_j  input all-to-all of the sparse ids      (comm lane)
    F_j  copy of its cold rows host -> device    (link lane, FIFO, one batch at a time)
    C_j  forward + backward compute              (compute lane)
    O_j  output (pooled embedding) all-to-all    (comm lane)
    A_j  dense-gradient all-reduce               (comm lane)

The training loop issues blocking collectives in program order; with lookahead ``depth = k``
step ``t`` runs ``I_{t+k}, C_t, O_t, A_t`` (the prologue runs ``I_0 .. I_{k-1}``), so the
only concurrency is the host link: ``F_j`` starts as soon as the ids of ``j`` have arrived
(end of ``I_j``) and the link is free, and must end before ``C_j`` starts. At most ``k + 1``
batches hold cache slots at a time. ``k = 0`` is the reactive pipeline (fetch on the critical
path). A fetch occupies the link for ``F - L`` and its rows arrive ``L`` later, where ``L``
(``fetch_latency_s``, default 0) is the part of the fetch that later transfers may overlap.

With ``S0 = I + C + O + A + other`` (the work of one step without fetch) the steady-state
step time is the maximum cycle mean of that schedule (max-plus algebra)::

    S(k) = max( S0,  F - L,  (S0 + F) / (k + 1) )          S(0) = S0 + F

Read as "exposed fetch = max(0, fetch - window(k))": the fetch of batch ``N + k`` has the
window of the ``k`` in-flight steps ``N .. N+k-1`` (``window(k) = k * S``), but exposed time
lengthens those very steps; solving ``x = max(0, F - k (S0 + x))`` gives
``x = (F - k S0) / (k + 1)``, and the link can never move more than one batch per
``F - L`` (throughput bound). :func:`simulate` schedules the same lanes event by event and
agrees with the formula for constant stage times; with ``jitter`` it shows what deeper
lookahead buys when stage times vary.

Cluster model: alpha-beta costs (``p`` ranks, ``b`` bytes per rank)::

    all-to-all   (p-1) alpha + (p-1)/p * b * beta
    ring all-reduce  2 (p-1) alpha + 2 (p-1)/p * b * beta
    fetch        host_link_latency + rows * (1 - hit_rate) * bytes_per_row / host_link_bw

Nothing here imports TorchRec or torch.
"""

from __future__ import annotations

import math
import random
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple, Union

from .timeline import TraceEvent

__all__ = [
    "StageTimes",
    "ClusterModel",
    "all_to_all_s",
    "ring_allreduce_s",
    "overlap_window_s",
    "step_time_reactive",
    "step_time_proactive",
    "simulate",
    "simulate_trace",
    "calibrate",
    "prediction_error",
    "project",
    "plot_projection",
    "projection_figure",
    "model_assumptions",
    "DEFAULT_WORLD_SIZES",
    "DEFAULT_DEPTHS",
]

DEFAULT_WORLD_SIZES: Tuple[int, ...] = (8, 16, 32, 64, 128, 256, 512, 1024)
DEFAULT_DEPTHS: Tuple[int, ...] = (0, 1, 2, 4)


# --------------------------------------------------------------------------------------------
# validation helpers


def _check_number(owner: str, name: str, value: Any, lo: float = 0.0, hi: Optional[float] = None,
                  lo_open: bool = False) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{owner}.{name} = {value!r} must be a finite number")
    if value < lo or (lo_open and value == lo):
        raise ValueError(f"{owner}.{name} = {value!r} is below the limit {'>' if lo_open else '>='} {lo}")
    if hi is not None and value > hi:
        raise ValueError(f"{owner}.{name} = {value!r} is above the limit {hi}")


def _check_int(owner: str, name: str, value: Any, lo: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{owner}.{name} = {value!r} must be an int")
    if value < lo:
        raise ValueError(f"{owner}.{name} = {value!r} is below the limit {lo}")


# --------------------------------------------------------------------------------------------
# data


@dataclass(frozen=True)
class StageTimes:
    """Per-step durations (seconds) of the phases of one rank, measured or modelled.

    ``fetch_s`` is the time to move one batch's cold rows over the host-device link at the
    run's hit rate; ``fetch_latency_s <= fetch_s`` is the part of it that later transfers may
    overlap (0: the link is busy for the whole fetch). ``other_s`` is per-step host work that
    overlaps nothing (Python, optimizer). ``depth`` and ``step_s`` describe the run the
    times were measured on (lookahead, measured mean step time) and matter only to
    :func:`calibrate` / :func:`prediction_error`. All times finite and >= 0.
    """

    compute_s: float
    input_a2a_s: float
    output_a2a_s: float
    allreduce_s: float
    fetch_s: float
    world_size: int = 1
    fetch_latency_s: float = 0.0
    other_s: float = 0.0
    depth: int = 0
    step_s: Optional[float] = None

    def __post_init__(self) -> None:
        for name in ("compute_s", "input_a2a_s", "output_a2a_s", "allreduce_s", "fetch_s",
                     "fetch_latency_s", "other_s"):
            _check_number("StageTimes", name, getattr(self, name))
        _check_int("StageTimes", "world_size", self.world_size, 1)
        _check_int("StageTimes", "depth", self.depth, 0)
        if self.fetch_latency_s > self.fetch_s:
            raise ValueError(
                f"StageTimes.fetch_latency_s = {self.fetch_latency_s!r} is above the limit "
                f"fetch_s = {self.fetch_s!r}"
            )
        if self.step_s is not None:
            _check_number("StageTimes", "step_s", self.step_s, 0.0, lo_open=True)

    @property
    def comm_s(self) -> float:
        """Input + output all-to-all + all-reduce."""
        return self.input_a2a_s + self.output_a2a_s + self.allreduce_s

    @property
    def main_s(self) -> float:
        """``S0``: one step without fetch = compute + comms + other."""
        return self.compute_s + self.comm_s + self.other_s

    @property
    def link_busy_s(self) -> float:
        """Link occupancy of one fetch, ``fetch_s - fetch_latency_s``."""
        return self.fetch_s - self.fetch_latency_s

    def to_dict(self) -> Dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "StageTimes":
        """From a dict holding (at least) the five ``*_s`` stage keys; the optional fields
        default as in the constructor; other keys (run metadata) are ignored."""
        names = {f.name for f in fields(cls)}
        required = ("compute_s", "input_a2a_s", "output_a2a_s", "allreduce_s", "fetch_s")
        missing = [k for k in required if k not in d]
        if missing:
            raise ValueError(f"stage-times dict lacks key(s) {missing}: {dict(d)!r}")
        kw: Dict[str, Any] = {}
        for k in names:
            if k in d and d[k] is not None:
                v = d[k]
                kw[k] = int(v) if k in ("world_size", "depth") else float(v)
        return cls(**kw)


_SIZE_FIELDS = ("dense_param_bytes", "output_bytes_per_step", "id_bytes_per_step", "bytes_per_row",
                "rows_per_batch", "hit_rate")


@dataclass(frozen=True)
class ClusterModel:
    """Per-GPU costs of one training step under weak scaling (per-GPU batch constant).

    * ``compute_s`` - forward + backward per step (independent of the world size);
    * ``alpha_s`` / ``beta_s_per_byte`` - network latency per peer message and inverse
      bandwidth, used by both the all-to-alls and the ring all-reduce;
    * ``dense_param_bytes`` - all-reduce payload; ``output_bytes_per_step`` /
      ``id_bytes_per_step`` - bytes each rank exchanges in the output / input all-to-all;
    * ``host_link_bytes_per_s`` / ``host_link_latency_s`` - the host-device link of one GPU;
    * ``bytes_per_row`` x ``rows_per_batch`` x ``(1 - hit_rate)`` - cold bytes per batch;
    * ``overhead_s`` - per-step host work that overlaps nothing.

    Every field is finite; sizes and times >= 0, ``host_link_bytes_per_s > 0``,
    ``hit_rate`` in [0, 1]; violations raise ``ValueError`` naming field, value and limit.
    """

    compute_s: float
    alpha_s: float
    beta_s_per_byte: float
    dense_param_bytes: float
    output_bytes_per_step: float
    id_bytes_per_step: float
    host_link_bytes_per_s: float
    host_link_latency_s: float
    bytes_per_row: float
    rows_per_batch: float
    hit_rate: float
    overhead_s: float = 0.0

    def __post_init__(self) -> None:
        for f in fields(self):
            v = getattr(self, f.name)
            if f.name == "host_link_bytes_per_s":
                _check_number("ClusterModel", f.name, v, 0.0, lo_open=True)
            elif f.name == "hit_rate":
                _check_number("ClusterModel", f.name, v, 0.0, 1.0)
            else:
                _check_number("ClusterModel", f.name, v)

    @property
    def cold_bytes_per_batch(self) -> float:
        """Bytes that miss the cache per batch per GPU."""
        return self.rows_per_batch * (1.0 - self.hit_rate) * self.bytes_per_row

    def fetch_s(self) -> float:
        """``latency + cold bytes / bandwidth``; 0 when nothing is cold."""
        cold = self.cold_bytes_per_batch
        return 0.0 if cold <= 0 else self.host_link_latency_s + cold / self.host_link_bytes_per_s

    def stage_times(self, world_size: int, depth: int = 0) -> StageTimes:
        """Modelled :class:`StageTimes` of one rank in a ``world_size``-rank job.

        The link latency is charged as link occupancy (one copy engine, ``fetch_latency_s=0``).
        """
        _check_int("ClusterModel.stage_times", "world_size", world_size, 1)
        return StageTimes(
            compute_s=self.compute_s,
            input_a2a_s=all_to_all_s(self.id_bytes_per_step, world_size, self.alpha_s, self.beta_s_per_byte),
            output_a2a_s=all_to_all_s(self.output_bytes_per_step, world_size, self.alpha_s, self.beta_s_per_byte),
            allreduce_s=ring_allreduce_s(self.dense_param_bytes, world_size, self.alpha_s, self.beta_s_per_byte),
            fetch_s=self.fetch_s(),
            world_size=world_size,
            other_s=self.overhead_s,
            depth=depth,
        )

    def to_dict(self) -> Dict[str, Any]:
        return asdict(self)


# --------------------------------------------------------------------------------------------
# analytical costs


def all_to_all_s(bytes_per_rank: float, world_size: int, alpha_s: float, beta_s_per_byte: float) -> float:
    """Pairwise all-to-all: ``(p-1) alpha + (p-1)/p * bytes * beta`` (0 for ``p = 1``)."""
    _check_int("all_to_all_s", "world_size", world_size, 1)
    p = world_size
    return (p - 1) * alpha_s + (p - 1) / p * bytes_per_rank * beta_s_per_byte


def ring_allreduce_s(num_bytes: float, world_size: int, alpha_s: float, beta_s_per_byte: float) -> float:
    """Ring all-reduce: ``2 (p-1)/p * bytes * beta + 2 (p-1) alpha`` (0 for ``p = 1``)."""
    _check_int("ring_allreduce_s", "world_size", world_size, 1)
    p = world_size
    return 2.0 * (p - 1) / p * num_bytes * beta_s_per_byte + 2.0 * (p - 1) * alpha_s


def _as_times(times: Union[StageTimes, ClusterModel], world_size: Optional[int]) -> StageTimes:
    if isinstance(times, StageTimes):
        if world_size is not None and world_size != times.world_size:
            raise ValueError(
                f"world_size = {world_size} differs from StageTimes.world_size = {times.world_size}"
            )
        return times
    if isinstance(times, ClusterModel):
        if world_size is None:
            raise ValueError("world_size is required with a ClusterModel")
        return times.stage_times(world_size)
    raise ValueError(f"expected StageTimes or ClusterModel, got {type(times).__name__}")


def overlap_window_s(depth: int, times: Union[StageTimes, ClusterModel], world_size: Optional[int] = None) -> float:
    """``window(k) = k * S0``: comm phases + compute of the ``k`` in-flight steps that a fetch
    issued ``k`` steps ahead can hide behind (before stalls stretch them)."""
    _check_int("overlap_window_s", "depth", depth, 0)
    return depth * _as_times(times, world_size).main_s


def step_time_reactive(times: Union[StageTimes, ClusterModel], world_size: Optional[int] = None) -> float:
    """Reactive (depth 0) step: ``compute + fetch + input a2a + output a2a + all-reduce + other``.

    Every comm is exposed (blocking collectives) and the fetch sits on the critical path.
    """
    t = _as_times(times, world_size)
    return t.main_s + t.fetch_s


def step_time_proactive(depth: int, times: Union[StageTimes, ClusterModel], world_size: Optional[int] = None) -> float:
    """Steady-state step with lookahead ``k = depth`` (see the module docstring)::

        S(k) = max(S0, F - L, (S0 + F) / (k + 1)),   S0 = compute + comms + other

    i.e. ``S0 + exposed`` with ``exposed = max(0, F - L - S0, (F - window(k)) / (k + 1))``,
    ``window(k) = k * S0``. Invariants: ``S(0) == step_time_reactive``; ``S`` is
    non-increasing in ``k`` and never below ``max(S0, F - L)``.
    """
    _check_int("step_time_proactive", "depth", depth, 0)
    t = _as_times(times, world_size)
    s0, f = t.main_s, t.fetch_s
    if depth == 0:
        return s0 + f
    return max(s0, t.link_busy_s, (s0 + f) / (depth + 1))


def _bound(depth: int, t: StageTimes) -> str:
    if depth == 0:
        return "serial" if t.fetch_s > 0 else "main"
    s0, b, lat = t.main_s, t.link_busy_s, (t.main_s + t.fetch_s) / (depth + 1)
    m = max(s0, b, lat)
    if m == s0:
        return "main"
    return "link" if m == b else "fetch-latency"


# --------------------------------------------------------------------------------------------
# discrete-event simulation


def _run_sim(times: StageTimes, depth: int, num_steps: int, jitter: float, seed: int
             ) -> Tuple[List[float], List[TraceEvent]]:
    """Schedule the ops of ``num_steps`` batches; return step end times and the events.

    Ops are processed in issue order; each starts at ``max(lane free, dependencies done)``.
    Lanes are FIFO in issue order, which is exactly how the program issues them, so this
    list schedule is the event-driven schedule.
    """
    rng = random.Random(seed)
    stages = ("input", "compute", "output", "allreduce", "fetch", "other")
    base = {"input": times.input_a2a_s, "compute": times.compute_s, "output": times.output_a2a_s,
            "allreduce": times.allreduce_s, "fetch": times.fetch_s, "other": times.other_s}
    # Per (batch, stage) factors drawn in a fixed order: runs at different depths are paired.
    # The pipeline keeps running after the last measured step: batches num_steps ..
    # num_steps+depth-1 get their ids distributed (and fetched) like in any other step.
    n_batches = num_steps + depth
    factor = [{s: (1.0 + rng.uniform(-jitter, jitter)) if jitter > 0 else 1.0 for s in stages}
              for _ in range(n_batches)]
    dur = [{s: base[s] * factor[j][s] for s in stages} for j in range(n_batches)]
    lat_frac = times.fetch_latency_s / times.fetch_s if times.fetch_s > 0 else 0.0

    lane_free = {"comm": 0.0, "compute": 0.0, "link": 0.0, "host": 0.0}
    main_clock = 0.0  # end of the previous op of the (blocking) program
    ids_done = [0.0] * n_batches
    fetch_done = [0.0] * n_batches
    step_end = [0.0] * num_steps
    events: List[TraceEvent] = []

    def run(lane: str, trace_lane: str, name: str, batch: int, d: float, ready: float,
            occupancy: Optional[float] = None) -> Tuple[float, float]:
        start = max(lane_free[lane], ready)
        end = start + d
        lane_free[lane] = start + (d if occupancy is None else occupancy)
        if d > 0:
            events.append(TraceEvent(trace_lane, name, batch, start, end, 0))
        return start, end

    def issue_input(j: int) -> None:
        nonlocal main_clock
        _, end = run("comm", "data_dist", f"a2a ids b{j}", j, dur[j]["input"], main_clock)
        main_clock = ids_done[j] = end
        # Fetch of j: ids arrived, link free (FIFO), and the cache holds at most depth+1
        # batches: batch j - depth - 1 must have finished its step (released its slots).
        released = step_end[j - depth - 1] if j - depth - 1 >= 0 else 0.0
        d = dur[j]["fetch"]
        _, fetch_done[j] = run("link", "fetch", f"fetch b{j}", j, d, max(end, released),
                               occupancy=d * (1.0 - lat_frac))

    for j in range(depth):
        issue_input(j)
    for t in range(num_steps):
        issue_input(t + depth)
        _, main_clock = run("compute", "compute", f"fwd+bwd b{t}", t, dur[t]["compute"],
                            max(main_clock, fetch_done[t]))
        _, main_clock = run("comm", "output_comm", f"a2a out b{t}", t, dur[t]["output"], main_clock)
        _, main_clock = run("comm", "allreduce", f"allreduce b{t}", t, dur[t]["allreduce"], main_clock)
        if dur[t]["other"] > 0:
            _, main_clock = run("host", "other", f"other b{t}", t, dur[t]["other"], main_clock)
        step_end[t] = main_clock
    return step_end, events


def _sim_args(times: Union[StageTimes, ClusterModel], depth: int, num_steps: int, world_size: Optional[int],
              jitter: float) -> StageTimes:
    _check_int("simulate", "depth", depth, 0)
    _check_int("simulate", "num_steps", num_steps, 2)
    _check_number("simulate", "jitter", jitter, 0.0, 0.999)
    return _as_times(times, world_size)


def simulate(
    times: Union[StageTimes, ClusterModel],
    depth: int,
    num_steps: int = 500,
    *,
    world_size: Optional[int] = None,
    jitter: float = 0.0,
    seed: int = 0,
) -> float:
    """Steady-state step time of the discrete-event schedule (seconds).

    Lanes: ``link`` (fetches, FIFO, one at a time), ``comm``, ``compute`` (and ``host`` for
    ``other_s``). Dependencies: fetch ``j`` starts after ``I_j`` ends, after batch
    ``j - depth - 1`` finished its step (cache holds ``depth + 1`` batches) and when the link
    is free; ``C_j`` starts after fetch ``j`` ends; collectives block in program order.
    ``jitter`` scales each op duration by an independent factor uniform in
    ``[1 - jitter, 1 + jitter]`` (seeded). The result is the mean step over the last 80 % of
    the steps; with ``jitter = 0`` it matches :func:`step_time_proactive` to O(1/num_steps).
    """
    t = _sim_args(times, depth, num_steps, world_size, jitter)
    ends, _ = _run_sim(t, depth, num_steps, jitter, seed)
    w = num_steps // 5
    return (ends[-1] - ends[w]) / (num_steps - 1 - w)


def simulate_trace(
    times: Union[StageTimes, ClusterModel],
    depth: int,
    num_steps: int = 12,
    *,
    world_size: Optional[int] = None,
    jitter: float = 0.0,
    seed: int = 0,
) -> List[TraceEvent]:
    """The simulated schedule as rank-0 :class:`TraceEvent` s (lanes ``data_dist``,
    ``fetch``, ``compute``, ``output_comm``, ``allreduce``; ``other`` if ``other_s > 0``), for
    :func:`torchrec_proactive.bench.timeline.render_timeline_png`. Times start at 0."""
    t = _sim_args(times, depth, num_steps, world_size, jitter)
    return _run_sim(t, depth, num_steps, jitter, seed)[1]


# --------------------------------------------------------------------------------------------
# calibration


def _coerce_measured(measured: Mapping[str, Union[StageTimes, Mapping[str, Any]]]) -> Dict[str, StageTimes]:
    if not isinstance(measured, Mapping) or len(measured) == 0:
        raise ValueError("measured must be a non-empty mapping configuration -> StageTimes or dict")
    out: Dict[str, StageTimes] = {}
    for name, m in measured.items():
        if isinstance(m, StageTimes):
            out[str(name)] = m
        elif isinstance(m, Mapping):
            try:
                out[str(name)] = StageTimes.from_dict(m)
            except (ValueError, TypeError) as exc:
                raise ValueError(f"measured[{name!r}]: {exc}") from exc
        else:
            raise ValueError(f"measured[{name!r}] must be StageTimes or a dict, got {type(m).__name__}")
    return out


def _sizes_from_dicts(measured: Mapping[str, Any]) -> Dict[str, float]:
    """Size fields carried by per-config dicts (all configs that carry them must agree)."""
    sizes: Dict[str, float] = {}
    for name, m in measured.items():
        if not isinstance(m, Mapping):
            continue
        for k in _SIZE_FIELDS + ("host_link_latency_s",):
            if k in m and m[k] is not None:
                v = float(m[k])
                if k in sizes and not math.isclose(sizes[k], v, rel_tol=1e-9, abs_tol=0.0):
                    raise ValueError(f"measured[{name!r}][{k!r}] = {v!r} disagrees with {sizes[k]!r} of another configuration")
                sizes[k] = v
    missing = [k for k in _SIZE_FIELDS if k not in sizes]
    if missing:
        raise ValueError(
            f"calibrate needs the sizes {list(_SIZE_FIELDS)}: pass template=ClusterModel(...) or "
            f"put them in the per-configuration dicts (missing {missing})"
        )
    return sizes


def _fit_alpha_beta(rows: List[Tuple[float, float, float]]) -> Optional[Tuple[float, float]]:
    """Non-negative least squares of ``t = n*alpha + b*beta`` in relative error
    (each row divided by its ``t``); rows are ``(n, b, t)`` with ``t > 0``."""
    rows = [(n / t, b / t, 1.0) for n, b, t in rows if t > 0 and (n > 0 or b > 0)]
    if not rows:
        return None

    def sse(a: float, be: float) -> float:
        return sum((n * a + b * be - y) ** 2 for n, b, y in rows)

    snn = sum(n * n for n, _, _ in rows)
    sbb = sum(b * b for _, b, _ in rows)
    snb = sum(n * b for n, b, _ in rows)
    sny = sum(n * y for n, _, y in rows)
    sby = sum(b * y for _, b, y in rows)
    candidates: List[Tuple[float, float]] = []
    det = snn * sbb - snb * snb
    if abs(det) > 1e-12 * max(snn * sbb, 1e-300):
        a = (sny * sbb - sby * snb) / det
        be = (sby * snn - sny * snb) / det
        if a >= 0 and be >= 0:
            candidates.append((a, be))
    if snn > 0:
        candidates.append((sny / snn, 0.0))
    if sbb > 0:
        candidates.append((0.0, sby / sbb))
    return min(candidates, key=lambda ab: sse(*ab))


def calibrate(
    measured: Mapping[str, Union[StageTimes, Mapping[str, Any]]],
    template: Optional[ClusterModel] = None,
    *,
    fit_overhead: bool = True,
) -> ClusterModel:
    """Fit the timing parameters of a :class:`ClusterModel` to measured runs.

    ``measured`` maps a configuration name to its :class:`StageTimes` (or the dict form,
    which may also carry the size fields ``dense_param_bytes, output_bytes_per_step,
    id_bytes_per_step, bytes_per_row, rows_per_batch, hit_rate[, host_link_latency_s]``).
    Sizes come from ``template`` if given, else from those dicts. Fitted:

    * ``compute_s`` - mean measured compute;
    * ``alpha_s, beta_s_per_byte`` - non-negative least squares (relative error) of the
      alpha-beta costs against every measured comm of the runs with ``world_size >= 2``
      (needs at least one; otherwise the template's values are kept);
    * ``host_link_bytes_per_s`` - cold bytes / (mean fetch - link latency), when both > 0;
    * ``overhead_s`` (``fit_overhead``) - mean of ``step_s - model prediction`` over the
      depth-0 runs with a measured ``step_s`` (all runs if none is depth 0), clamped at 0.

    Raises ``ValueError`` when a parameter can be neither fitted nor taken from ``template``.
    """
    runs = _coerce_measured(measured)
    if template is not None:
        if not isinstance(template, ClusterModel):
            raise ValueError(f"template must be a ClusterModel, got {type(template).__name__}")
        sizes = {k: getattr(template, k) for k in _SIZE_FIELDS + ("host_link_latency_s",)}
    else:
        sizes = _sizes_from_dicts(measured)
        sizes.setdefault("host_link_latency_s", 0.0)

    compute = sum(r.compute_s for r in runs.values()) / len(runs)

    eqs: List[Tuple[float, float, float]] = []
    for r in runs.values():
        p = r.world_size
        if p < 2:
            continue
        f = (p - 1) / p
        eqs.append((p - 1, f * sizes["id_bytes_per_step"], r.input_a2a_s))
        eqs.append((p - 1, f * sizes["output_bytes_per_step"], r.output_a2a_s))
        eqs.append((2 * (p - 1), 2 * f * sizes["dense_param_bytes"], r.allreduce_s))
    ab = _fit_alpha_beta(eqs)
    if ab is None:
        if template is None:
            raise ValueError(
                "calibrate cannot fit alpha_s/beta_s_per_byte: no measured run has world_size >= 2 "
                "with a positive comm time; pass template=ClusterModel(...) to supply them"
            )
        ab = (template.alpha_s, template.beta_s_per_byte)

    cold = sizes["rows_per_batch"] * (1.0 - sizes["hit_rate"]) * sizes["bytes_per_row"]
    fetch_mean = sum(r.fetch_s for r in runs.values()) / len(runs)
    transfer = fetch_mean - sizes["host_link_latency_s"]
    if cold > 0 and transfer > 0:
        bw = cold / transfer
    elif template is not None:
        bw = template.host_link_bytes_per_s
    else:
        raise ValueError(
            f"calibrate cannot fit host_link_bytes_per_s: cold bytes per batch = {cold!r}, "
            f"mean fetch - latency = {transfer!r} s (both must be > 0); pass template=ClusterModel(...)"
        )

    model = ClusterModel(
        compute_s=compute, alpha_s=ab[0], beta_s_per_byte=ab[1],
        dense_param_bytes=sizes["dense_param_bytes"], output_bytes_per_step=sizes["output_bytes_per_step"],
        id_bytes_per_step=sizes["id_bytes_per_step"], host_link_bytes_per_s=bw,
        host_link_latency_s=sizes["host_link_latency_s"], bytes_per_row=sizes["bytes_per_row"],
        rows_per_batch=sizes["rows_per_batch"], hit_rate=sizes["hit_rate"],
        overhead_s=0.0 if template is None else template.overhead_s,
    )
    if fit_overhead:
        with_step = [r for r in runs.values() if r.step_s is not None]
        pool = [r for r in with_step if r.depth == 0] or with_step
        if pool:
            base = replace(model, overhead_s=0.0)
            resid = [r.step_s - step_time_proactive(r.depth, base.stage_times(r.world_size)) for r in pool]
            model = replace(model, overhead_s=max(0.0, sum(resid) / len(resid)))
    return model


def prediction_error(
    model: ClusterModel, measured: Mapping[str, Union[StageTimes, Mapping[str, Any]]]
) -> Dict[str, Any]:
    """Relative error ``(predicted - measured) / measured`` of the step time per configuration.

    ``configs[name]`` holds ``world_size, depth, measured_step_s``, ``predicted_step_s`` (the
    model's stage times through the step formula) with ``rel_error``, and ``formula_step_s``
    (the *measured* stage times through the step formula, which isolates the composition
    rule from the cost model) with ``formula_rel_error``. Also ``mean_abs_rel_error`` and
    ``max_abs_rel_error`` over configurations. Every run needs ``step_s``.
    """
    if not isinstance(model, ClusterModel):
        raise ValueError(f"model must be a ClusterModel, got {type(model).__name__}")
    runs = _coerce_measured(measured)
    out: Dict[str, Dict[str, Any]] = {}
    for name, r in runs.items():
        if r.step_s is None:
            raise ValueError(f"measured[{name!r}].step_s is missing: need the measured step time")
        pred = step_time_proactive(r.depth, model.stage_times(r.world_size))
        form = step_time_proactive(r.depth, r)
        out[name] = {
            "world_size": r.world_size,
            "depth": r.depth,
            "measured_step_s": r.step_s,
            "predicted_step_s": pred,
            "rel_error": (pred - r.step_s) / r.step_s,
            "formula_step_s": form,
            "formula_rel_error": (form - r.step_s) / r.step_s,
        }
    errs = [abs(v["rel_error"]) for v in out.values()]
    return {
        "configs": out,
        "mean_abs_rel_error": sum(errs) / len(errs),
        "max_abs_rel_error": max(errs),
    }


# --------------------------------------------------------------------------------------------
# projection


def project(
    model: ClusterModel,
    world_sizes: Sequence[int] = DEFAULT_WORLD_SIZES,
    depths: Sequence[int] = DEFAULT_DEPTHS,
) -> List[Dict[str, Any]]:
    """One row per (world size, depth), world sizes outer, in the given orders.

    Row keys: ``world_size, depth, step_s, reactive_step_s, speedup`` (reactive / this),
    ``exposed_fetch_s`` (``step_s - S0``), ``overlap_window_s``, the stage times
    ``compute_s, input_a2a_s, output_a2a_s, allreduce_s, fetch_s, other_s`` and ``bound``
    (``"main"``, ``"link"``, ``"fetch-latency"`` or ``"serial"`` for depth 0 with a fetch).
    Invariant: ``speedup >= 1``; with fixed sizes ``step_s`` is non-decreasing in world size.
    """
    if not isinstance(model, ClusterModel):
        raise ValueError(f"model must be a ClusterModel, got {type(model).__name__}")
    if len(world_sizes) == 0 or len(depths) == 0:
        raise ValueError(f"world_sizes = {list(world_sizes)} and depths = {list(depths)} must be non-empty")
    for p in world_sizes:
        _check_int("project", "world_sizes[i]", p, 1)
    for k in depths:
        _check_int("project", "depths[i]", k, 0)
    rows: List[Dict[str, Any]] = []
    for p in world_sizes:
        t = model.stage_times(p)
        reactive = step_time_reactive(t)
        for k in depths:
            s = step_time_proactive(k, t)
            rows.append({
                "world_size": p, "depth": k, "step_s": s, "reactive_step_s": reactive,
                "speedup": reactive / s if s > 0 else 1.0, "exposed_fetch_s": s - t.main_s,
                "overlap_window_s": overlap_window_s(k, t),
                "compute_s": t.compute_s, "input_a2a_s": t.input_a2a_s, "output_a2a_s": t.output_a2a_s,
                "allreduce_s": t.allreduce_s, "fetch_s": t.fetch_s, "other_s": t.other_s,
                "bound": _bound(k, t),
            })
    return rows


def model_assumptions(model: ClusterModel) -> List[str]:
    """What a projection of ``model`` assumes, one short line each (the text box of the plot)."""
    net = ("network free (alpha = beta = 0)" if model.alpha_s == 0 and model.beta_s_per_byte == 0 else
           f"network alpha {model.alpha_s * 1e6:.3g} us/peer, "
           + (f"{1 / model.beta_s_per_byte / 1e9:.3g} GB/s" if model.beta_s_per_byte > 0 else "unlimited bandwidth"))
    return [
        "weak scaling: per-GPU batch and tables fixed, every rank alike",
        f"compute {model.compute_s * 1e3:.1f} ms/step (independent of GPUs), other {model.overhead_s * 1e3:.2g} ms",
        f"{net}; ring all-reduce of {model.dense_param_bytes / 1e6:.3g} MB, "
        f"output all-to-all {model.output_bytes_per_step / 1e6:.3g} MB/rank",
        f"host link {model.host_link_bytes_per_s / 1e9:.3g} GB/s + {model.host_link_latency_s * 1e6:.3g} us, "
        f"one copy engine: {model.rows_per_batch * (1 - model.hit_rate):.4g} cold rows/batch x "
        f"{model.bytes_per_row:.0f} B = {model.fetch_s() * 1e3:.3g} ms",
        "a projection of a model, not a measurement",
    ]


def _default_assumptions(rows: Sequence[Mapping[str, Any]]) -> List[str]:
    r = rows[0]
    out = ["weak scaling: per-GPU batch and tables fixed, every rank alike"]
    if "compute_s" in r and "fetch_s" in r:
        out.append(f"compute {float(r['compute_s']) * 1e3:.1f} ms/step, fetch {float(r['fetch_s']) * 1e3:.3g} ms/batch")
    out.append("a projection of a model, not a measurement")
    return out


# Depth lines: reactive dashed; each proactive depth its own line style and marker, later ones
# hollow and smaller so that lines drawn on top of each other stay visible.
_LINESTYLES = ("-", "-.", ":", (0, (5, 1, 1, 1, 1, 1)))
_MARKERS = "osD^vP*X"


def projection_figure(rows: Sequence[Mapping[str, Any]], title: Optional[str] = None,
                      assumptions: Optional[Union[str, Sequence[str]]] = None) -> Any:
    """The matplotlib ``Figure`` of :func:`plot_projection` (no file written).

    Two panels against GPUs (log2 x axis), step time (ms) and speedup over reactive, one line
    per depth, each with its own line style and marker and a legend on both panels; depths
    whose lines coincide are labelled so (legend and line end). ``assumptions`` (lines, or
    one string) go in a text box under the panels; by default what ``rows`` tell.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    if len(rows) == 0:
        raise ValueError("rows is empty: nothing to plot")
    for i, r in enumerate(rows):
        for k in ("world_size", "depth", "step_s", "reactive_step_s"):
            if k not in r:
                raise ValueError(f"rows[{i}] lacks key {k!r} (expected rows from project())")
    depths = sorted({int(r["depth"]) for r in rows})
    sizes = sorted({int(r["world_size"]) for r in rows})
    if assumptions is None:
        assumptions = _default_assumptions(rows)
    notes = [assumptions] if isinstance(assumptions, str) else list(assumptions)
    series: Dict[int, List[Tuple[int, float, float]]] = {
        k: sorted((int(r["world_size"]), float(r["step_s"]), float(r["reactive_step_s"]))
                  for r in rows if int(r["depth"]) == k)
        for k in depths
    }

    def same(a: int, b: int) -> bool:
        pa, pb = series[a], series[b]
        return [p for p, _, _ in pa] == [p for p, _, _ in pb] and all(
            math.isclose(x, y, rel_tol=1e-6, abs_tol=1e-12) for (_, x, _), (_, y, _) in zip(pa, pb))

    # groups of depths whose lines coincide (first depth of the group leads)
    leader: Dict[int, int] = {}
    for k in depths:
        leader[k] = next((j for j in depths if j < k and leader[j] == j and same(j, k)), k)
    for k in depths:
        group = [j for j in depths if leader[j] == k]
        if len(group) > 1:
            notes.append(f"depths {' = '.join(str(j) for j in group)}: identical step times in this model "
                         f"(lines drawn on top of each other)")
    box_h = 0.25 + 0.145 * (len(notes) + 1)  # inches: one line per note + the heading
    fig = Figure(figsize=(12, 4.6 + box_h), dpi=120)
    FigureCanvasAgg(fig)
    ax_t, ax_s = fig.subplots(1, 2)
    colors = {k: f"C{i}" for i, k in enumerate(depths)}
    for i, k in enumerate(depths):
        pts = series[k]
        if k == 0:
            label, style, marker = "reactive (depth 0)", "--", "o"
        else:
            n = sum(1 for j in depths if 0 < j < k)
            label = f"proactive (depth {k})"
            style, marker = _LINESTYLES[n % len(_LINESTYLES)], _MARKERS[(n + 1) % len(_MARKERS)]
        if leader[k] != k:
            label += f", same as depth {leader[k]}"
        nested = sum(1 for j in depths if j < k and leader[j] == leader[k])  # lines already under this one
        mk = {"marker": marker, "ms": max(3.5, 8.0 - 2.0 * nested), "lw": max(1.0, 2.4 - 0.6 * nested),
              "color": colors[k], "markerfacecolor": colors[k] if nested == 0 else "none", "markeredgewidth": 1.3}
        xs = [p for p, _, _ in pts]
        ax_t.plot(xs, [st * 1e3 for _, st, _ in pts], linestyle=style, label=label, **mk)
        ax_s.plot(xs, [rs / st if st > 0 else 1.0 for _, st, rs in pts], linestyle=style, label=label, **mk)
    # name every depth of a group at the end of its line
    for ax, value in ((ax_t, lambda st, rs: st * 1e3), (ax_s, lambda st, rs: rs / st if st > 0 else 1.0)):
        ends = []
        for k in depths:
            if leader[k] != k:
                continue
            group = [j for j in depths if leader[j] == k]
            p, st, rs = series[k][-1]
            text = ("depth " if len(group) == 1 else "depths ") + " = ".join(str(j) for j in group)
            ends.append((value(st, rs), text, colors[k], p))
        ends.sort()
        lo, hi = ax.get_ylim()
        last = -math.inf
        for y, text, color, p in ends:  # nudged apart so that close line ends stay readable
            y = max(y, last + 0.07 * (hi - lo))
            last = y
            ax.text(p * 1.12, y, text, fontsize=8, color=color, va="center", ha="left")
    for ax, ylab in ((ax_t, "step time (ms)"), (ax_s, "speedup over reactive")):
        ax.set_xscale("log", base=2)
        ax.set_xticks(sizes)
        ax.set_xticklabels([str(p) for p in sizes], fontsize=8)
        ax.set_xlim(sizes[0] / 1.25, sizes[-1] * 3.4)  # room for the line-end labels
        ax.set_xlabel("GPUs")
        ax.set_ylabel(ylab)
        ax.grid(True, which="major", linestyle=":", linewidth=0.6)
    ax_t.set_ylim(bottom=0)
    ax_s.axhline(1.0, color="gray", linewidth=0.8)
    ax_t.set_title("step time per GPU", fontsize=10)
    ax_s.set_title("speedup of each depth over reactive", fontsize=10)
    ax_t.legend(fontsize=8, loc="upper left")
    ax_s.legend(fontsize=8, loc="upper right")
    fig.suptitle(title or "Projected step time, weak scaling (model)", fontsize=11)
    fig.text(0.01, 0.01, "Assumptions:\n" + "\n".join(f"- {n}" for n in notes), ha="left", va="bottom",
             fontsize=8, family="monospace",
             bbox={"boxstyle": "round", "facecolor": "#f4f4f4", "edgecolor": "gray", "linewidth": 0.6})
    height = 4.6 + box_h
    fig.subplots_adjust(left=0.06, right=0.97, top=1 - 0.7 / height, bottom=(box_h + 0.6) / height, wspace=0.2)
    return fig


def plot_projection(rows: Sequence[Mapping[str, Any]], path: Union[str, Path], title: Optional[str] = None,
                    assumptions: Optional[Union[str, Sequence[str]]] = None) -> Path:
    """PNG of :func:`projection_figure` (two panels against GPUs, one line per depth: step
    time (ms) and speedup over reactive, assumptions in a text box). ``rows`` as returned by
    :func:`project`. Returns the path."""
    fig = projection_figure(rows, title=title, assumptions=assumptions)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    return path
