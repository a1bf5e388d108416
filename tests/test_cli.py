"""The CLI as a user runs it: ``python -m torchrec_proactive.cli ...`` in a subprocess.

User mistakes must end in one line on stderr that names the key, the value and the limit,
with exit code 2 (as argparse does) and no traceback; ``--help`` must be complete; a run
directory belongs to one run; ``gen-data``'s output is what ``train`` uses; ``train`` and
the example script print the same documented JSON line.

Runs that start ranks use ``experiment=ci_tiny`` and a handful of steps (a few seconds of
work each, most of it imports).
"""

from __future__ import annotations

import fcntl
import json
import os
import pty
import re
import struct
import subprocess
import sys
import termios
import threading
from dataclasses import fields
from pathlib import Path
from typing import Any, Dict, List, Optional

import pytest

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "examples" / "dlrm_criteo" / "train.py"
TINY = ["experiment=ci_tiny", "train.max_steps=6", "train.eval_max_batches=2"]


class Run:
    def __init__(self, rc: int, out: str, err: str) -> None:
        self.rc, self.out, self.err = rc, out, err

    def __repr__(self) -> str:  # shown by pytest when an assertion fails
        return f"rc={self.rc}\n--- stdout\n{self.out[-3000:]}\n--- stderr\n{self.err[-5000:]}"

    def result(self) -> Dict[str, Any]:
        """The final JSON line on stdout."""
        return json.loads(self.out.strip().splitlines()[-1])


def cli(*args: str, cwd: Optional[Path] = None, tty: bool = False, script: Optional[Path] = None,
        timeout: float = 240, env: Optional[Dict[str, str]] = None) -> Run:
    """Runs the CLI (or ``script``) like a user; ``tty=True`` gives it a terminal as stderr;
    ``env`` adds environment variables."""
    cmd = [sys.executable, str(script)] if script else [sys.executable, "-m", "torchrec_proactive.cli"]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO), **(env or {}))
    env.pop("WORLD_SIZE", None)
    env.pop("RANK", None)
    if not tty:
        p = subprocess.run([*cmd, *args], cwd=cwd or REPO, env=env, capture_output=True, text=True,
                           timeout=timeout)
        return Run(p.returncode, p.stdout, p.stderr)
    master, slave = pty.openpty()
    # a terminal of 0 columns (a new pty's size) would make tqdm draw an empty bar
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 160, 0, 0))
    proc = subprocess.Popen([*cmd, *args], cwd=cwd or REPO, env=env, stdout=subprocess.PIPE, stderr=slave)
    os.close(slave)
    chunks: List[bytes] = []

    def pump() -> None:
        while True:
            try:
                data = os.read(master, 65536)
            except OSError:  # EIO: every writer closed the terminal
                return
            if not data:
                return
            chunks.append(data)

    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    out, _ = proc.communicate(timeout=timeout)
    reader.join(timeout=10)
    os.close(master)
    return Run(proc.returncode, out.decode(), b"".join(chunks).decode(errors="replace"))


def cli_here(*args: str, cwd: Optional[Path] = None) -> Run:
    """``cli`` in this process, for refusals that stop before any rank starts (a new
    interpreter costs seconds of imports, torch's for a checkpoint check): the console
    script's ``main`` with stdout and stderr captured, and the root logger as a new process
    has it (no handlers: Hydra's, when it runs, write to the captured streams), so that a
    stray log line is counted as it would be in a subprocess. The exit code is ``main``'s (or
    its ``SystemExit``'s); ``cwd``: the directory it runs in (restored after). A launch of ranks fails the test: their output would not be
    captured here. The real console script's exit code 2 is checked in a subprocess by
    test_user_mistake_is_one_line_and_exit_code_2 and the runs that use ``cli``."""
    import contextlib
    import io
    import logging
    from unittest import mock

    from torchrec_proactive.cli import main

    def no_ranks(*_: Any, **__: Any) -> None:
        raise AssertionError(f"cli_here{args}: ranks were launched (use cli: a refusal before launch is expected)")

    root = logging.getLogger()
    handlers, level, start = root.handlers[:], root.level, os.getcwd()
    root.handlers[:] = []
    out, err = io.StringIO(), io.StringIO()
    try:
        os.chdir(cwd or REPO)
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err), \
                mock.patch("torchrec_proactive.launch.run_ranks", no_ranks):
            try:
                rc = main(list(args))
            except SystemExit as e:  # (argparse's, or Hydra's for an error inside its app)
                rc = e.code if isinstance(e.code, int) else int(e.code is not None)
    finally:
        os.chdir(start)
        root.handlers[:] = handlers
        root.setLevel(level)
    return Run(rc, out.getvalue(), err.getvalue())


def assert_user_error(run: Run, *fragments: str) -> str:
    """Exit code 2, no traceback, and one line naming it all (besides argparse's usage lines
    and the run's own log lines, when ranks had started)."""
    assert run.rc == 2, run
    assert "Traceback" not in run.err, run
    lines = [line for line in run.err.strip().splitlines()
             if not line.startswith(("usage:", "  ")) and not re.match(r"\d\d:\d\d:\d\d \[rank \d+\] ", line)]
    assert len(lines) == 1, run
    for fragment in fragments:
        assert fragment in lines[0], (fragment, run)
    return lines[0]


# ---------------------------------------------------------------------- mistakes, no ranks


@pytest.mark.parametrize(
    "args,fragments",
    [
        (["train", "--nproc", "0", "experiment=ci_tiny"], ["--nproc", "0", ">= 1"]),
        (["compare", "--nproc", "-1"], ["--nproc", "-1", ">= 1"]),
        (["gen-data", "--out-dir", "x", "--num-samples", "0"], ["--num-samples", "0", ">= 1"]),
        (["gen-data", "--out-dir", "x", "--zipf-alpha", "0"], ["--zipf-alpha", "0", "> 0"]),
        (["train", "train.batch_size=abc"], ["train.batch_size", "'abc'", "int"]),
        (["train", "train.eval=maybe"], ["train.eval", "'maybe'", "bool"]),
        (["train", "prefetch.detph=4"], ["prefetch.detph is not a config key", "'prefetch' has [", "'depth'"]),
        (["train", "modle=debug"], ["modle is not a config key", "'model'"]),
        (["train", "model=nope"], ["model=nope", "dlrm_kaggle", "debug"]),
        (["compare", "experiment=nope"], ["experiment=nope", "ci_tiny"]),
        (["train", "cache.load_factor=[1"], ["cache.load_factor=[1"]),
        (["train", "train.batch_size=0"], ["train.batch_size=0", ">= 1"]),
    ],
)
def test_user_mistake_is_one_line_and_exit_code_2(args: List[str], fragments: List[str]) -> None:
    line = assert_user_error(cli(*args), *fragments)
    assert "To append to your config use +" not in line


def test_help_is_complete() -> None:
    top = cli("--help")
    assert top.rc == 0 and "``" not in top.out, top
    for command in ("gen-data", "train", "compare", "bench"):
        assert command in top.out

    gen = cli("gen-data", "--help")
    assert gen.rc == 0 and "``" not in gen.out, gen
    section = gen.out[gen.out.index("options:"):]
    blocks = re.split(r"\n(?=  -)", section)[1:]  # one block per option, its help included
    assert len(blocks) >= 10, gen
    for block in blocks:
        if block.lstrip().startswith("-h"):
            continue
        text = " ".join(block.split())  # argparse wraps to the terminal width
        assert "(default: " in text or "(required)" in text, block  # described, with its default
    assert "(default: 100000)" in gen.out and "(default: kaggle)" in gen.out, gen

    for command in ("train", "compare"):
        h = cli(command, "--help")
        assert h.rc == 0 and "``" not in h.out, h
        assert "(default: 1)" in h.out or "(default: 2)" in h.out, h
        # every config group with its options, and every experiment
        assert re.search(r"prefetch\s*:?\s+auto, fixed, off", h.out), h
        assert re.search(r"sharding\s*:?\s+auto, column_wise, row_wise, table_row_wise, table_wise", h.out), h
        for experiment in sorted(p.stem for p in (REPO / "conf" / "experiment").glob("*.yaml")):
            assert experiment in h.out, (experiment, h)


def test_version() -> None:
    from torchrec_proactive import __version__

    run = cli("--version")
    assert run.rc == 0 and run.out.strip().startswith(f"torchrec-proactive {__version__}"), run


def test_default_output_dir_is_a_new_hydra_style_run_dir() -> None:
    run = cli("train", "--cfg", "experiment=ci_tiny")
    assert run.rc == 0, run
    out = re.search(r"^  output_dir: (.*)$", run.out, flags=re.M)
    assert out and re.fullmatch(r"outputs/\d{4}-\d\d-\d\d/\d\d-\d\d-\d\d", out.group(1)), run


def test_importing_the_library_installs_no_warning_filters() -> None:
    # torch, numpy and sympy add their own filters at import; only ours must not
    code = ("import warnings, torch, torchrec, torchmetrics, hydra, tqdm; n = len(warnings.filters); "
            "import torchrec_proactive.app.entry, "
            "torchrec_proactive.cli, torchrec_proactive.app.train; assert len(warnings.filters) == n, "
            "warnings.filters[:len(warnings.filters) - n]")
    p = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120,
                       env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert p.returncode == 0, p.stderr[-3000:]


def test_gen_data_shows_a_progress_bar_on_a_terminal_only(tmp_path: Path) -> None:
    args = ["gen-data", "--num-samples", "300", "--max-cardinality", "50"]
    piped = cli(*args, "--out-dir", str(tmp_path / "a"))
    assert piped.rc == 0 and "\r" not in piped.err, piped
    term = cli(*args, "--out-dir", str(tmp_path / "b"), tty=True)
    assert term.rc == 0 and "300/300" in term.err, term


# ---------------------------------------------------------------------- runs


@pytest.mark.multiprocess
def test_cache_too_small_names_the_config_keys(tmp_path: Path) -> None:
    run = cli("train", *TINY, f"data.root={tmp_path / 'data'}", f"train.output_dir={tmp_path / 'out'}",
              "cache.fit_depth=false", "cache.load_factor=0.01")
    # The store either refuses the batch (an error) or serves the rows that do not fit from
    # the host tier (a warning); either way the user reads the config's key and value.
    if run.rc == 0:
        warned = [line for line in run.err.splitlines() if "warning:" in line and "slots" in line]
        assert warned and all("cache.load_factor (now 0.01)" in line for line in warned), run
    else:
        assert_user_error(run, "cache.load_factor=0.01 is too small for prefetch.depth=2", "slots")
    for library_name in ("cache_load_factor", "CacheParams"):
        assert library_name not in run.err, run


@pytest.mark.multiprocess
def test_unusable_data_root_names_it_and_the_failing_rank(tmp_path: Path) -> None:
    blocker = tmp_path / "a_file"
    blocker.write_text("not a directory")
    run = cli("train", "--nproc", "2", *TINY, f"data.root={blocker / 'data'}", f"train.output_dir={tmp_path / 'out'}")
    line = assert_user_error(run, "data.root=", str(blocker / "data"))
    # rank 0 prepares the data; rank 1 only waited for it and must not be named as failing
    assert "rank 1" not in line, run


@pytest.mark.multiprocess
def test_gen_data_then_train_runs_refuses_overwrite_and_resumes_a_finished_run(tmp_path: Path) -> None:
    from torchrec_proactive.app.result import TrainResult

    data, out = tmp_path / "mydata", tmp_path / "run"
    gen = cli("gen-data", "--out-dir", str(data), "--num-samples", "2000", "--max-cardinality", "500")
    assert gen.rc == 0, gen
    made = sorted(p.name for p in data.iterdir())

    # train uses gen-data's files (2000 rows: 1600 train rows / 64 = 25 steps, not ci_tiny's 37),
    # with a progress bar on a terminal and no third-party warnings
    # (train.resume=true on a fresh directory starts from scratch, and says so once)
    first = cli("train", *TINY, f"data.root={data}", f"train.output_dir={out}", "train.progress_bar=true",
                "train.resume=true", tty=True)
    assert first.rc == 0, first
    assert first.err.count("no complete checkpoint") == 1, first
    assert "25 training steps per epoch" in first.err, first
    assert "generating" not in first.err, first
    assert sorted(p.name for p in data.iterdir()) == sorted(set(made) | {"preprocessed"}), first
    assert re.search(r"train: .*6/6", first.err), first  # tqdm's bar
    for noise in ("Warning", "is_fx_tracing"):
        assert noise not in first.err, (noise, first)
    a = first.result()
    assert a["steps"] == 6 and a["checkpoint"].endswith("step_00000006") and a["train_loss"] > 0
    metrics = (out / "rank_0" / "metrics.jsonl").read_text()
    assert sorted(p.name for p in (out / "launches").iterdir()) == ["001"]
    # (a run directory from before launch records has Hydra's alone: it is kept on resume)
    __import__("shutil").rmtree(out / "launches")

    # a fresh run into the same directory is refused before it touches anything
    again = cli_here("train", *TINY, "train.max_steps=3", f"data.root={data}", f"train.output_dir={out}")
    assert_user_error(again, "train.output_dir=", str(out), "step 6", "train.resume=true")
    assert (out / "checkpoints" / "LATEST").read_text() == "step_00000006"
    assert (out / "rank_0" / "metrics.jsonl").read_text() == metrics

    # resuming a finished run says so and reports that run's final metrics
    # (given GPUs, as a Slurm job with --gres=gpu is: on a CPU build of torch, one line says so)
    resumed = cli("train", *TINY, f"data.root={data}", f"train.output_dir={out}", "train.resume=true",
                  "train.log_every=2", env={"CUDA_VISIBLE_DEVICES": "0,1"})
    assert resumed.rc == 0, resumed
    assert "already finished" in resumed.err, resumed
    _assert_says_cpu_build_once(resumed)
    # each launch's record is kept (Hydra's .hydra/ is the latest launch's); the refused one wrote none
    launches = sorted(p.name for p in (out / "launches").iterdir())
    assert launches == ["001", "002"], launches
    assert "train.progress_bar=true" in (out / "launches" / "001" / "overrides.yaml").read_text()
    assert "train.log_every=2" in (out / "launches" / "002" / "overrides.yaml").read_text()
    assert (out / ".hydra" / "overrides.yaml").read_text() == (out / "launches" / "002" / "overrides.yaml").read_text()
    c = resumed.result()
    assert c["already_finished"] and not a["already_finished"]
    assert {k: c[k] for k in ("steps", "train_loss", "auroc", "logloss", "checkpoint", "evals")} == \
        {k: a[k] for k in ("steps", "train_loss", "auroc", "logloss", "checkpoint", "evals")}

    # the example script prints the same documented schema
    ex = cli(*TINY, f"data.root={data}", f"train.output_dir={out}", "train.resume=true", script=EXAMPLE)
    assert ex.rc == 0, ex
    names = [f.name for f in fields(TrainResult)]
    assert list(a) == list(c) == list(ex.result()) == names
    assert ex.result()["train_loss"] == a["train_loss"]


@pytest.mark.multiprocess
def test_compare_prints_a_table_and_logs_the_config_once(ci_tiny_compare) -> None:
    run = ci_tiny_compare.run  # (conftest: one ci_tiny compare run several modules read)
    assert len(re.findall(r"\] config [0-9a-f]{16} on", run.err)) == 1, run
    assert "{'" not in run.err + run.out, run  # no raw Python dicts
    table = run.out
    assert re.search(r"^mode\s+depth\s+samples/s", table, flags=re.M), run
    assert re.search(r"^reactive\s+0\s", table, flags=re.M) and re.search(r"^proactive\s+2\s", table, flags=re.M)
    assert "final parameters bit-identical: yes" in table


def _assert_says_cpu_build_once(run: Run) -> None:
    """A .venv bootstrapped on a GPU-less login node holds the CPU build, and a Slurm job
    given GPUs (CUDA_VISIBLE_DEVICES=0,1) would train on CPU without a word: one warning line
    naming the fix (on a CUDA build: no such line)."""
    import torch

    said = [line for line in run.err.splitlines() if "CPU build" in line]
    if torch.version.cuda is not None:
        assert not said, said
        return
    assert len(said) == 1, run
    for words in ("CUDA_VISIBLE_DEVICES=0,1", torch.__version__, "scripts/bootstrap.sh", "nvidia-smi",
                  "train.device=cpu"):
        assert words in said[0], (words, said[0])


@pytest.mark.skipif(__import__("torch").version.cuda is not None, reason="needs a CPU build of torch")
def test_a_cpu_torch_build_given_gpus_is_named() -> None:
    """train.device=cuda on a CPU build is refused in one line naming the fix (it was a
    ValueError traceback); no GPUs given, nothing to say. (The warning of a train.device=auto
    run: test_gen_data_then_train_runs_refuses_overwrite_and_resumes_a_finished_run.)"""
    from torchrec_proactive.app.env import cpu_build_note, pick_device
    from torchrec_proactive.app.errors import ConfigError

    with pytest.raises(ConfigError, match="train.device='cuda'.*CPU build.*scripts/bootstrap.sh"):
        pick_device("cuda", 0)
    assert cpu_build_note({"CUDA_VISIBLE_DEVICES": ""}) is None  # no GPU given to the job
    assert cpu_build_note({"CUDA_VISIBLE_DEVICES": "-1"}) is None
    assert "CUDA_VISIBLE_DEVICES=0" in cpu_build_note({"CUDA_VISIBLE_DEVICES": "0"})
