"""Analytical + discrete-event pipeline model of torchrec_proactive.bench.scaling."""

from __future__ import annotations

from dataclasses import replace

import pytest

from torchrec_proactive.bench.scaling import (
    ClusterModel,
    StageTimes,
    all_to_all_s,
    calibrate,
    overlap_window_s,
    plot_projection,
    prediction_error,
    project,
    ring_allreduce_s,
    simulate,
    simulate_trace,
    step_time_proactive,
    step_time_reactive,
)

MS = 1e-3


def _times(fetch_ms, compute_ms, i_ms, o_ms, a_ms, lat_ms=0.0, other_ms=0.0):
    return StageTimes(compute_s=compute_ms * MS, input_a2a_s=i_ms * MS, output_a2a_s=o_ms * MS,
                      allreduce_s=a_ms * MS, fetch_s=fetch_ms * MS, fetch_latency_s=lat_ms * MS,
                      other_s=other_ms * MS)


def _model(**kw):
    base = dict(compute_s=20 * MS, alpha_s=5e-6, beta_s_per_byte=1 / 20e9, dense_param_bytes=2e8,
                output_bytes_per_step=5e7, id_bytes_per_step=4e6, host_link_bytes_per_s=25e9,
                host_link_latency_s=1e-5, bytes_per_row=512.0, rows_per_batch=4e5, hit_rate=0.5)
    base.update(kw)
    return ClusterModel(**base)


def test_hand_computed_full_hiding():
    # fetch 10 ms, compute 20 ms, comms 5 ms (1 + 2 + 2)
    t = _times(10, 20, 1, 2, 2)
    assert step_time_reactive(t) == pytest.approx(35 * MS)
    assert step_time_proactive(0, t) == pytest.approx(35 * MS)
    assert overlap_window_s(1, t) == pytest.approx(25 * MS)
    for k in (1, 2, 4):  # 10 ms fits in the 25 ms window: fully hidden
        assert step_time_proactive(k, t) == pytest.approx(25 * MS)


def test_hand_computed_partial_hiding():
    # S0 = 4 + 1 + 1 + 0 = 6 ms, fetch 10 ms.
    t = _times(10, 4, 1, 1, 0)
    assert step_time_reactive(t) == pytest.approx(16 * MS)
    # whole fetch occupies the link: the link moves one batch per 10 ms whatever the depth
    assert step_time_proactive(1, t) == pytest.approx(10 * MS)
    assert step_time_proactive(2, t) == pytest.approx(10 * MS)
    # pure latency (transfers overlap): x = (F - k S0) / (k + 1)  ->  k=1: 6 + 2 = 8 ms
    lat = _times(10, 4, 1, 1, 0, lat_ms=10)
    assert step_time_proactive(1, lat) == pytest.approx(8 * MS)
    assert step_time_proactive(2, lat) == pytest.approx(6 * MS)
    # mixed: link busy 6 ms, latency 4 ms, S0 = 5 ms
    mix = _times(10, 3, 1, 1, 0)
    mix = replace(mix, fetch_latency_s=4 * MS)
    assert step_time_proactive(1, mix) == pytest.approx(7.5 * MS)
    assert step_time_proactive(2, mix) == pytest.approx(6 * MS)
    assert step_time_proactive(4, mix) == pytest.approx(6 * MS)


CASES = [
    _times(10, 20, 1, 2, 2),
    _times(10, 4, 1, 1, 0),
    _times(10, 4, 1, 1, 0, lat_ms=10),
    _times(10, 3, 1, 1, 0, lat_ms=4),
    _times(30, 5, 2, 2, 1, lat_ms=20, other_ms=1),
    _times(0, 7, 1, 1, 1),
]


@pytest.mark.parametrize("t", CASES)
@pytest.mark.parametrize("depth", [0, 1, 2, 4])
def test_simulator_agrees_with_formula(t, depth):
    sim = simulate(t, depth, num_steps=300)
    assert sim == pytest.approx(step_time_proactive(depth, t), rel=0.01)


def test_simulator_trace_and_jitter():
    t = _times(14, 10, 2, 2, 2)
    ev = simulate_trace(t, 2, num_steps=6)
    lanes = {e.lane for e in ev}
    assert lanes == {"data_dist", "fetch", "compute", "output_comm", "allreduce"}
    for b in range(6):  # the rows of a batch are in place before its compute starts
        fetch = next(e for e in ev if e.lane == "fetch" and e.batch == b)
        comp = next(e for e in ev if e.lane == "compute" and e.batch == b)
        ids = next(e for e in ev if e.lane == "data_dist" and e.batch == b)
        assert ids.end_s <= fetch.start_s and fetch.end_s <= comp.start_s
    fetches = sorted((e for e in ev if e.lane == "fetch"), key=lambda e: e.batch)
    for a, b in zip(fetches, fetches[1:]):  # single FIFO link
        assert a.end_s <= b.start_s + 1e-15
    # with jittered stage times deeper lookahead absorbs the variance (paired draws)
    j1 = simulate(t, 1, 300, jitter=0.5, seed=3)
    j4 = simulate(t, 4, 300, jitter=0.5, seed=3)
    assert j4 < j1
    assert simulate(t, 0, 300, jitter=0.5, seed=3) > j1


def test_alpha_beta_costs_hand_checked():
    # p = 4, 1 MB, beta = 1 ns/B, alpha = 10 us: 2*3/4*1e6*1e-9 + 2*3*1e-5 = 1.56 ms
    assert ring_allreduce_s(1e6, 4, 1e-5, 1e-9) == pytest.approx(1.56e-3)
    # all-to-all: 3*alpha + 3/4 * 4 MB * beta = 30 us + 3 ms
    assert all_to_all_s(4e6, 4, 1e-5, 1e-9) == pytest.approx(3.03e-3)
    assert ring_allreduce_s(1e6, 1, 1e-5, 1e-9) == 0.0
    assert all_to_all_s(1e6, 1, 1e-5, 1e-9) == 0.0
    m = _model()
    st = m.stage_times(8)
    assert st.allreduce_s == pytest.approx(2 * 7 / 8 * 2e8 / 20e9 + 14 * 5e-6)
    assert st.output_a2a_s == pytest.approx(7 * 5e-6 + 7 / 8 * 5e7 / 20e9)
    assert st.fetch_s == pytest.approx(1e-5 + 4e5 * 0.5 * 512 / 25e9)
    assert step_time_reactive(m, 8) == pytest.approx(step_time_reactive(st))


@pytest.mark.parametrize(
    "kw, field",
    [({"hit_rate": 1.5}, "hit_rate"), ({"alpha_s": -1.0}, "alpha_s"),
     ({"host_link_bytes_per_s": 0.0}, "host_link_bytes_per_s"), ({"compute_s": float("inf")}, "compute_s")],
)
def test_cluster_model_validation(kw, field):
    with pytest.raises(ValueError, match=field) as err:
        _model(**kw)
    assert repr(next(iter(kw.values()))) in str(err.value)


def test_stage_times_and_call_validation():
    with pytest.raises(ValueError, match="compute_s"):
        _times(1, -1, 0, 0, 0)
    with pytest.raises(ValueError, match="fetch_latency_s"):
        _times(1, 1, 0, 0, 0, lat_ms=2)
    with pytest.raises(ValueError, match="world_size"):
        StageTimes(1, 0, 0, 0, 0, world_size=0)
    with pytest.raises(ValueError, match="depth"):
        step_time_proactive(-1, _times(1, 1, 0, 0, 0))
    with pytest.raises(ValueError, match="world_size"):
        step_time_reactive(_model())
    with pytest.raises(ValueError, match="world_size"):
        _model().stage_times(0)
    with pytest.raises(ValueError, match="num_steps"):
        simulate(_times(1, 1, 0, 0, 0), 1, num_steps=1)


def test_projection_monotonic_allreduce_bound(tmp_path):
    m = _model(dense_param_bytes=4e9, alpha_s=2e-5)  # all-reduce dominated
    sizes = (8, 16, 32, 64, 128, 256, 512, 1024)
    rows = project(m, world_sizes=sizes, depths=(0, 1, 2, 4))
    assert len(rows) == len(sizes) * 4
    assert all(r["allreduce_s"] > r["compute_s"] for r in rows)
    for k in (0, 1, 2, 4):
        steps = [r["step_s"] for r in rows if r["depth"] == k]
        assert all(a <= b for a, b in zip(steps, steps[1:]))
    for r in rows:
        assert r["speedup"] == pytest.approx(step_time_reactive(m, r["world_size"]) / r["step_s"])
        assert r["step_s"] == pytest.approx(step_time_proactive(r["depth"], m, r["world_size"]))
    with pytest.raises(ValueError, match="world_sizes"):
        project(m, world_sizes=(0,))
    out = plot_projection(rows, tmp_path / "proj" / "projection.png")
    data = out.read_bytes()
    assert data.startswith(b"\x89PNG\r\n\x1a\n") and len(data) > 5_000


def _measure(truth: ClusterModel, world_size: int, depth: int) -> StageTimes:
    st = replace(truth.stage_times(world_size, depth), other_s=0.0)
    return replace(st, step_s=step_time_proactive(depth, truth.stage_times(world_size)))


def test_calibrate_recovers_model_and_prediction_error():
    truth = _model(overhead_s=2 * MS)
    measured = {f"p{p}-d{k}": _measure(truth, p, k) for p in (1, 2) for k in (0, 2)}
    template = replace(truth, compute_s=1.0, alpha_s=1.0, beta_s_per_byte=1.0, host_link_bytes_per_s=1.0,
                       overhead_s=0.0)
    fit = calibrate(measured, template)
    assert fit.compute_s == pytest.approx(truth.compute_s)
    assert fit.alpha_s == pytest.approx(truth.alpha_s, rel=1e-6)
    assert fit.beta_s_per_byte == pytest.approx(truth.beta_s_per_byte, rel=1e-6)
    assert fit.host_link_bytes_per_s == pytest.approx(truth.host_link_bytes_per_s, rel=1e-6)
    assert fit.overhead_s == pytest.approx(truth.overhead_s, rel=1e-6)
    err = prediction_error(fit, measured)
    assert set(err["configs"]) == set(measured)
    assert err["max_abs_rel_error"] < 1e-6
    # the measured stages (without the 2 ms overhead) underpredict the reactive step
    assert err["configs"]["p1-d0"]["formula_rel_error"] < 0

    # per-config dicts that carry the sizes work without a template
    sizes = {k: getattr(truth, k) for k in ("dense_param_bytes", "output_bytes_per_step", "id_bytes_per_step",
                                            "bytes_per_row", "rows_per_batch", "hit_rate", "host_link_latency_s")}
    as_dicts = {name: {**st.to_dict(), **sizes, "label": name} for name, st in measured.items()}
    fit2 = calibrate(as_dicts)
    assert fit2.alpha_s == pytest.approx(truth.alpha_s, rel=1e-6)
    assert prediction_error(fit2, as_dicts)["max_abs_rel_error"] < 1e-6
    # a known error: 10 % slower measured step
    slow = {"p2-d0": replace(measured["p2-d0"], step_s=measured["p2-d0"].step_s * 1.1)}
    assert prediction_error(fit, slow)["configs"]["p2-d0"]["rel_error"] == pytest.approx(1 / 1.1 - 1)


def test_calibrate_errors():
    truth = _model()
    one_rank = {"p1": _measure(truth, 1, 0)}
    with pytest.raises(ValueError, match="sizes"):
        calibrate(one_rank)
    with pytest.raises(ValueError, match="alpha_s"):
        calibrate({"p1": {**one_rank["p1"].to_dict(), "dense_param_bytes": 1, "output_bytes_per_step": 1,
                          "id_bytes_per_step": 1, "bytes_per_row": 4, "rows_per_batch": 10, "hit_rate": 0.5}})
    # with a template the network parameters fall back to it
    fit = calibrate(one_rank, truth)
    assert fit.alpha_s == truth.alpha_s
    with pytest.raises(ValueError, match="step_s"):
        prediction_error(truth, {"x": replace(one_rank["p1"], step_s=None)})


def test_projection_figure_reads_at_a_glance():
    from torchrec_proactive.bench.scaling import model_assumptions, projection_figure

    m = _model()  # compute 20 ms hides a 4 ms fetch at every depth >= 1: depths 1, 2, 4 coincide
    rows = project(m)
    fig = projection_figure(rows, assumptions=model_assumptions(m))
    panels = [ax for ax in fig.axes if ax.get_xlabel() == "GPUs"]
    assert len(panels) == 2
    for ax in panels:
        legend = ax.get_legend()
        assert legend is not None, ax.get_ylabel()
        labels = [t.get_text() for t in legend.get_texts()]
        assert len(labels) == 4 and labels[0].startswith("reactive")
        # the two depths that draw on top of depth 1 say so
        assert sum("same as depth 1" in lab for lab in labels) == 2, labels
        lines = [ln for ln in ax.get_lines() if not ln.get_label().startswith("_")]
        styles = {(ln.get_linestyle(), ln.get_marker()) for ln in lines}
        assert len(lines) == 4 and len(styles) == 4  # every depth its own line style and marker
        # a label at the end of the lines names every depth of a coinciding group
        assert any("1 = 2 = 4" in t.get_text() for t in ax.texts), [t.get_text() for t in ax.texts]
    boxes = [t for t in fig.texts if t.get_bbox_patch() is not None]
    assert len(boxes) == 1
    text = boxes[0].get_text()
    for fragment in ("weak scaling", "compute 20.0 ms", "host link 25 GB/s", "not a measurement"):
        assert fragment in text, text
    # without given assumptions the figure still states what it assumes
    default = projection_figure(rows)
    assert any("weak scaling" in t.get_text() for t in default.texts if t.get_bbox_patch() is not None)


def test_projection_figure_distinct_depths_are_not_marked_as_coinciding():
    from torchrec_proactive.bench.scaling import projection_figure

    # (in the cluster model depths >= 1 always coincide; rows as a simulator with jitter gives them)
    rows = [{**r, "step_s": r["step_s"] * (1 - 0.05 * r["depth"])} for r in project(_model())]
    fig = projection_figure(rows)
    for ax in [a for a in fig.axes if a.get_xlabel() == "GPUs"]:
        labels = [t.get_text() for t in ax.get_legend().get_texts()]
        assert not any("same as" in lab for lab in labels), labels
