"""The TorchRec-style example trainer, run as a user runs it: stock vs the two-line swap."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.multiprocess
ROOT = Path(__file__).resolve().parents[1]
TRAIN = ROOT / "examples" / "torchrec_style" / "train.py"


def _run(out: Path, *args: str) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, str(TRAIN), "--out", str(out), "--steps", "24", "--eval-every", "12",
                           *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, "\n".join(l for l in proc.stderr.splitlines() if "Error" in l or "error" in l)[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _load_example():
    import importlib.util

    spec = importlib.util.spec_from_file_location("torchrec_style_train", TRAIN)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _runs_on_ranks(rank: int, world_size: int, runs: list) -> list:
    """The example's ``main`` for each argument list in turn on these ranks (one launch of two
    ranks for several runs: each new interpreter costs seconds of imports); rank 0 returns the
    JSON line each run printed. ``main`` joins the group the launch made, and its closing
    ``destroy_process_group`` is kept for the launch to do after the last run."""
    import contextlib
    import io
    from unittest import mock

    import torch.distributed as dist

    example, printed = _load_example(), []
    for argv in runs:
        args = example.parse(argv)
        os.makedirs(args.out, exist_ok=True)
        out = io.StringIO()
        with contextlib.redirect_stdout(out), mock.patch.object(dist, "destroy_process_group"):
            example.main(rank, world_size, args)
        printed.append(json.loads(out.getvalue().strip().splitlines()[-1]) if rank == 0 else None)
    return printed


def _run_in_one_launch(*runs: tuple) -> list:
    """``_run`` for several (out, *args) at once, the example's code on two spawned ranks."""
    from torchrec_proactive.launch import run_ranks

    argvs = [["--out", str(out), "--steps", "24", "--eval-every", "12", *args] for out, *args in runs]
    return run_ranks(_runs_on_ranks, world_size=2, timeout_s=300, runs=argvs)[0]


def _params(out: Path) -> dict:
    """Both ranks' losses and the whole model (sharded tables assembled from their shards)."""
    files = [torch.load(out / f"rank{r}.pt") for r in (0, 1)]
    params: dict = {}
    for f in files:
        for k, v in f["params"].items():
            if isinstance(v, dict):
                full = params.setdefault(k, torch.full(v["size"], float("nan")))
                for offsets, t in v["shards"]:
                    full[tuple(slice(o, o + n) for o, n in zip(offsets, t.shape))] = t
            else:
                params[k] = v  # replicated (dense or data-parallel): every rank holds all of it
    assert all(not bool(t.isnan().any()) for t in params.values()), "some rows were in no rank's shards"
    return {"params": params, "losses": [f["losses"] for f in files]}


def _max_diff(a: dict, b: dict) -> float:
    assert a["params"].keys() == b["params"].keys()
    diffs = [float((a["params"][k] - b["params"][k]).abs().max()) for k in a["params"]]
    return max(diffs + [max(abs(x - y) for x, y in zip(la, lb)) for la, lb in zip(a["losses"], b["losses"])])


def test_two_line_swap_matches_stock_and_checkpoints_interoperate(tmp_path):
    stock = _run(tmp_path / "stock")
    pro = _run(tmp_path / "pro", "--proactive", "--prefetch-depth", "2", "--cache-load-factor", "0.05")
    assert stock["steps"] == pro["steps"] == 24 and pro["eval_loss"] is not None
    assert _max_diff(_params(tmp_path / "stock"), _params(tmp_path / "pro")) < 1e-5
    # A new pipeline per round drops the batches the old one held (as stock does; a deeper
    # pipeline holds more). Its prefetches are released, so a tiny cache trains on exactly
    # as a large one does.
    # (These four runs share one launch of two ranks: the script's own command line, spawn and
    # JSON line are the two runs above.)
    assert (tmp_path / "stock" / "checkpoint" / ".metadata").exists()
    tiny, full, _, _ = _run_in_one_launch(
        (tmp_path / "rounds_tiny", "--proactive", "--pipeline-per-round", "--cache-load-factor", "0.02"),
        (tmp_path / "rounds_full", "--proactive", "--pipeline-per-round", "--cache-load-factor", "0.5"),
        # The stock DCP checkpoint resumes in the plugin, and the plugin's in stock.
        (tmp_path / "pro_resumed", "--proactive", "--resume", stock["checkpoint"]),
        (tmp_path / "stock_resumed", "--resume", pro["checkpoint"]),
    )
    assert tiny["steps"] == full["steps"] > 12
    assert _max_diff(_params(tmp_path / "rounds_tiny"), _params(tmp_path / "rounds_full")) == 0.0
    assert _max_diff(_params(tmp_path / "pro_resumed"), _params(tmp_path / "stock_resumed")) < 1e-5


def test_resume_reads_the_checkpoint_safely(tmp_path):
    """The example resumes through ``torchrec_proactive.checkpoint.load_checkpoint``: a
    ``.metadata`` whose pickle would run code is refused before it runs, one line naming it."""
    import pickle

    crafted, pwned = tmp_path / "crafted", tmp_path / "pwned"
    crafted.mkdir()
    (crafted / ".metadata").write_bytes(pickle.dumps(_Exploit(str(pwned))))
    (crafted / "step.json").write_text('{"step": 0}')
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, str(TRAIN), "--out", str(tmp_path / "out"), "--steps", "2", "--nproc", "1",
                           "--resume", str(crafted)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0
    assert not pwned.exists(), "the checkpoint's pickle ran code"
    assert f"{crafted}/.metadata: not a tensor checkpoint's metadata" in proc.stderr, proc.stderr[-3000:]
    assert "refusing to load it" in proc.stderr


class _Exploit:
    def __init__(self, target: str) -> None:
        self.target = target

    def __reduce__(self):
        return (os.system, (f"touch {self.target}",))
