"""Noise estimates for the bench and ``compare``: rates and ratios with a 95% interval, or none.

A step's time on a shared machine is its work plus interference (the other rank, the fetch
workers, the link emulation, the OS), which only ever adds: on a 2-core machine single steps
of a 15 ms configuration range from 9 to 25 ms. Each configuration therefore runs in many
short rounds (every round runs every configuration once, back to back, in rotated order) and
each round is summarised by one rate (the bench: from its *interquartile mean* step, the mean
of the middle half of its steps, which drops the interference spikes; ``compare``: from the
round's total step time).

With at least ``MIN_PAIRED_ROUNDS`` rounds:

* a rate's interval is the 95% t-interval of the mean of its per-round log-rates;
* a ratio of two configurations is judged on the rounds *paired*: the 95% t-interval of the
  mean of the per-round log-ratios. Drift over the run (another job, thermal state, the page
  cache) moves both rates of a round together and cancels in their ratio, where a quotient
  of two separate intervals counts it twice. "Within noise" means the interval holds 1.

Every interval is widened to include the reported figure. With fewer rounds (``bench
--quick``, short ``compare`` runs) there is no interval and no verdict: a t-interval of two
to five values is too wide to mean anything, and the spread of one round's steps says nothing
about the next round's. The figures are then printed bare, as a smoke test. Stdlib only.
"""

from __future__ import annotations

import math
import statistics
from typing import Any, Dict, List, Optional, Sequence, Tuple

__all__ = ["add_noise", "rate_interval", "within_noise", "paired_rounds", "paired_ratio", "format_ratio", "no_verdict",
           "noise_verdicts", "sweep_warnings", "MIN_PAIRED_ROUNDS"]

_Z95 = 1.959964
#: Rounds from which intervals come from the per-round figures (a t-interval needs a few
#: degrees of freedom before its width means anything: t(0.975, 5) = 2.57).
MIN_PAIRED_ROUNDS = 6


def _t975(df: int) -> float:
    """The 0.975 quantile of Student's t with ``df`` degrees of freedom (Cornish-Fisher
    expansion around the normal's; within 0.2% of the exact value from df = 5 on)."""
    z = _Z95
    return (z + (z ** 3 + z) / (4 * df) + (5 * z ** 5 + 16 * z ** 3 + 3 * z) / (96 * df ** 2)
            + (3 * z ** 7 + 19 * z ** 5 + 17 * z ** 3 - 15 * z) / (384 * df ** 3))


def _log_t_interval(values: Sequence[float]) -> Tuple[float, float]:
    """95% t-interval of the geometric mean of positive ``values`` (len >= 2)."""
    logs = [math.log(v) for v in values]
    half = _t975(len(logs) - 1) * statistics.stdev(logs) / math.sqrt(len(logs))
    mean = statistics.fmean(logs)
    return math.exp(mean - half), math.exp(mean + half)


def _interquartile_mean(values: Sequence[float]) -> float:
    """Mean of the middle half of ``values`` (all of them when there are fewer than 4)."""
    x = sorted(values)
    k = len(x) // 4
    return statistics.fmean(x[k:len(x) - k])


def add_noise(c: Dict[str, Any], samples_per_step: int) -> None:
    """Adds ``samples_per_s_rounds`` (one rate per round, from its interquartile mean step)
    to a configuration, and with at least ``MIN_PAIRED_ROUNDS`` rounds ``samples_per_s_interval``
    and ``noise_pct`` (its half-width in % of the rate)."""
    per_round = [r for r in c.get("step_ms_per_round") or [] if r]
    if not per_round:
        return
    rate = lambda ms: samples_per_step / (ms / 1e3)  # noqa: E731
    rounds = [rate(_interquartile_mean(r)) for r in per_round]
    c["samples_per_s_rounds"] = rounds
    interval = rate_interval(c["samples_per_s"], rounds)
    if interval is None:
        return  # no interval: see the module
    c["samples_per_s_interval"] = interval
    c["noise_pct"] = 100 * (interval[1] - interval[0]) / 2 / c["samples_per_s"]


def rate_interval(value: float, rounds: Sequence[float]) -> Optional[List[float]]:
    """The 95% interval ``[lo, hi]`` of a rate from its per-round rates (t-interval of their
    log-mean, widened to include the reported ``value``); None with fewer than
    ``MIN_PAIRED_ROUNDS`` rounds (see the module)."""
    if len(rounds) < MIN_PAIRED_ROUNDS:
        return None
    lo, hi = _log_t_interval(rounds)
    return [min(lo, value), max(hi, value)]


def paired_rounds(a: Dict[str, Any], b: Dict[str, Any]) -> List[float]:
    """``a``'s rate over ``b``'s, round by round (the rounds both ran; a configuration that
    failed in a round has no entry for it, so the lists are aligned only when equal)."""
    ra, rb = a.get("samples_per_s_rounds") or [], b.get("samples_per_s_rounds") or []
    if len(ra) != len(rb):
        return []
    return [x / y for x, y in zip(ra, rb)]


def no_verdict(rounds: int) -> str:
    """What a ratio without an interval says instead (fewer rounds than a verdict needs)."""
    return (f"no interval, no verdict: {rounds} paired round{'s' if rounds != 1 else ''}, a verdict needs at "
            f"least {MIN_PAIRED_ROUNDS}")


def paired_ratio(value: float, ratios: Sequence[float]) -> Dict[str, Any]:
    """A ratio ``value`` judged on its per-round ``ratios`` (the same two configurations, round
    by round): ``{"value", "interval", "within_noise", "paired_rounds", "verdict"}``. With fewer
    than ``MIN_PAIRED_ROUNDS`` rounds ``interval`` and ``within_noise`` are None."""
    n = len(ratios)
    if n < MIN_PAIRED_ROUNDS:
        return {"value": value, "interval": None, "within_noise": None, "paired_rounds": n,
                "verdict": no_verdict(n)}
    lo, hi = _log_t_interval(ratios)
    lo, hi = min(lo, value), max(hi, value)
    within = lo <= 1.0 <= hi
    return {"value": value, "interval": [lo, hi], "within_noise": within, "paired_rounds": n,
            "verdict": "within noise: no measured difference" if within else "beyond noise"}


def format_ratio(r: Dict[str, Any], unit: str = "x") -> str:
    """``1.23x [1.10-1.37], beyond noise``, or ``1.23x (no interval, no verdict: ...)``."""
    if r["interval"] is None:
        return f"{r['value']:.2f}{unit} ({r['verdict']})"
    lo, hi = r["interval"]
    return f"{r['value']:.2f}{unit} [{lo:.2f}-{hi:.2f}], {r['verdict']}"


def _ratio(a: Dict[str, Any], b: Dict[str, Any]) -> Dict[str, Any]:
    return paired_ratio(a["samples_per_s"] / b["samples_per_s"], paired_rounds(a, b))


def within_noise(a: Dict[str, Any], b: Dict[str, Any]) -> Optional[bool]:
    """Whether ``a``'s and ``b``'s rates are within noise of each other (see the module);
    None with fewer rounds than a verdict needs."""
    return _ratio(a, b)["within_noise"]


def noise_verdicts(reactive: Dict[str, Any], resident: Dict[str, Any], best: Dict[str, Any],
                   proactive: Sequence[Dict[str, Any]]) -> Dict[str, Any]:
    """Whether the headline ratios are beyond noise, judged on the per-round rates
    (``samples_per_s_rounds``); with fewer than ``MIN_PAIRED_ROUNDS`` rounds, no verdicts.

    All-resident is the upper bound of proactive: proactive above it is reported as "at the
    upper bound" when within noise and as an upper-bound violation (suspect figures) beyond.
    """
    speed = _ratio(best, reactive)
    frac = _ratio(best, resident)
    above = frac["value"] > 1.0
    frac["upper_bound_violation"] = bool(above and frac["within_noise"] is False)
    if frac["within_noise"] is None:
        if above:
            frac["verdict"] += "; above all-resident, its upper bound: not a win"
    elif above and frac["within_noise"]:
        frac["verdict"] = ("within noise of all-resident, its upper bound: read as 'at the upper bound', "
                           "not a win")
    elif above:
        frac["verdict"] = ("UPPER-BOUND VIOLATION: above all-resident beyond noise, which proactive cannot "
                           "be (all-resident is its upper bound); the figures are suspect (machine contention?), "
                           "rerun with more --rounds / --steps")
    elif frac["within_noise"]:
        frac["verdict"] = "within noise of all-resident"
    else:
        frac["verdict"] = "below all-resident beyond noise"
    tied = [c["prefetch_depth"] for c in proactive if c["name"] != best["name"] and within_noise(c, best)]
    return {"speedup_vs_reactive": speed, "fraction_of_resident": frac, "depths_within_noise_of_best": tied,
            "method": method(speed["paired_rounds"])}


def method(paired: int) -> str:
    """How the ratios' intervals were formed, in words (for the JSON and the summary)."""
    if paired >= MIN_PAIRED_ROUNDS:
        return (f"each round's rate from its interquartile mean step; ratio interval = 95% t-interval of the mean "
                f"of the {paired} per-round log-ratios (every round runs every configuration back to back, so the "
                "machine's drift cancels), widened to include the reported ratio; within noise = it holds 1")
    return (f"{paired} round(s): no intervals and no verdicts (they need at least {MIN_PAIRED_ROUNDS} rounds: "
            "per-round ratios, whose spread is the noise)")


def sweep_warnings(rows: Sequence[Dict[str, Any]]) -> List[str]:
    """Warnings for rates that fall as the link gets faster, beyond noise (rows in any order)."""
    out: List[str] = []
    ordered = sorted(rows, key=lambda r: r["link"]["bandwidth_gbps"])
    for key, label in (("reactive_samples_per_s", "reactive"), ("proactive_samples_per_s", "proactive")):
        pts = [r for r in ordered if r.get(key) is not None and r.get(f"{key}_interval")]
        for a, b in zip(pts, pts[1:]):
            (a_lo, a_hi), (b_lo, b_hi) = a[f"{key}_interval"], b[f"{key}_interval"]
            if b[key] < a[key] and b_hi < a_lo:
                out.append(
                    f"non-monotonic sweep: {label} samples/s falls from {a[key]:.0f} [{a_lo:.0f}-{a_hi:.0f}] at "
                    f"{a['link']['bandwidth_gbps']:g} GB/s to {b[key]:.0f} [{b_lo:.0f}-{b_hi:.0f}] at "
                    f"{b['link']['bandwidth_gbps']:g} GB/s, beyond noise; a faster link cannot slow training "
                    f"down: the machine was probably busy, rerun with more --rounds / --steps")
    return out
