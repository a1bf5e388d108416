"""Runs one rank-side check once per set of arguments in one launch (importable by spawned
ranks): starting ranks - spawning, importing torch and TorchRec, the process group - takes
~10 s on 2 cores, more than most checks."""

from __future__ import annotations

import sys
import traceback
from typing import Any, Callable, Dict, List

import torch.distributed as dist


def run_cases(rank: int, world_size: int, check: Callable[..., Any],
              cases: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """``check`` once per kwargs of ``cases``, in order. Each outcome is ``{"ok": result}`` or
    ``{"error": text}``, so that a case's failure fails its own test."""
    out: List[Dict[str, Any]] = []
    for kwargs in cases:
        try:
            out.append({"ok": check(rank=rank, world_size=world_size, **kwargs)})
        except Exception as e:
            out.append({"error": f"{type(e).__name__}: {e}\n{traceback.format_exc()[-3000:]}"})
            # Shown in the test log if a peer is then left waiting in a collective.
            print(f"[rank {rank}] {check.__name__}({kwargs}) failed: {out[-1]['error']}", file=sys.stderr, flush=True)
        dist.barrier()
    return out


def call(rank: int, world_size: int, fn: Callable[..., Any], **kwargs: Any) -> Any:
    """``fn(rank=, world_size=, **kwargs)``: as ``check``, it lets one launch run cases of
    different checks (each case's ``fn`` in its kwargs)."""
    return fn(rank=rank, world_size=world_size, **kwargs)


def launch_cases(check: Callable[..., Any], keys: List[Any], cases: List[Dict[str, Any]], world_size: int = 2,
                 timeout_s: float = 600.0) -> Dict[Any, List[Dict[str, Any]]]:
    """(Test side.) ``check`` on ``world_size`` ranks once per kwargs of ``cases``, all in one
    launch (``timeout_s`` per case); ``{key: the case's per-rank outcomes}``."""
    from torchrec_proactive.launch import run_ranks

    per_rank = run_ranks(run_cases, world_size=world_size, timeout_s=timeout_s * len(cases), check=check, cases=cases)
    return {key: [ranks[i] for ranks in per_rank] for i, key in enumerate(keys)}


def ok(case: List[Dict[str, Any]]) -> List[Any]:
    """(Test side.) A case's per-rank results; fails with a rank's error where the case raised."""
    for rank, res in enumerate(case):
        assert "error" not in res, f"rank {rank} raised:\n{res['error']}"
    return [res["ok"] for res in case]
