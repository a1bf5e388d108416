"""The CLI as a Hydra application, used as Hydra users use it: ``-m`` sweeps, ``--cfg
job|hydra|all``, ``--info``, ``hydra.run.dir``/``hydra.sweep.dir``/``hydra.job.chdir``,
``--config-dir`` and ``hydra.searchpath`` adding to the packaged configs, and configs that
ship inside a built wheel (composing from an installed copy, without the checkout).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path
from typing import List

import pytest

from tests.test_cli import TINY, assert_user_error, cli, cli_here
from torchrec_proactive.app.compose import compose_config
from torchrec_proactive.app.errors import ConfigError

REPO = Path(__file__).resolve().parents[1]
CONF = REPO / "conf"
MY_EXPERIMENT = "# @package _global_\n# my own experiment, in a --config-dir of its own\n" \
                "defaults:\n  - override /model: debug\ntrain:\n  batch_size: 40\n  log_every: 3\n"


def _my_config_dir(tmp_path: Path) -> Path:
    """A config directory that holds only one experiment, as a user writes it."""
    d = tmp_path / "myconf"
    (d / "experiment").mkdir(parents=True)
    (d / "experiment" / "my_kaggle.yaml").write_text(MY_EXPERIMENT)
    return d


def _json_lines(text: str) -> List[dict]:
    return [json.loads(line) for line in text.splitlines() if line.startswith("{")]


# ---------------------------------------------------------------------- no ranks


def test_cfg_job_hydra_all_and_info() -> None:
    # (in this process: Hydra prints and exits before any rank; cli_here fails the test if ranks start)
    job = cli_here("train", "--cfg", "job", "experiment=ci_tiny")
    assert job.rc == 0 and "num_samples: 3000" in job.out and "hydra:" not in job.out, job
    hydra = cli_here("train", "--cfg", "hydra", "hydra.run.dir=/somewhere/else")
    assert hydra.rc == 0 and "dir: /somewhere/else" in hydra.out and "\nmodel:" not in hydra.out, hydra
    both = cli_here("train", "--cfg", "all", "experiment=ci_tiny")
    assert both.rc == 0 and "hydra:" in both.out and "num_samples: 3000" in both.out, both
    resolved = cli_here("compare", "--cfg", "job", "--resolve")
    assert resolved.rc == 0 and "bandwidth_gbps: 0.1" in resolved.out and "${" not in resolved.out, resolved
    info = cli_here("train", "--info", "searchpath")
    assert info.rc == 0 and f"file://{REPO / 'torchrec_proactive' / 'conf'}" in info.out, info
    # A bare --info (its value is optional), before or after an override.
    for args in (["--info"], ["experiment=ci_tiny", "--info"]):
        bare = cli_here("train", *args)
        assert bare.rc == 0 and "Config search path" in bare.out, (args, bare)


def test_config_dir_and_searchpath_add_to_the_packaged_configs(tmp_path: Path) -> None:
    mine = _my_config_dir(tmp_path)
    for how in (["--config-dir", str(mine)], [f"hydra.searchpath=[file://{mine}]"]):
        # the typed config (--cfg alone) and Hydra's own (--cfg job) both find the packaged groups
        typed = cli("train", "--cfg", *how, "experiment=my_kaggle", "prefetch=auto")
        assert typed.rc == 0, typed
        assert "batch_size: 40" in typed.out and "mode: auto" in typed.out, typed
        job = cli("train", "--cfg", "job", *how, "experiment=my_kaggle")
        assert job.rc == 0 and "batch_size: 40" in job.out, job
    helped = cli("train", "--help", "--config-dir", str(mine))
    assert helped.rc == 0, helped
    missing = cli("train", "--config-dir", str(tmp_path / "nope"), "experiment=ci_tiny")
    assert_user_error(missing, "--config-dir=", "nope", "no such directory")


def test_a_typo_inside_a_config_dir_experiment_names_the_key(tmp_path: Path) -> None:
    mine = _my_config_dir(tmp_path)
    (mine / "experiment" / "my_run2.yaml").write_text("# @package _global_\ntrain:\n  batch_sze: 32\n")
    with pytest.raises(ConfigError) as info:
        compose_config(["experiment=my_run2"], str(mine))
    assert str(info.value).startswith("In 'experiment/my_run2': train.batch_sze is not a config key; 'train' has ["), \
        info.value
    assert "'batch_size'" in str(info.value)


@pytest.mark.parametrize(
    "args,fragments",
    [
        # a typo in any job of a sweep fails before the first job starts
        (["-m", "train.batch_size=8,0"], ["train.batch_size=0", ">= 1"]),
        (["-m", "prefetch.detph=1,2"], ["prefetch.detph is not a config key"]),
        (["--cfg", "job", "train.eval=maybe"], ["train.eval", "'maybe'", "bool"]),
        (["prefetch.depth=1,2"], ["prefetch.depth=1,2", "--multirun"]),
        # Hydra's own mistakes, as one line too (they were tracebacks)
        (["--cfg", "job", "--info", "all"], ["--cfg and --info cannot be given together"]),
        (["prefetch.depth=${oops}"], ["prefetch.depth", "Interpolation key 'oops' not found"]),
        (["-m", "prefetch.depth=0,1", "train.output_dir=/tmp/one_dir"], ["is the same for 2 jobs of the sweep"]),
        # caches sized for a depth below the run's cannot hold its batches
        (["-m", "prefetch.depth=1,2", "cache.sized_for_depth=1"],
         ["cache.sized_for_depth=1 is invalid", "must be >= the run's prefetch depth 2"]),
    ],
)
def test_mistakes_stay_one_line_with_exit_code_2(args: List[str], fragments: List[str], tmp_path: Path) -> None:
    run = cli("train", *args, f"hydra.sweep.dir={tmp_path / 'sweep'}", f"hydra.run.dir={tmp_path / 'run'}")
    assert_user_error(run, *fragments)
    assert not (tmp_path / "sweep").exists() and not (tmp_path / "run").exists()


def test_wheel_ships_the_configs_and_composes_without_the_checkout(tmp_path: Path) -> None:
    # build from a copy of the source tree (pip writes build/ next to setup.cfg)
    src = tmp_path / "src"
    top_level = {".git", "build", ".venv", "outputs", "multirun", "data", ".pytest_cache", "out"}

    def ignore(directory: str, names: List[str]) -> List[str]:
        skip = top_level if Path(directory) == REPO else set()
        return [n for n in names if n in skip or n == "__pycache__" or n.endswith(".egg-info")]

    shutil.copytree(REPO, src, symlinks=True, ignore=ignore)
    wheels = tmp_path / "wheels"
    built = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                            "-w", str(wheels), str(src)], capture_output=True, text=True, timeout=300)
    assert built.returncode == 0, built.stderr[-3000:]
    # quiet, as scripts/bootstrap.sh's install is: no setuptools warnings (undeclared config
    # packages, a licence classifier made ~200 lines of them)
    warned = [line for line in built.stderr.splitlines() if "warning" in line.lower()]
    assert not warned, warned[:5]
    wheel = next(wheels.glob("torchrec_proactive-*.whl"))
    names = set(zipfile.ZipFile(wheel).namelist())
    shipped = {f"torchrec_proactive/conf/{p.relative_to(CONF)}" for p in CONF.rglob("*.yaml")}
    assert len(shipped) > 20 and shipped <= names, sorted(shipped - names)

    # an installed copy (a wheel is the site-packages tree, zipped), far from any checkout
    site = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(site)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    env = dict(os.environ, PYTHONPATH=str(site), OMP_NUM_THREADS="1")
    env.pop("TORCHREC_PROACTIVE_CONFIG_DIR", None)
    code = ("import torchrec_proactive, sys; from torchrec_proactive.app.compose import compose_config; "
            f"assert torchrec_proactive.__file__.startswith({str(site)!r}), torchrec_proactive.__file__; "
            "cfg = compose_config(['experiment=terabyte_dcnv2']); print(cfg.model.arch, cfg.data.layout)")
    composed = subprocess.run([sys.executable, "-c", code], cwd=elsewhere, env=env, capture_output=True,
                              text=True, timeout=120)
    assert composed.returncode == 0 and composed.stdout.split() == ["dcnv2", "terabyte"], composed.stderr[-3000:]
    shown = subprocess.run([sys.executable, "-m", "torchrec_proactive.cli", "train", "--cfg", "job",
                            "experiment=ci_tiny"], cwd=elsewhere, env=env, capture_output=True, text=True,
                           timeout=120)
    assert shown.returncode == 0 and "num_samples: 3000" in shown.stdout, shown.stderr[-3000:]


# ---------------------------------------------------------------------- runs


@pytest.mark.multiprocess
def test_multirun_sweep_gives_each_job_its_own_run_dir_and_ranks(tmp_path: Path) -> None:
    """... and a sweep over the depth holds the caches fixed (issue 41): with cache.fit_depth
    (the default) each job's caches were sized for its own depth - 128 slots at depth 0, 384
    at depth 2 - so the sweep compared caches as much as depths. Every job's caches are sized
    for the sweep's largest depth, said once, and recorded in each job's overrides."""
    sweep = tmp_path / "sweep"
    run = cli("train", "--nproc", "2", "-m", "prefetch.depth=0,2", *TINY, "train.max_steps=3",
              f"data.root={tmp_path / 'data'}", f"hydra.sweep.dir={sweep}", timeout=400)
    assert run.rc == 0, run
    results = _json_lines(run.out)
    assert [r["prefetch_depth"] for r in results] == [0, 2], run
    assert [r["output_dir"] for r in results] == [str(sweep / "0"), str(sweep / "1")], run
    for job in ("0", "1"):
        assert (sweep / job / ".hydra" / "overrides.yaml").is_file()
        assert "cache.sized_for_depth=2" in (sweep / job / ".hydra" / "overrides.yaml").read_text()
        # each job launched its own two ranks into its own directory
        assert sorted(p.name for p in (sweep / job).glob("rank_*")) == ["rank_0", "rank_1"]
        assert (sweep / job / "checkpoints" / "LATEST").read_text() == "step_00000003"
        assert json.loads((sweep / job / "result.json").read_text()) == results[int(job)]
    assert (sweep / "multirun.yaml").is_file()
    # one cache for the whole sweep: the same slots in both jobs, grown for 3 batches of 128 ids
    assert run.err.count("every job's caches are sized for depth 2 (cache.sized_for_depth=2)") == 1, run
    assert results[0]["cache_slots"] == results[1]["cache_slots"] and results[0]["cache_slots"], run
    assert max(results[0]["cache_slots"].values()) == 3 * 2 * 64, results[0]["cache_slots"]
    # the depth-2 job prefetched: nothing waited for room, so no word of falling back
    assert results[1]["deferred_batches"] == 0 and "fell back" not in run.err, run


@pytest.mark.multiprocess
def test_hydra_run_dir_and_chdir_are_honoured(tmp_path: Path) -> None:
    start, run_dir = tmp_path / "start", tmp_path / "run"
    start.mkdir()
    run = cli("train", *TINY, "train.max_steps=2", "data.root=rel_data", f"hydra.run.dir={run_dir}",
              "hydra.job.chdir=true", cwd=start)
    assert run.rc == 0, run
    result = run.result()
    assert result["output_dir"] == str(run_dir) and result["checkpoint"].startswith(str(run_dir)), run
    assert (run_dir / ".hydra" / "config.yaml").is_file() and (run_dir / "rank_0" / "metrics.jsonl").is_file()
    # a relative path on the command line means the directory the user started from
    assert (start / "rel_data").is_dir() and not (run_dir / "rel_data").exists()
    # the job's log (Hydra's <run dir>/train.log) holds the run's own log
    assert "done: 2 steps" in (run_dir / "train.log").read_text()
    # the run directory belongs to that run: a fresh run there is refused, one line, exit code 2,
    # and nothing is written before the refusal (Hydra's record of the run stays that run's)
    record = {p.name: p.read_bytes() for p in (run_dir / ".hydra").iterdir()}
    again = cli_here("train", *TINY, "train.max_steps=2", "train.log_every=1", "data.root=rel_data",
                     f"hydra.run.dir={run_dir}", cwd=start)
    assert_user_error(again, "train.output_dir=", str(run_dir), "train.resume=true")
    changed = cli_here("train", *TINY, "train.max_steps=4", "optimizer=adam", "train.resume=true",
                       "data.root=rel_data", f"hydra.run.dir={run_dir}", cwd=start)
    assert_user_error(changed, "cannot resume", "optimizer.")
    assert {p.name: p.read_bytes() for p in (run_dir / ".hydra").iterdir()} == record


@pytest.mark.multiprocess
def test_hydra_record_and_job_log_are_in_the_run_dir(ci_tiny_compare) -> None:
    # (conftest: a compare run from its own directory with train.output_dir=runs/x)
    run, start, run_dir = ci_tiny_compare
    assert not (start / "outputs").exists(), sorted(p.name for p in start.iterdir())  # no stray record
    assert (run_dir / ".hydra" / "config.yaml").is_file() and (run_dir / ".hydra" / "overrides.yaml").is_file()
    log = (run_dir / "compare.log").read_text()
    assert "compare: reactive (prefetch off, depth 0) and proactive (depth 2)" in log, log
    assert "Successfully loaded" not in log + run.out + run.err, run


def test_every_path_key_is_made_absolute_when_hydra_changes_directory(tmp_path: Path, monkeypatch) -> None:
    """Under hydra.job.chdir=true a relative path on the command line means the directory the
    user started from: the data, the preprocessed arrays, the run and checkpoint directories and
    the cache profile (cache.profile_path was left relative to the run directory)."""
    from omegaconf import OmegaConf

    from torchrec_proactive.app.hydra_app import _pinned

    keys = {"data.root": "d", "data.preprocessed_dir": "p", "train.output_dir": "o", "train.checkpoint_dir": "c",
            "cache.profile_path": "prof.json"}
    node = OmegaConf.structured(compose_config([f"{k}={v}" for k, v in keys.items()]))
    start = tmp_path / "start"
    monkeypatch.chdir(tmp_path)
    pins = _pinned(node, [f"{k}={v}" for k, v in keys.items()], str(tmp_path / "run"), str(start))
    for key, value in keys.items():
        assert f"{key}='{start / value}'" in pins, (key, pins)
        assert OmegaConf.select(node, key) == str(start / value)
