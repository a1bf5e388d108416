"""The bench report: headline ratios from the per-configuration results, and its summary table.

Every ratio in the report is the quotient of two reported rates; the counters (rows, bytes,
hits, deferred batches, overflow rows) depend on the data, cache and depth only. Stdlib only.
"""

from __future__ import annotations

from typing import Any, Dict, List

from .noise import MIN_PAIRED_ROUNDS, add_noise, format_ratio, noise_verdicts, within_noise

__all__ = ["REQUIRED_KEYS", "COUNTER_KEYS", "VALIDATION_TOLERANCE", "summarize", "format_table"]

#: How close the scaling study's step model must come to the measured steps it is validated on.
VALIDATION_TOLERANCE = 0.10

REQUIRED_KEYS = (
    "reactive_samples_per_s", "proactive_samples_per_s", "resident_samples_per_s", "speedup_vs_reactive",
    "fraction_of_resident", "stall_ms_reactive", "stall_ms_proactive", "link", "best_depth", "configs",
)

#: Per-configuration counters (per step, summed over ranks): what moved, not how fast. They
#: depend on the data, the cache and the depth only, so tests can assert them exactly.
COUNTER_KEYS = ("rows_requested_per_step", "rows_fetched_per_step", "rows_fetched_at_lookup_per_step",
                "bytes_moved_per_step", "rows_written_back_per_step", "hit_rate", "deferred_batches_per_step",
                "overflow_rows_per_step", "mean_prefetch_lead")


def _targets(scaling: Dict[str, Any]) -> Dict[str, float]:
    """The scaling study's error targets (reports from before it named them: one tolerance)."""
    t = scaling.get("targets") or {}
    return {"calibration": t.get("calibration", VALIDATION_TOLERANCE),
            "held_out": t.get("held_out", VALIDATION_TOLERANCE)}


def _beyond_targets(scaling: Dict[str, Any]) -> bool:
    t = _targets(scaling)
    cal, held = scaling.get("calibration_max_abs_error"), scaling.get("held_out_max_abs_error")
    if cal is None and held is None:
        return scaling["validation_max_abs_error"] > VALIDATION_TOLERANCE
    return (cal or 0.0) > t["calibration"] or (held or 0.0) > t["held_out"]


def summarize(rank0: Dict[str, Any], world_size: int) -> Dict[str, Any]:
    """The report: headline ratios (each the quotient of the reported rates) + per-config table."""
    res = rank0["results"]
    batch = rank0.get("settings", {}).get("workload", {}).get("batch_size")
    for c in res.values():
        if "error" not in c and batch:
            add_noise(c, world_size * batch)
    proactive = {k: v for k, v in res.items() if k.startswith("depth_") and "error" not in v}
    best_name = max(proactive, key=lambda k: proactive[k]["samples_per_s"]) if proactive else None
    reactive, resident = res["reactive"], res["resident"]
    best = proactive.get(best_name) if best_name else None
    report: Dict[str, Any] = {
        "world_size": world_size,
        "backend": "gloo",
        "resident_samples_per_s": resident["samples_per_s"],
        "reactive_samples_per_s": reactive["samples_per_s"],
        "proactive_samples_per_s": best["samples_per_s"] if best else None,
        "best_depth": best["prefetch_depth"] if best else None,
        "speedup_vs_reactive": best["samples_per_s"] / reactive["samples_per_s"] if best else None,
        "fraction_of_resident": best["samples_per_s"] / resident["samples_per_s"] if best else None,
        "stall_ms_reactive": reactive["stall_ms_per_step"],
        "stall_ms_proactive": best["stall_ms_per_step"] if best else None,
        "stall_reduction": (1.0 - best["stall_ms_per_step"] / reactive["stall_ms_per_step"])
        if best and reactive["stall_ms_per_step"] > 0 else None,
        "reactive_stall_share_of_step": reactive["stall_ms_per_step"] / reactive["step_ms_median"],
        "ids_per_step": reactive.get("ids_per_step"),
        "link": rank0["link"],
        "comm_s": rank0["comm"],
        "configs": list(res.values()),
    }
    for name, key in (("resident", "resident_samples_per_s_interval"), ("reactive", "reactive_samples_per_s_interval")):
        if "samples_per_s_interval" in res[name]:
            report[key] = res[name]["samples_per_s_interval"]
    if best and "samples_per_s_interval" in best:
        report["proactive_samples_per_s_interval"] = best["samples_per_s_interval"]
    if best and all("samples_per_s_rounds" in c for c in (best, reactive, resident)):
        # (with fewer than noise.MIN_PAIRED_ROUNDS rounds: no intervals and no verdicts in it)
        report["noise"] = noise_verdicts(reactive, resident, best, list(proactive.values()))
    if "auto" in res:
        report["auto_depth"] = res["auto"].get("chosen_depth")
        report["auto_samples_per_s"] = res["auto"]["samples_per_s"]
    if "cache100" in res:
        report["cache100_overhead_vs_resident"] = resident["samples_per_s"] / res["cache100"]["samples_per_s"]
        within = within_noise(res["cache100"], resident)
        if within is not None:
            report["cache100_within_noise_of_resident"] = within
    return report


def _workload_lines(report: Dict[str, Any]) -> List[str]:
    """What was measured (the table's figures mean little without it) and, for a single
    round, that its verdicts rest on one round's step times only."""
    settings = report.get("settings")
    if not settings:
        return []
    w = settings["workload"]
    history = (f" + a history of {w['history_length']} ids per sample over {w['history_rows']} items (sequence model)"
               if w.get("model") == "sequence" else "")
    ids = f", {report['ids_per_step']} ids per step" if report.get("ids_per_step") else ""
    lines = [
        f"workload: {w['num_tables']} tables x {w['rows_per_table']} rows x {w['embedding_dim']}{history}, batch "
        f"{w['batch_size']} per rank{ids}, {report['world_size']} {report['backend']} rank(s), "
        f"cache load factor {settings['cache_load_factor']:g}; {settings['measure_steps']} timed steps x {settings['rounds']} "
        f"round(s) per configuration"
    ]
    if settings["rounds"] < MIN_PAIRED_ROUNDS:
        rounds = "one round" if settings["rounds"] == 1 else f"{settings['rounds']} rounds"
        lines.append(f"{rounds}: a smoke test, not a measurement - no intervals and no verdicts below (they need at "
                     f"least {MIN_PAIRED_ROUNDS} rounds: run without --quick and --rounds, 12 rounds, for ratios to quote)")
    return lines


def _noise_word(within: bool) -> str:
    return "within noise" if within else "beyond noise"


def format_table(report: Dict[str, Any]) -> str:
    link = report["link"]
    lines = _workload_lines(report) + [
        f"link: {link['kind']} (modelled copy engine) {link['bandwidth_gbps']:.4g} GB/s, "
        f"{link['latency_us']:.0f} us latency"
        + (f" - calibrated so a cold fetch costs {link['target_fetch_fraction']:.0%} of a resident step"
           if link.get("calibrated") else ""),
        f"{'config':<16}{'depth':>6}{'samples/s':>11}{'±%':>6}{'rounds':>7}{'step ms':>9}{'p90 ms':>8}{'stall ms':>9}"
        f"{'plan ms':>8}{'cpu ms':>7}{'rows/step':>10}{'@lookup':>8}{'MB/step':>8}{'hit':>6}{'deferred':>9}"
        f"{'overflow':>9}",
    ]
    for c in report["configs"]:
        if "error" in c:
            lines.append(f"{c['name']:<16}{c['prefetch_depth']!s:>6}  error: {c['error'][:80]}")
            continue
        hit = "-" if c.get("hit_rate") is None else f"{c['hit_rate']:.2f}"
        depth = "-" if c.get("prefetch_depth") is None else c["prefetch_depth"]
        noise = "-" if c.get("noise_pct") is None else f"{c['noise_pct']:.1f}"
        lines.append(
            f"{c['name']:<16}{depth!s:>6}{c['samples_per_s']:>11.0f}{noise:>6}{c.get('rounds', 1):>7}"
            f"{c['step_ms_median']:>9.1f}{c['step_ms_p90']:>8.1f}"
            f"{c['stall_ms_per_step']:>9.2f}{c.get('plan_ms_per_step', 0.0):>8.2f}"
            f"{c.get('plan_cpu_ms_per_step', 0.0):>7.2f}{c['rows_fetched_per_step']:>10.0f}"
            f"{c.get('rows_fetched_at_lookup_per_step', 0.0):>8.0f}"
            f"{c['bytes_moved_per_step'] / 1e6:>8.2f}{hit:>6}"
            f"{c.get('deferred_batches_per_step', 0.0):>9.2f}{c.get('overflow_rows_per_step', 0.0):>9.0f}"
        )
    noise = report.get("noise")
    if report.get("speedup_vs_reactive") is not None:
        speed = f"proactive (depth {report['best_depth']}) / reactive = "
        frac = "proactive / all-resident = "
        if noise:
            speed += format_ratio(noise["speedup_vs_reactive"])
            frac += format_ratio(noise["fraction_of_resident"], unit="")
        else:
            speed += f"{report['speedup_vs_reactive']:.2f}x"
            frac += f"{report['fraction_of_resident']:.2f}"
            if report["fraction_of_resident"] > 1:
                frac += " (above all-resident, its upper bound: not a win)"
        lines.append(f"{speed}; stall {report['stall_ms_reactive']:.1f} -> {report['stall_ms_proactive']:.1f} ms/step")
        lines.append(frac)
        if noise and noise["depths_within_noise_of_best"]:
            tied = noise["depths_within_noise_of_best"]
            which = f"depth {tied[0]} is" if len(tied) == 1 else f"depths {', '.join(str(d) for d in tied)} are"
            lines.append(f"depth {report['best_depth']} is the fastest, but {which} within noise of it")
    if "cache100_overhead_vs_resident" in report:
        line = f"100%-cache step time / stock resident = {report['cache100_overhead_vs_resident']:.2f}x"
        if "cache100_within_noise_of_resident" in report:
            line += f", {_noise_word(report['cache100_within_noise_of_resident'])}"
        lines.append(line)
    scaling = report.get("scaling")
    if scaling and scaling.get("validation_max_abs_error") is not None:
        worst = scaling["validation_max_abs_error"]
        ranks = sorted({v["ranks"] for v in scaling["validation"]})
        line = (f"scaling study: the step model reproduces these runs ({len(scaling['validation'])} configurations "
                f"at {'/'.join(map(str, ranks))} rank(s)) within {100 * worst:.1f}%")
        if scaling.get("held_out_max_abs_error") is not None:
            held = sum(1 for v in scaling["validation"] if v.get("held_out"))
            line += (f"; {held} held out: max |error| {100 * scaling['held_out_max_abs_error']:.1f}%, calibration "
                     f"{100 * (scaling.get('calibration_max_abs_error') or 0.0):.1f}%")
        if _beyond_targets(scaling):
            t = _targets(scaling)
            line += (f" - beyond its targets (calibration {100 * t['calibration']:.0f}%, held out "
                     f"{100 * t['held_out']:.0f}%): short (--quick) runs or a busy machine move the medians more than "
                     f"the model's error, so rerun without --quick on an idle machine before reading the projection; "
                     f"projection.json's misses give each entry beyond its target with the reason")
        lines.append(line)
        if scaling.get("validation_verdict"):
            disc = scaling.get("discriminating") or {}
            lines.append(f"scaling validation against a null model (no schedule, no parameters): "
                         f"{scaling['validation_verdict']} ({disc.get('count', 0)} held-out entries it misses by more "
                         f"than 15%; {disc.get('needed', 6)} needed)")
        for row in scaling.get("stragglers") or []:
            lines.append(f"stragglers, {row['ranks']} rank(s), skew {row['skew']:g}: reactive {row['reactive_ms']:.1f} ms, "
                         f"depth 1 (this product one batch ahead) {row['depth1_ms']:.1f} ms, best depth "
                         f"{row['best_depth']} {row['best_depth_ms']:.1f} ms "
                         f"({row['reactive_ms'] / row['best_depth_ms']:.2f}x reactive, "
                         f"{row['depth1_ms'] / row['best_depth_ms']:.2f}x depth 1)")
    if "auto_depth" in report:
        lines.append(f"auto chose depth {report['auto_depth']}")
    if noise and noise["speedup_vs_reactive"]["interval"] is not None:
        lines.append(f"±%: half-width of each rate's interval; {noise['method']}")
    lines.append("step ms: the median step (a step's time: its slowest rank's) over every timed step of every round; "
                 "p90 ms: the 90th percentile of the same; stall ms: per step, the slowest rank's mean over the same "
                 "steps (--timeline states these figures)")
    lines.append("plan ms / cpu ms: planning per step, wall time and the planning thread's CPU time (planning "
                 "overlaps the output all-to-all); deferred: prefetches per step that waited for pins; "
                 "overflow: rows per step served from the host tier (cache smaller than one batch); "
                 "@lookup: rows per step copied while the lookup waited (the critical path)")
    return "\n".join(lines)
