"""Is a measured difference real? Intervals of the rates, verdicts on the ratios, sweep checks.

Each configuration's rate comes with an interval: the range of its per-round rates, widened
to the distribution-free 95% confidence interval of the median step over every measured step.
Two rates whose intervals overlap are "within noise" of each other. Stdlib only.
"""

from __future__ import annotations

import math
import statistics
from typing import Any, Dict, List, Sequence, Tuple

__all__ = ["add_noise", "overlap", "noise_verdicts", "sweep_warnings"]

_Z95 = 1.959964


def _median_ci(values: Sequence[float]) -> Tuple[float, float]:
    """Distribution-free 95% confidence interval of the median (order statistics)."""
    x = sorted(values)
    n = len(x)
    half = _Z95 * math.sqrt(n) / 2
    lo = max(1, int(math.floor(n / 2 - half)))
    hi = min(n, int(math.ceil(1 + n / 2 + half)))
    return x[lo - 1], x[hi - 1]


def add_noise(c: Dict[str, Any], samples_per_step: int) -> None:
    """Adds ``samples_per_s_rounds``, ``samples_per_s_interval`` and ``noise_pct`` to a config."""
    per_round = [r for r in c.get("step_ms_per_round") or [] if r]
    if not per_round:
        return
    rate = lambda ms: samples_per_step / (ms / 1e3)  # noqa: E731
    rounds = [rate(statistics.median(r)) for r in per_round]
    ci_fast, ci_slow = _median_ci([t for r in per_round for t in r])
    lo = min([rate(ci_slow), c["samples_per_s"], *rounds])
    hi = max([rate(ci_fast), c["samples_per_s"], *rounds])
    c["samples_per_s_rounds"] = rounds
    c["samples_per_s_interval"] = [lo, hi]
    c["noise_pct"] = 100 * (hi - lo) / 2 / c["samples_per_s"]


def overlap(a: Dict[str, Any], b: Dict[str, Any]) -> bool:
    (a_lo, a_hi), (b_lo, b_hi) = a["samples_per_s_interval"], b["samples_per_s_interval"]
    return a_lo <= b_hi and b_lo <= a_hi


def _ratio(a: Dict[str, Any], b: Dict[str, Any]) -> Dict[str, Any]:
    (a_lo, a_hi), (b_lo, b_hi) = a["samples_per_s_interval"], b["samples_per_s_interval"]
    return {"value": a["samples_per_s"] / b["samples_per_s"], "interval": [a_lo / b_hi, a_hi / b_lo],
            "within_noise": overlap(a, b)}


def noise_verdicts(reactive: Dict[str, Any], resident: Dict[str, Any], best: Dict[str, Any],
                   proactive: Sequence[Dict[str, Any]]) -> Dict[str, Any]:
    """Whether the headline ratios are beyond noise (configs carry ``samples_per_s_interval``).

    All-resident is the upper bound of proactive: proactive above it is reported as "at the
    upper bound" when within noise and as an upper-bound violation (suspect figures) beyond.
    """
    speed = _ratio(best, reactive)
    speed["verdict"] = ("within noise: the two intervals overlap, no measured difference" if speed["within_noise"]
                        else "beyond noise")
    frac = _ratio(best, resident)
    above = frac["value"] > 1.0
    frac["upper_bound_violation"] = above and not frac["within_noise"]
    if above and frac["within_noise"]:
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
    tied = [c["prefetch_depth"] for c in proactive if c["name"] != best["name"] and overlap(c, best)]
    return {"speedup_vs_reactive": speed, "fraction_of_resident": frac, "depths_within_noise_of_best": tied,
            "method": "interval = range of the per-round rates, widened to the 95% CI of the median step "
                      "(order statistics over every measured step); within noise = intervals overlap"}


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
