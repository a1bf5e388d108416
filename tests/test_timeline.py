"""Timeline renderer, Chrome trace writer and summary of torchrec_proactive.bench.timeline."""

from __future__ import annotations

import json
import math
import re

import pytest

from torchrec_proactive.bench.timeline import (
    LANES,
    TraceEvent,
    dump_events,
    lane_order,
    load_events,
    render_timeline_png,
    summarize,
    write_chrome_trace,
)

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _synthetic_trace(depth: int, num_batches: int = 10, ranks: int = 1, t0: float = 1000.0):
    """A hand-written pipeline trace (ms units as perf_counter seconds offsets): reactive runs
    a2a -> fetch -> fwd/bwd -> out comm -> allreduce; proactive fetches batch b+depth during
    step b. Step = 1 ms a2a + 10 ms compute + 2 ms out + 1 ms allreduce (+4 ms fetch if reactive)."""
    ms = 1e-3
    events = []
    for r in range(ranks):
        t = t0 + 0.0002 * r
        if depth > 0:  # prologue: ids + rows of batches 0..depth-1
            for b in range(depth):
                events.append(TraceEvent("data_dist", f"a2a ids b{b}", b, t, t + 1 * ms, r))
                events.append(TraceEvent("fetch", f"fetch b{b}", b, t + 1 * ms, t + 5 * ms, r))
                t += 5 * ms
        for b in range(num_batches):
            nb = b + depth
            events.append(TraceEvent("data_dist", f"a2a ids b{nb}", nb, t, t + 1 * ms, r))
            t += 1 * ms
            if depth == 0:
                events.append(TraceEvent("fetch", f"fetch b{b}", b, t, t + 4 * ms, r))
                t += 4 * ms
            else:
                events.append(TraceEvent("fetch", f"fetch b{nb}", nb, t, t + 4 * ms, r))
            events.append(TraceEvent("compute", f"fwd b{b}", b, t, t + 4 * ms, r))
            events.append(TraceEvent("compute", f"bwd b{b}", b, t + 4 * ms, t + 10 * ms, r))
            t += 10 * ms
            events.append(TraceEvent("output_comm", f"a2a out b{b}", b, t, t + 2 * ms, r))
            t += 2 * ms
            events.append(TraceEvent("allreduce", f"allreduce b{b}", b, t, t + 1 * ms, r))
            t += 1 * ms
    return events


def test_event_roundtrip_and_validation():
    e = TraceEvent("fetch", "fetch b7", 7, 1.0, 1.5, rank=1)
    assert TraceEvent.from_dict(e.to_dict()) == e
    assert TraceEvent.from_dict({"lane": "compute", "name": "fwd b1", "batch": 1, "start_s": 0, "end_s": 1}).rank == 0
    with pytest.raises(ValueError, match="end_s"):
        TraceEvent("fetch", "x", 0, 2.0, 1.0)
    with pytest.raises(ValueError, match="rank"):
        TraceEvent("fetch", "x", 0, 0.0, 1.0, rank=-1)
    with pytest.raises(ValueError, match="start_s"):
        TraceEvent("fetch", "x", 0, float("nan"), 1.0)
    with pytest.raises(ValueError, match="lacks"):
        TraceEvent.from_dict({"lane": "fetch"})
    assert lane_order([TraceEvent("zzz", "", 0, 0, 1), TraceEvent("compute", "", 0, 0, 1),
                       TraceEvent("fetch", "", 0, 0, 1)]) == ["fetch", "compute", "zzz"]


def test_render_png_from_recorded_trace(tmp_path):
    recorded = {"reactive (depth 0)": _synthetic_trace(0, ranks=2), "proactive (depth 2)": _synthetic_trace(2, ranks=2)}
    # "recorded": go through the on-disk event format (and the plain-dict form the pipeline emits)
    saved = dump_events(recorded, tmp_path / "events.json")
    loaded = load_events(saved)
    assert loaded == recorded
    as_dicts = {k: [e.to_dict() for e in v] for k, v in loaded.items()}
    out = render_timeline_png(as_dicts, tmp_path / "fig" / "timeline.png", max_batches=4, title="test")
    data = out.read_bytes()
    assert data.startswith(PNG_MAGIC) and len(data) > 10_000
    out_all = render_timeline_png(loaded, tmp_path / "all.png", ranks="all")
    assert out_all.read_bytes().startswith(PNG_MAGIC)
    with pytest.raises(ValueError):
        render_timeline_png({}, tmp_path / "empty.png")
    with pytest.raises(ValueError, match="max_batches"):
        render_timeline_png(loaded, tmp_path / "bad.png", max_batches=0)


def test_chrome_trace_schema(tmp_path):
    cfgs = {"reactive (depth 0)": _synthetic_trace(0, 4, ranks=2),
            "proactive (depth 2)": _synthetic_trace(2, 4, ranks=2, t0=50.0)}
    path = write_chrome_trace(cfgs, tmp_path / "trace.json")
    doc = json.loads(path.read_text())
    evs = doc["traceEvents"]
    meta = [e for e in evs if e["ph"] == "M"]
    xs = [e for e in evs if e["ph"] == "X"]
    assert len(xs) == sum(len(v) for v in cfgs.values())
    procs = {e["pid"]: e["args"]["name"] for e in meta if e["name"] == "process_name"}
    assert procs == {1: "reactive (depth 0)", 2: "proactive (depth 2)"}
    threads = {(e["pid"], e["tid"]): e["args"]["name"] for e in meta if e["name"] == "thread_name"}
    assert threads[(1, 0 * 10 + LANES.index("fetch"))] == "rank 0 / fetch"
    assert threads[(2, 1 * 10 + LANES.index("allreduce"))] == "rank 1 / allreduce"
    for e in xs:
        assert set(e) >= {"name", "ph", "ts", "dur", "pid", "tid"}
        assert isinstance(e["ts"], (int, float)) and e["ts"] >= 0 and e["dur"] >= 0
        assert (e["pid"], e["tid"]) in threads
        assert e["tid"] == e["args"]["rank"] * 10 + LANES.index(e["cat"])
    for pid in (1, 2):
        assert min(e["ts"] for e in xs if e["pid"] == pid) == 0.0  # relative to earliest event
    # microseconds: the first a2a lasts 1 ms, compute fwd 4 ms
    first = next(e for e in xs if e["pid"] == 1 and e["name"] == "a2a ids b0" and e["args"]["rank"] == 0)
    assert first["dur"] == pytest.approx(1000.0, abs=1e-3)
    fwd1 = next(e for e in xs if e["pid"] == 1 and e["name"] == "fwd b1" and e["args"]["rank"] == 0)
    assert fwd1["ts"] == pytest.approx((18 + 1 + 4) * 1000.0, abs=1e-3)  # step 0 = 18 ms
    assert fwd1["dur"] == pytest.approx(4000.0, abs=1e-3)


def test_summarize_hand_made_overlap():
    ev = [
        TraceEvent("compute", "fwd b0", 0, 0.0, 10.0, 0),
        TraceEvent("fetch", "fetch b1", 1, 5.0, 15.0, 0),      # 5..10 under compute
        TraceEvent("output_comm", "a2a out b0", 0, 12.0, 14.0, 0),  # 12..14 under comm
        TraceEvent("wait", "wait b1", 1, 10.0, 12.0, 0),       # waiting hides nothing
        TraceEvent("fetch", "fetch b0", 0, 0.0, 4.0, 1),       # rank 1: fully exposed ...
        TraceEvent("compute", "fwd b0", 0, 20.0, 30.0, 1),     # ... compute of another rank never hides it
    ]
    s = summarize(ev)
    assert s["ranks"] == [0, 1]
    assert s["per_rank"][0]["fetch_overlap_fraction"] == pytest.approx(0.7)
    assert s["per_rank"][1]["fetch_overlap_fraction"] == 0.0
    assert s["fetch_busy_s"] == pytest.approx(14.0)
    assert s["fetch_overlap_s"] == pytest.approx(7.0)
    assert s["fetch_overlap_fraction"] == pytest.approx(0.5)
    assert s["stall_s"] == pytest.approx(7.0)
    assert s["busy_s"]["compute"] == pytest.approx(20.0)
    assert s["lanes"] == ["fetch", "compute", "output_comm", "wait"]
    # A measured `stall` lane (the pipeline's blocking waits) defines the exposed fetch.
    measured = summarize(ev + [TraceEvent("stall", "stall b1", 1, 10.0, 11.0, 0)])
    assert measured["stall_s"] == pytest.approx(1.0)
    assert measured["fetch_overlap_fraction"] == pytest.approx(13.0 / 14.0)
    # two overlapping events of one lane count once
    s2 = summarize([TraceEvent("fetch", "a", 0, 0.0, 2.0), TraceEvent("fetch", "b", 1, 1.0, 3.0),
                    TraceEvent("compute", "c", 0, 0.0, 1.5)])
    assert s2["busy_s"]["fetch"] == pytest.approx(3.0)
    assert s2["fetch_overlap_fraction"] == pytest.approx(0.5)


def test_summarize_synthetic_pipelines():
    react = summarize(_synthetic_trace(0, 8), warmup_batches=2)
    pro = summarize(_synthetic_trace(2, 8), warmup_batches=2)
    assert react["mean_step_s"] == pytest.approx(18e-3)
    assert pro["mean_step_s"] == pytest.approx(14e-3)
    assert react["fetch_overlap_fraction"] == 0.0
    assert react["stall_s"] == pytest.approx(6 * 4e-3)
    assert pro["fetch_overlap_fraction"] == pytest.approx(1.0)
    assert math.isclose(pro["stall_s"], 0.0, abs_tol=1e-12)
    assert summarize([])["mean_step_s"] is None


def _with_tiny_stalls(events, stall_s=10e-6):
    """The recorded pipeline's measured blocking waits: a `stall` event at each forward start."""
    return events + [TraceEvent("stall", f"stall b{e.batch}", e.batch, e.start_s, e.start_s + stall_s, e.rank)
                     for e in events if e.name.startswith("fwd")]


def test_timeline_figure_shows_stalls_compute_labels_and_legend():
    from torchrec_proactive.bench.timeline import timeline_figure

    cfgs = {"reactive (depth 0)": _with_tiny_stalls(_synthetic_trace(0, 8), 4e-3),
            "proactive (depth 2)": _with_tiny_stalls(_synthetic_trace(2, 8))}
    fig = timeline_figure(cfgs, max_batches=4)
    ax = fig.axes[1]
    lo, hi = ax.get_xlim()
    # a 10 us stall in a ~60 ms window is drawn wide enough to see, and marked
    stalls = [c for c in ax.collections if c.get_gid() == "stall"]
    assert len(stalls) == 1
    widths = [p.vertices[:, 0].max() - p.vertices[:, 0].min() for p in stalls[0].get_paths()]
    assert len(widths) == 4 and min(widths) >= 0.004 * (hi - lo), (widths, hi - lo)
    assert any(ln.get_gid() == "stall_marker" and len(ln.get_xdata()) == 4 for ln in ax.get_lines())
    # compute blocks say which phase they are
    texts = [t.get_text() for t in ax.texts]
    assert any(t.startswith("fwd b") for t in texts) and any(t.startswith("bwd b") for t in texts), texts
    # summary per step, not a bare total
    summary = [t for t in texts if "stall" in t]
    assert summary and "ms/step" in summary[0], summary
    # one legend: batches, the compute phases and the stall
    (legend,) = fig.legends
    labels = [t.get_text() for t in legend.get_texts()]
    assert any(lab.startswith("stall") for lab in labels), labels
    assert {"fwd", "bwd"} <= {lab.split()[0] for lab in labels}, labels
    assert any(lab.startswith("batch") for lab in labels)


def _with_opt_steps(events, opt_s=20e-6):
    """The recorded pipeline's dense optimizer step: a short `opt` event after each backward."""
    return events + [TraceEvent("compute", f"opt b{e.batch}", e.batch, e.end_s, e.end_s + opt_s, e.rank)
                     for e in events if e.name.startswith("bwd")]


def _legend(fig):
    (legend,) = fig.legends
    return {t.get_text(): h for t, h in zip(legend.get_texts(), legend.legend_handles)}


def test_batch_colours_are_distinct_and_the_legend_lists_only_what_is_drawn():
    from matplotlib.colors import to_hex

    from torchrec_proactive.bench.timeline import timeline_figure

    cfgs = {"reactive (depth 0)": _with_opt_steps(_synthetic_trace(0, 16)),
            "proactive (depth 4)": _with_opt_steps(_synthetic_trace(4, 16))}
    fig = timeline_figure(cfgs, max_batches=7)
    legend = _legend(fig)
    batch_colour = {int(k.split()[1]): to_hex(h.get_facecolor()) for k, h in legend.items() if k.startswith("batch ")}
    assert len(batch_colour) >= 11 and max(batch_colour) - min(batch_colour) >= 10, batch_colour  # b and b + 10
    assert len(set(batch_colour.values())) == len(batch_colour), batch_colour  # one colour per batch
    # every bar drawn has its batch's legend colour, and every phase the legend lists is drawn
    drawn_hatches = set()
    for ax in fig.axes:
        for coll in ax.collections:
            if coll.get_gid() == "stall":
                continue
            drawn_hatches.add(coll.get_hatch() or "")
            assert {to_hex(c) for c in coll.get_facecolors()} <= set(batch_colour.values())
    phases = {k: h for k, h in legend.items() if k.split()[0] in ("fwd", "bwd", "opt")}
    assert "opt" not in {k.split()[0] for k in phases}, list(legend)  # 20 us bars: joined to their backward
    assert any(k.startswith("bwd") and "optimizer" in k for k in phases), list(legend)
    assert {h.get_hatch() or "" for h in phases.values()} == drawn_hatches, (list(phases), drawn_hatches)


def test_timeline_states_the_tables_figures_and_which_steps():
    from torchrec_proactive.bench.timeline import timeline_figure

    cfgs = {"reactive (depth 0)": _synthetic_trace(0, 8), "proactive (depth 2)": _synthetic_trace(2, 8)}
    figures = {"reactive (depth 0)": {"step_ms": 24.2, "stall_ms_per_step": 0.84, "steps": 384, "rounds": 12},
               "proactive (depth 2)": {"step_ms": 15.1, "stall_ms_per_step": 0.0, "steps": 384, "rounds": 12}}
    fig = timeline_figure(cfgs, max_batches=4, figures=figures)
    boxes = [" ".join(t.get_text() for t in ax.texts if "step" in t.get_text()) for ax in fig.axes]
    assert "median step 24.2 ms" in boxes[0] and "stall 0.84 ms/step" in boxes[0], boxes[0]
    assert "median step 15.1 ms" in boxes[1] and "stall 0.00 ms/step" in boxes[1], boxes[1]
    assert all("384 timed steps" in b and "12 rounds" in b for b in boxes), boxes
    # without the table's figures: the same statistics from the trace, and which steps they cover
    fig = timeline_figure(cfgs, max_batches=4)
    boxes = [" ".join(t.get_text() for t in ax.texts if "step" in t.get_text()) for ax in fig.axes]
    assert "median step 18.0 ms" in boxes[0] and "median step 14.0 ms" in boxes[1], boxes
    assert all(re.search(r"steps \d+-\d+ of the trace", b) for b in boxes), boxes
