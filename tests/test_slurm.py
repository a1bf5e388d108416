"""A real two-node Slurm cluster (scripts/slurm_cluster.sh: munge, slurmdbd, slurmctld, two
slurmd on this machine): ``torchx run -s slurm proactive.train -j 2x1`` trains on both nodes,
and the faults a cluster owner asks about cost nothing.

One cluster per test run (session fixture), stopped by process id at the end. Every run uses
the same small config: one epoch of ci_tiny (18 steps on 2 ranks), a checkpoint every 4
steps, ``train.resume=true`` (a fresh run starts from scratch), and a slow emulated link at
prefetch depth 0 so that a step takes ~0.1 s and a fault lands between two checkpoints.
Each run's final checkpoint tensors are compared with those of an uninterrupted ``local_cwd``
run of the same config on 2 ranks: bit-identical on CPU.

Each job start costs ~30 s on 2 cores (torchrun and the trainer's imports on both nodes), so
each behaviour is tested once in the default run: the preempted job's final run is checked
as a plain two-node run is (the plain run alone is ``-m slow``), and the two killed ranks
(one mid-step, one mid-save) are two requeues of one job.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent  # torchx and torchrun of this environment
SCRIPT = REPO / "scripts" / "slurm_cluster.sh"
DAEMONS = ("munged", "mariadbd", "mariadb-install-db", "slurmdbd", "slurmctld", "slurmd", "sacct")
STEPS = 18  # ci_tiny, one epoch on 2 ranks (batch 64)
FINAL = f"step_{STEPS:08d}"

pytestmark = pytest.mark.slurm


def _overrides(data: Path, out: Path) -> List[str]:
    return ["experiment=ci_tiny", f"data.root={data}", f"train.output_dir={out}", "train.epochs=1",
            "train.checkpoint_every=4", "train.resume=true", "train.log_every=1",
            "prefetch.depth=0", "link.latency_us=100000"]


def _free_base_port() -> int:
    """A base port P with P..P+4 free (the cluster's daemons)."""
    for base in range(17100, 30000, 10):
        try:
            for p in range(base, base + 5):
                with socket.socket() as s:
                    s.bind(("0.0.0.0", p))
            return base
        except OSError:
            continue
    raise RuntimeError("no free port block for the test cluster")


@dataclass
class Cluster:
    directory: Path
    env: Dict[str, str]  # SLURM_CONF, PATH, PYTHONPATH ... for torchx, sbatch, sacct
    data: Path  # one generated data set for every run

    def sh(self, *args: str, timeout: float = 60) -> str:
        return subprocess.run(list(args), env=self.env, capture_output=True, text=True, timeout=timeout,
                              check=True).stdout

    def script(self, *args: str) -> str:
        return self.sh("bash", str(SCRIPT), *args, timeout=120)

    def submit(self, cwd: Path, out: Path, j: str = "2x1", max_retries: int = 0,
               extra: Optional[List[str]] = None) -> str:
        """``torchx run -s slurm``; returns the app handle (``slurm://torchx/<job id>``)."""
        cwd.mkdir(parents=True, exist_ok=True)
        cmd = [str(BIN / "torchx"), "run", "-s", "slurm", "--scheduler_args", "partition=debug,time=10",
               "proactive.train", "-j", j, "--memMB", "1024", "--cpu", "1", "--rdzv_port", str(_free_base_port()),
               "--max_retries", str(max_retries), *_overrides(self.data, out), *(extra or [])]
        proc = subprocess.run(cmd, cwd=cwd, env=self.env, capture_output=True, text=True, timeout=120)
        handle = re.search(r"^(slurm://\S+/\d+)$", proc.stdout, re.M)
        assert proc.returncode == 0 and handle, proc.stdout + proc.stderr
        return handle.group(1)

    def status(self, handle: str) -> str:
        """``torchx status``'s state (it reads ``sacct``, i.e. the accounting database)."""
        text = self.sh(str(BIN / "torchx"), "status", handle)
        match = re.search(r"State:\s*(\w+)", text)
        return match.group(1) if match else "UNKNOWN"

    def wait(self, handle: str, timeout: float = 240,
             until: Tuple[str, ...] = ("SUCCEEDED", "FAILED", "CANCELLED")) -> str:
        deadline = time.monotonic() + timeout
        state = "UNKNOWN"
        while time.monotonic() < deadline:
            state = self.status(handle)
            if state in until:
                return state
            time.sleep(1.0)
        raise AssertionError(f"{handle} still {state} after {timeout:.0f} s")

    def release_requeued(self, job: str, out: Path) -> None:
        """Waits for ``job`` (writing ``out``) to be requeued and its last run's ranks to be
        gone, and lets it start 2 s on: Slurm holds a requeued job back (its begin time ~2 min
        on), which would only make the test wait; but a start within the second the last run
        was ended is refused (its job credential was revoked that second) and ends the job."""
        _until(lambda: set(self.sh("squeue", "-h", "-j", job, "-o", "%T").split()) == {"PENDING"}, timeout=120,
               every=0.5, what=f"job {job} to be requeued")
        _until(lambda: not _worker_pids(out), timeout=60, every=0.5, what=f"the ranks of job {job} to exit")
        for component in self.sh("squeue", "-h", "-j", job, "-o", "%i").split():
            self.sh("scontrol", "update", f"jobid={component}", "StartTime=now+2")

    def logs(self, cwd: Path) -> str:
        """The job's Slurm output files (``slurm-<id>*.out``/``.err`` in the submit directory)."""
        return "\n".join(p.read_text(errors="replace") for p in sorted(cwd.glob("slurm-*")))


@pytest.fixture(scope="session")
def slurm(tmp_path_factory: pytest.TempPathFactory):
    missing = [d for d in DAEMONS if shutil.which(d) is None and not Path("/usr/sbin", d).exists()]
    if missing:
        pytest.skip(f"Slurm/munge/MariaDB not installed ({', '.join(missing)}): .ci/run installs them")
    directory = tmp_path_factory.mktemp("slurm")
    env = dict(os.environ, PROACTIVE_SLURM_DIR=str(directory), PROACTIVE_SLURM_PORT=str(_free_base_port()),
               PATH=f"{BIN}{os.pathsep}/usr/sbin{os.pathsep}{os.environ.get('PATH', '')}", OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p),
               SLURM_CONF=str(directory / "slurm.conf"))
    cluster = Cluster(directory, env, tmp_path_factory.mktemp("slurm_data"))
    try:
        cluster.script("start")
        yield cluster
    finally:
        daemons = {p.name: int(p.read_text()) for p in (directory / "pids").glob("*")}
        subprocess.run(["bash", str(SCRIPT), "stop"], env=env, capture_output=True, timeout=180)
        _until(lambda: not [n for n, pid in daemons.items() if _alive(pid)], timeout=30, every=0.2,
               what=f"the cluster's daemons to exit: {daemons}")
        assert not list((directory / "pids").glob("*"))


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


@pytest.fixture(scope="session")
def reference(slurm: Cluster, tmp_path_factory: pytest.TempPathFactory) -> Dict[str, torch.Tensor]:
    """The final checkpoint of an uninterrupted ``torchx run -s local_cwd`` on 2 ranks."""
    work = tmp_path_factory.mktemp("local_cwd")
    out = work / "run"
    cmd = [str(BIN / "torchx"), "run", "-s", "local_cwd", "-cfg", f"log_dir={work / 'logs'}",
           "proactive.train", "-j", "1x2", *_overrides(slurm.data, out)]
    proc = subprocess.run(cmd, cwd=REPO, env=slurm.env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and "SUCCEEDED" in proc.stdout + proc.stderr, proc.stderr[-4000:]
    return _tensors(out / "checkpoints" / FINAL)


def _tensors(step_dir: Path) -> Dict[str, torch.Tensor]:
    """Every tensor of a DCP checkpoint, whole (DCP's own conversion, no process group)."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    target = step_dir.parent / f"{step_dir.name}.pt"
    dcp_to_torch_save(str(step_dir), str(target))
    flat: Dict[str, torch.Tensor] = {}

    def walk(prefix: str, value: object) -> None:
        if isinstance(value, dict):
            for k, v in value.items():
                walk(f"{prefix}{k}.", v)
        elif isinstance(value, torch.Tensor):
            flat[prefix[:-1]] = value

    walk("", torch.load(target, weights_only=True))
    target.unlink()
    return flat


def _assert_same(got: Dict[str, torch.Tensor], want: Dict[str, torch.Tensor]) -> None:
    assert sorted(got) == sorted(want)
    assert any(k.startswith("model.") for k in want) and any(k.startswith("optimizer.") for k in want)
    differ = [k for k in want if not torch.equal(got[k], want[k])]
    assert not differ, f"{len(differ)} of {len(want)} tensors differ from the uninterrupted run, e.g. {differ[:3]}"


def _rank_log(out: Path, rank: int = 0) -> str:
    return (out / f"rank_{rank}" / "train.log").read_text()


def _complete(out: Path) -> List[str]:
    return sorted(p.parent.name for p in (out / "checkpoints").glob("step_*/MANIFEST.json"))


def _step(out: Path) -> int:
    """The last step rank 0 logged (its train.log is flushed line by line; metrics.jsonl is not)."""
    path = out / "rank_0" / "train.log"
    steps = [int(m) for m in re.findall(r"\] step (\d+) loss", path.read_text())] if path.is_file() else []
    return max(steps, default=0)


def _until(predicate, timeout: float = 180, every: float = 0.02, what: str = "") -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(every)


def _worker_pids(out: Path, rank: Optional[int] = None) -> List[int]:
    """The training processes (torchrun's workers, not torchrun) of the run writing ``out``."""
    pids = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            cmd = (proc / "cmdline").read_bytes().split(b"\0")
            env = dict(v.split(b"=", 1) for v in (proc / "environ").read_bytes().split(b"\0") if b"=" in v)
        except OSError:
            continue
        if f"train.output_dir={out}".encode() not in cmd or b"RANK" not in env \
                or any(c.endswith(b"/torchrun") for c in cmd):
            continue
        if rank is None or env[b"RANK"] == str(rank).encode():
            pids.append(int(proc.name))
    return pids


# ---------------------------------------------------------------------------- the tests
def _assert_finished_on_two_nodes(slurm: Cluster, job: str, out: Path, reference) -> None:
    """The job's last run trained the whole epoch on n1 and n2 and saved what the
    uninterrupted local run saved."""
    # one het-job component per node, named after the role (sacct without -D: the last run)
    rows = slurm.sh("sacct", "-j", job, "-X", "-n", "-P", "-o", "JobName,NodeList,State").split()
    assert sorted(rows) == ["train-0|n1|COMPLETED", "train-1|n2|COMPLETED"], rows
    for rank in (0, 1):
        records = [json.loads(line) for line in (out / f"rank_{rank}" / "metrics.jsonl").read_text().splitlines()]
        assert max(r["step"] for r in records if r["kind"] == "step") == STEPS
        assert any(r["kind"] == "eval" for r in records)
    assert json.loads((out / "checkpoints" / FINAL / "MANIFEST.json").read_text())["world_size"] == 2
    _assert_same(_tensors(out / "checkpoints" / FINAL), reference)


@pytest.mark.slow  # the preemption test's requeued run is checked the same way
def test_torchx_slurm_trains_on_two_nodes(slurm: Cluster, reference, tmp_path: Path) -> None:
    out = tmp_path / "run"
    handle = slurm.submit(tmp_path, out)
    assert slurm.wait(handle) == "SUCCEEDED", slurm.logs(tmp_path)[-6000:]
    _assert_finished_on_two_nodes(slurm, handle.rsplit("/", 1)[1], out, reference)


def test_a_failed_rank_s_root_cause_is_what_the_slurm_log_shows(slurm: Cluster, tmp_path: Path) -> None:
    """torchrun's failure summary in the job's log names the rank's own one-line error (its
    torchelastic error file), not ``error_file: <N/A>``."""
    handle = slurm.submit(tmp_path, tmp_path / "run", j="1x1", extra=["prefetch.detph=4"])  # one node suffices
    assert slurm.wait(handle) == "FAILED"
    log = slurm.logs(tmp_path)
    assert "traceback : torchrec-proactive train: error: prefetch.detph is not a config key" in log, log[-4000:]
    assert "error_file: <N/A>" not in log


def _after_checkpoint(out: Path, step: int = 4) -> None:
    """Waits until checkpoint ``step`` is complete and rank 0 trained past it."""
    _until(lambda: f"step_{step:08d}" in _complete(out) and _step(out) > step,
           what=f"a step after checkpoint {step}")


def _kill_rank_0_while_saving(out: Path, stale: frozenset = frozenset()) -> str:
    """SIGKILLs rank 0 while a checkpoint newer than every complete one is being written
    (its directory is there, its manifest not yet; ``stale``: directories an earlier run
    left, not watched); returns that checkpoint's name."""
    checkpoints = out / "checkpoints"
    workers = {rank: _worker_pids(out, rank) for rank in (0, 1)}
    assert all(len(p) == 1 for p in workers.values()), workers
    while True:
        done = set(_complete(out))
        assert FINAL not in done, "never caught a save in progress"
        started = [p for p in os.listdir(checkpoints) if p.startswith("step_") and p not in done
                   and not p.endswith(".pt") and p > max(done) and p not in stale]
        if not started:
            time.sleep(0.005)  # (a save takes ~0.5 s; the ranks need the cores)
            continue
        for (pid,) in workers.values():
            os.kill(pid, signal.SIGSTOP)  # freeze both ranks, then look again
        partial = None
        if not (checkpoints / started[0] / "MANIFEST.json").exists():
            partial = started[0]
            os.kill(workers[0][0], signal.SIGKILL)
        for (pid,) in workers.values():
            os.kill(pid, signal.SIGCONT)
        if partial:
            return partial


def test_killed_ranks_requeue_the_job_which_resumes_from_the_newest_complete_checkpoint(
        slurm: Cluster, reference, tmp_path: Path) -> None:
    """Faults 1 and 4, two requeues of one job (``--max_retries 2``: torchx's batch script
    requeues it when srun fails; srun ends the other node's rank: --kill-on-bad-exit):

    1. rank 1 (on n2) gets SIGKILL mid-epoch; the requeued job resumes from the newest
       complete checkpoint;
    2. in that requeued job, rank 0 (on n1) gets SIGKILL while a checkpoint is being written;
       the job, requeued again, resumes from the newest complete checkpoint (the log names
       it), never the partial one,

    and finishes bit-identical to the uninterrupted run.

    (torchrun's own restarts, ``--max_restarts``, are not what this test uses: with two agents
    on one machine a restart round sometimes never re-forms - its new workers hang in gloo's
    connect - which a scheduler requeue, starting every process afresh, does not do.)"""
    out = tmp_path / "run"
    checkpoints = out / "checkpoints"
    handle = slurm.submit(tmp_path, out, max_retries=2)
    job = handle.rsplit("/", 1)[1]
    # 1. a rank killed mid-epoch
    _after_checkpoint(out)
    (victim,) = _worker_pids(out, rank=1)
    os.kill(victim, signal.SIGKILL)
    slurm.release_requeued(job, out)
    first = _complete(out)[-1]  # the requeued job is not running yet: no checkpoint since the kill
    assert first != FINAL
    stale = frozenset(os.listdir(checkpoints))  # (a save the kill cut short)
    resumed_first = f"resumed from {checkpoints / first} at step {int(first[5:])}"
    _until(lambda: resumed_first in _rank_log(out), what="the requeued job to resume")
    # 2. a rank killed mid-save, in the requeued job
    partial = _kill_rank_0_while_saving(out, stale)
    slurm.release_requeued(job, out)
    last_complete = _complete(out)[-1]
    assert first <= last_complete < partial
    assert slurm.wait(handle, until=("SUCCEEDED",)) == "SUCCEEDED", slurm.logs(tmp_path)[-6000:]
    log = _rank_log(out)
    assert resumed_first in log, log[-3000:]
    assert f"resumed from {checkpoints / last_complete} at step {int(last_complete[5:])}" in log, log[-3000:]
    assert f"resumed from {checkpoints / partial}" not in log
    _assert_same(_tensors(checkpoints / FINAL), reference)


def test_preempted_job_checkpoints_on_sigterm_and_resumes_when_requeued(slurm: Cluster, reference,
                                                                       tmp_path: Path) -> None:
    """Fault 3: ``scontrol requeue`` between two checkpoints. Slurm sends SIGTERM, the ranks
    agree to stop, checkpoint that step and exit; the requeued job resumes from it, and its
    run is checked as a plain two-node run is (one component per node, every step and the
    eval on both ranks, the uninterrupted run's tensors)."""
    out = tmp_path / "run"
    handle = slurm.submit(tmp_path, out)
    job = handle.rsplit("/", 1)[1]
    _after_checkpoint(out)
    slurm.sh("scontrol", "requeue", job)
    slurm.release_requeued(job, out)
    assert slurm.wait(handle, until=("SUCCEEDED",), timeout=300) == "SUCCEEDED", slurm.logs(tmp_path)[-6000:]
    log = _rank_log(out)
    stopped = re.search(r"SIGTERM: stopped at step (\d+) and wrote checkpoint (\S+); exiting", log)
    assert stopped, log[-3000:]
    step, path = int(stopped.group(1)), stopped.group(2)
    assert path == str(out / "checkpoints" / f"step_{step:08d}") and 4 < step < STEPS
    assert f"resumed from {path} at step {step}" in log
    _assert_finished_on_two_nodes(slurm, job, out, reference)


def test_node_lost_fails_naming_it_and_the_run_resumes_on_the_other_node(slurm: Cluster, tmp_path: Path) -> None:
    """Fault 2: node n2 is lost (its slurmd and its job's processes killed). The job fails
    and Slurm names the node; resubmitted with -j 1x1 the run resumes on n1 alone.

    Not bit-identical to the uninterrupted run, by design: on 1 rank a step trains 64
    samples instead of 128, so the rest of the epoch is trained in other batches (the
    resume keeps the epoch's sample position; loop.rescale_position)."""
    out = tmp_path / "run"
    handle = slurm.submit(tmp_path / "first", out)
    job = handle.rsplit("/", 1)[1]
    _after_checkpoint(out)
    try:
        slurm.script("kill-node", "n2")
        _until(lambda: "not responding" in slurm.sh("scontrol", "show", "node", "n2").lower(), timeout=90,
               every=1.0, what="slurmctld to notice n2 is gone")
        # The job failed on n2 (the record before Slurm's requeue: torchx submits with --requeue)
        _until(lambda: "train-1|n2|NODE_FAIL" in slurm.sh("sacct", "-D", "-j", job, "-X", "-n", "-P", "-o",
                                                          "JobName,NodeList,State").split(),
               timeout=90, every=1.0, what="sacct to record NODE_FAIL on n2")
        assert "srun: error: Node failure on n2" in slurm.logs(tmp_path / "first")
        # the requeued 2-node job cannot run without n2: the user resubmits on the node left
        slurm.sh("scancel", job)
        latest = _complete(out)[-1]
        handle = slurm.submit(tmp_path / "again", out, j="1x1")
        assert slurm.wait(handle) == "SUCCEEDED", slurm.logs(tmp_path / "again")[-6000:]
        rows = slurm.sh("sacct", "-j", handle.rsplit("/", 1)[1], "-X", "-n", "-P", "-o", "NodeList").split()
        assert rows == ["n1"]
    finally:
        slurm.script("restore-node", "n2")
    log = _rank_log(out)
    assert f"resumed from {out / 'checkpoints' / latest}" in log
    assert "saved on 2 rank(s), resuming on 1" in log
    final = sorted((out / "checkpoints").glob("step_*/MANIFEST.json"))[-1]
    manifest = json.loads(final.read_text())
    assert manifest["world_size"] == 1 and manifest["position"]["epoch"] == 1, manifest["position"]
