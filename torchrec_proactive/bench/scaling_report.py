"""Calibrate the pipeline model on measured runs (1 and 2 ranks) and project to 8-1024 GPUs."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any, Dict

from .rank import BenchSettings
from .scaling import (ClusterModel, StageTimes, calibrate, model_assumptions, plot_projection, prediction_error,
                      project)

_RUNS = ("reactive", "depth_1", "depth_2", "depth_4")


def stage_times(result: Dict[str, Any], world_size: int, settings: BenchSettings) -> Dict[str, Dict[str, Any]]:
    """Measured stage times + sizes of every timed configuration of one bench run."""
    rank0 = result["raw"][0]
    res, comm, link = rank0["results"], rank0["comm"], rank0["link"]
    w = settings.workload
    comm_s = comm["input_a2a_s"] + comm["output_a2a_s"] + comm["allreduce_s"]
    compute = max(res["resident"]["step_ms_median"] / 1e3 - comm_s, 1e-6)
    reactive = res["reactive"]
    bytes_per_rank = reactive["bytes_moved_per_step"] / world_size
    requested_per_rank = reactive["rows_fetched_per_step"] / world_size / max(1e-9, 1.0 - (reactive["hit_rate"] or 0.0))
    fetch = link["latency_us"] * 1e-6 + bytes_per_rank / (link["bandwidth_gbps"] * 1e9)
    row_bytes = w.embedding_dim * 4 + 4  # fp32 row + its row-wise Adagrad state
    sizes = {
        "dense_param_bytes": rank0["dense_param_bytes"],
        "output_bytes_per_step": w.batch_size * w.num_tables * w.embedding_dim * 4,
        "id_bytes_per_step": w.batch_size * w.num_tables * w.ids_per_feature * 16,
        "bytes_per_row": row_bytes,
        "rows_per_batch": requested_per_rank,
        # "hit rate" of the model = share of requested row bytes that did not cross the
        # link, write-backs included, so cold bytes equal the bytes actually moved.
        "hit_rate": min(max(1.0 - bytes_per_rank / max(requested_per_rank * row_bytes, 1e-9), 0.0), 1.0),
        "host_link_latency_s": link["latency_us"] * 1e-6,
    }
    out = {}
    for name in _RUNS:
        run = res.get(name)
        if not run or "error" in run:
            continue
        times = StageTimes(
            compute_s=compute, input_a2a_s=comm["input_a2a_s"], output_a2a_s=comm["output_a2a_s"],
            allreduce_s=comm["allreduce_s"], fetch_s=fetch, world_size=world_size,
            depth=run["prefetch_depth"], step_s=run["step_ms_median"] / 1e3,
        )
        out[f"{name}@{world_size}"] = {**times.to_dict(), **sizes}
    return out


def scaling_report(settings: BenchSettings, two_rank: Dict[str, Any], out_dir: Path) -> Dict[str, Any]:
    """Runs the 1-rank bench, fits the model on both runs, writes projection.{png,json}."""
    from .runner import run_bench

    # Same link as the 2-rank run (one model has one link), not a re-calibrated one.
    bandwidth = two_rank["report"]["link"]["bandwidth_gbps"]
    one_rank = run_bench(
        replace(settings, trace=False, include_auto=False, include_cache100=False, link_bandwidth_gbps=bandwidth),
        world_size=1, label="scaling: 1-rank run",
    )
    two = stage_times(two_rank, 2, settings)
    measured = {**two, **stage_times(one_rank, 1, settings)}
    # Sizes (rows, bytes, hit rate) are those of the 2-rank run: the model has one workload.
    sizes = next(iter(two.values()))
    template = ClusterModel(
        compute_s=sizes["compute_s"], alpha_s=0.0, beta_s_per_byte=0.0,
        dense_param_bytes=sizes["dense_param_bytes"], output_bytes_per_step=sizes["output_bytes_per_step"],
        id_bytes_per_step=sizes["id_bytes_per_step"], host_link_bytes_per_s=bandwidth * 1e9,
        host_link_latency_s=sizes["host_link_latency_s"], bytes_per_row=sizes["bytes_per_row"],
        rows_per_batch=sizes["rows_per_batch"], hit_rate=sizes["hit_rate"],
    )
    model = calibrate(measured, template=template)
    errors = prediction_error(model, measured)
    rows = project(model)
    out_dir.mkdir(parents=True, exist_ok=True)
    assumptions = model_assumptions(model)
    assumptions.insert(-1, f"calibrated on 1 and 2 gloo CPU ranks with an emulated host link; mean |error| on "
                           f"the measured runs {100 * errors['mean_abs_rel_error']:.0f}%")
    png = plot_projection(rows, out_dir / "projection.png",
                          title="Projected step time, reactive vs proactive (calibrated on 1-2 CPU ranks, emulated link)",
                          assumptions=assumptions)
    report = {
        "model": model.to_dict(),
        "prediction_error": errors,
        "projection": rows,
        "files": [str(png)],
        "note": "calibrated on gloo CPU ranks with an emulated host link; a projection, not a measurement",
    }
    (out_dir / "projection.json").write_text(json.dumps(report, indent=2, default=str))
    return {"mean_abs_rel_error": errors["mean_abs_rel_error"], "max_abs_rel_error": errors["max_abs_rel_error"],
            "files": [str(png), str(out_dir / "projection.json")]}
