"""The Hydra config tree: every group variant and experiment composes, validates and
instantiates; bad overrides fail at composition with a message naming the problem."""

from __future__ import annotations

import re
import sys
from pathlib import Path
from typing import List

import pytest
import torch

from torchrec_proactive import cli
from torchrec_proactive.app.compose import compose_config, config_hash, find_config_dir, flatten
from torchrec_proactive.app.errors import ConfigError
from torchrec_proactive.config.schema import GROUPS, Config
from torchrec_proactive.data import KAGGLE_CARDINALITIES, TERABYTE_CARDINALITIES

CONF = find_config_dir()


def _variants(group: str) -> List[str]:
    return sorted(p.stem for p in (CONF / group).glob("*.yaml"))


def _experiments() -> List[str]:
    return _variants("experiment")


def test_config_dir_is_the_repositorys() -> None:
    # the packaged configs are the repository's conf/ (a symlink a wheel build follows)
    repo = Path(__file__).resolve().parents[1]
    assert CONF == repo / "torchrec_proactive" / "conf" and CONF.resolve() == repo / "conf"
    defaults = (CONF / "config.yaml").read_text()
    body = defaults[defaults.index("defaults:"):].splitlines()[1:]
    entries = [line.strip()[2:] for line in body if line.strip().startswith("- ")]
    assert entries[0] == "_self_", "the defaults list puts _self_ first"
    groups = [e.split(":")[0] for e in entries if ":" in e]
    assert sorted(groups) == sorted(list(GROUPS) + ["experiment"])


def test_default_config() -> None:
    cfg = compose_config()
    assert isinstance(cfg, Config)
    assert (cfg.model.name, cfg.data.source, cfg.prefetch.mode, cfg.prefetch.depth) == ("debug", "synthetic", "fixed", 2)
    # Hydra's run-directory pattern, resolved when composed
    assert re.fullmatch(r"outputs/\d{4}-\d\d-\d\d/\d\d-\d\d-\d\d", cfg.train.output_dir), cfg.train.output_dir
    assert config_hash(cfg) == config_hash(compose_config([f"train.output_dir={cfg.train.output_dir}"]))


@pytest.mark.parametrize("group,variant", [(g, v) for g in GROUPS for v in _variants(g)])
def test_every_group_variant(group: str, variant: str) -> None:
    cfg = compose_config([f"{group}={variant}"])
    node = getattr(cfg, group)
    assert isinstance(node, GROUPS[group])
    if hasattr(node, "name"):
        assert node.name == variant


def test_every_group_has_variants() -> None:
    for group in GROUPS:
        assert _variants(group), f"conf/{group}/ has no variant"


@pytest.mark.parametrize("variant", _variants("model"))
def test_every_model_instantiates(variant: str) -> None:
    from torchrec_proactive.app.model import build_model

    cfg = compose_config([f"model={variant}"])
    cards = {"dcnv2_terabyte": [min(c, 40_000_000) for c in TERABYTE_CARDINALITIES]}.get(variant, KAGGLE_CARDINALITIES)
    model = build_model(cfg.model, cards, torch.device("meta"))  # full-size tables, no memory
    arch = type(model.model).__name__
    assert arch == {"dlrm": "DLRM", "dcnv2": "DLRM_DCN", "sequence": "SequenceRecommender"}[cfg.model.arch]
    if cfg.model.arch == "sequence":  # the pooled features, and the history table beside them
        ebc = model.model.embedding_bag_collection
        (history,) = model.model.embedding_collection.embedding_configs()
        assert (history.name, history.num_embeddings) == ("t_history", cfg.model.history_rows)
    else:
        ebc = model.model.sparse_arch.embedding_bag_collection
    assert [t.num_embeddings for t in ebc.embedding_bag_configs()] == list(cards)


@pytest.mark.parametrize("name", _experiments())
def test_every_experiment(name: str) -> None:
    lines = (CONF / "experiment" / f"{name}.yaml").read_text().splitlines()
    # Hydra reads the package header only from the leading "# @" lines, so it comes first;
    # the next line is the command that runs the experiment.
    assert lines[0] == "# @package _global_"
    assert lines[1].startswith("# ") and f"experiment={name}" in lines[1], lines[1]
    cfg = compose_config([f"experiment={name}"])
    assert isinstance(cfg, Config)
    assert flatten(cfg) != flatten(compose_config())


def test_experiment_overrides() -> None:
    cfg = compose_config(["experiment=terabyte_dcnv2"])
    assert (cfg.model.arch, cfg.data.layout, cfg.sharding.type, cfg.cache.load_factor) == ("dcnv2", "terabyte", "auto", 0.1)
    # the `+experiment=` habit of other Hydra projects selects it the same way
    # (a fixed train.output_dir: the default is a new time-stamped run directory per composition)
    pinned = ["train.output_dir=/tmp/x"]
    assert flatten(compose_config(["+experiment=ci_tiny", *pinned])) == flatten(compose_config(["experiment=ci_tiny", *pinned]))
    # command-line overrides still win over the experiment
    assert compose_config(["experiment=ci_tiny", "train.batch_size=8"]).train.batch_size == 8


@pytest.mark.parametrize(
    "overrides,fragments",
    [
        (["model.embedding_dims=8"], ["model.embedding_dims is not a config key", "'embedding_dim'"]),
        (["+train.bogus=1"], ["train.bogus is not a config key", "batch_size"]),
        (["train.batch_size=abc"], ["train.batch_size='abc' is invalid", "integer"]),
        (["model=nope"], ["model=nope is not an option", "dlrm_kaggle"]),
        (["experiment=nope"], ["experiment=nope is not an option", "ci_tiny"]),
        (["train.batch_size=0"], ["train.batch_size=0", ">= 1"]),
        (["cache.load_factor=1.5"], ["cache.load_factor=1.5", "(0, 1]"]),
        (["cache.eviction_policy=fifo"], ["cache.eviction_policy='fifo'", "lru"]),
        (["sharding.type=diagonal"], ["sharding.type='diagonal'", "table_row_wise"]),
        (["prefetch=off", "prefetch.depth=2"], ["prefetch.depth=2", "mode='off'"]),
        (["prefetch.depth=-1"], ["prefetch.depth=-1", ">= 0"]),
        (["model.embedding_dim=32"], ["model.dense_arch_layer_sizes", "embedding_dim=32"]),
        (["link.bandwidth_gbps=0"], ["link.bandwidth_gbps=0", "> 0"]),
        (["optimizer.embedding=lamb"], ["optimizer.embedding='lamb'", "rowwise_adagrad"]),
        (["data.eval_fraction=1.0"], ["data.eval_fraction=1.0", "(0, 1)"]),
        (["sharding.kernel=fused"], ["prefetch.mode='fixed'", "kernel='fused'"]),
    ],
)
def test_bad_overrides_fail_clearly(overrides: List[str], fragments: List[str]) -> None:
    with pytest.raises(ConfigError) as info:  # a ValueError; the CLI prints it as one line
        compose_config(overrides)
    text = str(info.value)
    assert "\n" not in text, text
    for fragment in fragments:
        assert fragment in text, f"{fragment!r} not in {text!r}"


def test_cli_rejects_bad_override(capsys: pytest.CaptureFixture) -> None:
    assert cli.main(["train", "train.batch_size=0"]) == cli.EXIT_USAGE
    assert "train.batch_size=0 is invalid" in capsys.readouterr().err


def test_cli_prints_config(capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit) as info:
        cli.main(["train", "experiment=ci_tiny", "--cfg", "prefetch=auto"])  # options may follow overrides
    assert info.value.code == 0
    out = capsys.readouterr().out
    assert "mode: auto" in out and "num_samples: 3000" in out


def test_cli_bench_without_runner(capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "torchrec_proactive.bench.runner", None)  # as if not installed
    assert cli.main(["bench", "--quick"]) == cli.EXIT_USAGE
    assert "benchmark runner" in capsys.readouterr().err
