"""Run a function on N local ranks (processes) with a gloo/NCCL process group.

Used by the tests and the benchmark to put several configurations side by side in one run.
A rank that raises or dies makes the whole launch fail fast with that rank's traceback; no
launch outlives ``timeout_s``. Multi-node jobs use torchrun / torchx instead.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import signal
import socket
import time
import traceback
from datetime import timedelta
from typing import Any, Callable, Dict, List, Optional

# torch is imported by the ranks, not here: the launching process only spawns them and reads
# their reports (a CLI run's parent then starts its ranks ~1.5 s sooner; a tensor in a report
# still arrives as one, pickle imports torch to rebuild it).


class RankFailure(RuntimeError):
    """A rank raised, died, or the launch ran past its timeout.

    ``rank`` is the failing rank (``None`` for a timeout of several). ``user_message`` is
    set when that rank raised an exception marked ``user_error`` (a mistake the user can
    fix): it is the exception's one-line message, which callers may show without the
    traceback that ``str()`` carries.
    """

    def __init__(self, message: str, rank: Optional[int] = None, user_message: Optional[str] = None) -> None:
        super().__init__(message)
        self.rank = rank
        self.user_message = user_message


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def init_process_group(rank: int, world_size: int, port: int, backend: Optional[str] = None,
                       timeout_s: float = 120.0) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world_size),
    )
    import torch
    import torch.distributed as dist

    backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
    dist.init_process_group(backend, rank=rank, world_size=world_size, timeout=timedelta(seconds=timeout_s))


def _entry(rank: int, world_size: int, port: int, fn: Callable[..., Any], kwargs: Dict[str, Any],
           results: "mp.Queue[Any]", threads: int, pg_timeout_s: float) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(threads)
    try:
        init_process_group(rank, world_size, port, timeout_s=pg_timeout_s)
        out = fn(rank=rank, world_size=world_size, **kwargs)
        results.put((rank, "ok", out, None))
    except BaseException as e:  # reported to the parent, which fails the launch
        info = {
            # a mistake the user can fix: the parent may print just the message
            "user_message": str(e) if getattr(e, "user_error", False) else None,
            # this rank only stopped because another one failed: that one is the cause
            "origin_rank": getattr(e, "origin_rank", None),
        }
        results.put((rank, "error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}", info))
    finally:
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:
                pass


def _death(exitcode: int) -> str:
    """How a rank process ended, in words: a negative exit code is the signal that killed it."""
    if exitcode == -signal.SIGKILL:
        # Nothing in this project sends SIGKILL; the kernel's OOM killer does.
        return "was killed (SIGKILL: most often the out-of-memory killer; see `dmesg`)"
    if exitcode < 0:
        return f"was killed by {signal.Signals(-exitcode).name}"
    return f"died with exit code {exitcode}"


def _root_cause(procs: List[Any], rank: int, payload: str, reported: set, grace_s: float = 2.0) -> str:
    """A rank's error, preceded by any rank that died without reporting (usually the cause:
    its peers then fail inside a collective with "connection closed")."""
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline:
        dead = [r for r, p in enumerate(procs) if r not in reported and p.exitcode not in (None, 0)]
        if dead:
            r = dead[0]
            return (f"rank {r} {_death(procs[r].exitcode)} before reporting a result; "
                    f"then rank {rank} failed:\n{payload}")
        if all(p.exitcode is not None for r, p in enumerate(procs) if r not in reported):
            break
        time.sleep(0.05)
    return f"rank {rank} failed:\n{payload}"


def _origin_report(results: "mp.Queue[Any]", rank: int, payload: str, info: Dict[str, Any],
                   out: Dict[int, Any], grace_s: float = 5.0) -> Any:
    """When ``rank`` failed only because ``info["origin_rank"]`` did, waits briefly for the
    origin's own report so that the failure names the rank that actually failed."""
    origin = info.get("origin_rank")
    deadline = time.monotonic() + grace_s
    while origin is not None and origin != rank and time.monotonic() < deadline:
        try:
            r, status, p, i = results.get(timeout=0.2)
        except queue.Empty:
            continue
        if status == "ok":
            out[r] = p
        elif r == origin:
            return r, p, i
    return rank, payload, info


def run_ranks(fn: Callable[..., Any], world_size: int = 2, timeout_s: float = 600.0,
              threads_per_rank: int = 1, pg_timeout_s: float = 120.0, **kwargs: Any) -> List[Any]:
    """Runs ``fn(rank=, world_size=, **kwargs)`` on ``world_size`` spawned ranks; returns their results.

    ``fn`` must be importable (module level). Raises :class:`RankFailure` naming the first
    rank that failed, or died without reporting, or that did not finish in ``timeout_s``.
    """
    ctx = mp.get_context("spawn")
    results: "mp.Queue[Any]" = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=_entry, args=(r, world_size, port, fn, kwargs, results, threads_per_rank, pg_timeout_s),
                    daemon=False)
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    out: Dict[int, Any] = {}
    deadline = time.monotonic() + timeout_s
    try:
        while len(out) < world_size:
            try:
                rank, status, payload, info = results.get(timeout=1.0)
            except queue.Empty:
                dead = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0) and r not in out]
                if dead:
                    r = dead[0]
                    raise RankFailure(f"rank {r} {_death(procs[r].exitcode)} before reporting a result")
                if time.monotonic() > deadline:
                    raise RankFailure(f"ranks {sorted(set(range(world_size)) - set(out))} did not finish in {timeout_s:.0f} s")
                continue
            if status == "error":
                rank, payload, info = _origin_report(results, rank, payload, info, out)
                raise RankFailure(_root_cause(procs, rank, payload, reported=set(out) | {rank}), rank=rank,
                                  user_message=info.get("user_message"))
            out[rank] = payload
    finally:
        for p in procs:
            p.join(timeout=5 if out and len(out) == world_size else 0.1)
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
    return [out[r] for r in range(world_size)]
