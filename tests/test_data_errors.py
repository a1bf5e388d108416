"""Bad data gets one line naming the file, the line number, the field and the value (exit
code 2 from the CLI) and leaves nothing half-written; eval-split errors name the config
keys; preprocessing says what it does and when it reuses earlier output."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import List

import numpy as np
import pytest

from tests.test_cli import TINY, assert_user_error, cli, cli_here
from torchrec_proactive.app.data import check_split, hash_to_tables
from torchrec_proactive.app.errors import ConfigError, UserError
from torchrec_proactive.app.preflight import check_data_files, check_resume
from torchrec_proactive.config.schema import DataConfig
from torchrec_proactive.data import SyntheticCriteoSpec, generate
from torchrec_proactive.data.criteo import CriteoFormatError, make_dataloaders, open_torchrec_binary, preprocess


def _good_rows(tmp_path: Path, n: int = 40) -> List[str]:
    spec = SyntheticCriteoSpec(layout="kaggle", num_samples=n, max_cardinality=50, seed=3)
    (path,) = generate(spec, tmp_path / "gen", progress=False)
    return path.read_text().splitlines()


def _edit(row: str, column: int, value: str) -> str:
    fields = row.split("\t")
    fields[column] = value
    return "\t".join(fields)


# (name, how line 3 is broken, fragments the message must hold)
CASES = [
    ("short_line", lambda r: "\t".join(r.split("\t")[:30]), ["line 3", "30 tab-separated fields", "40"]),
    ("blank_line", lambda r: "", ["line 3", "1 tab-separated fields"]),
    ("non_integer", lambda r: _edit(r, 5, "12x"), ["line 3", "I5='12x'", "not an integer"]),
    ("bad_hex", lambda r: _edit(r, 20, "zz9q"), ["line 3", "C7='zz9q'", "not a hexadecimal id"]),
    ("above_int32", lambda r: _edit(r, 2, "3000000000"), ["line 3", "I2='3000000000'", "int32"]),
    ("bad_label", lambda r: _edit(r, 0, "2"), ["line 3", "label='2'", "0 or 1"]),
]


@pytest.mark.parametrize("name,breaker,fragments", CASES, ids=[c[0] for c in CASES])
def test_malformed_tsv_is_one_line_naming_file_line_field_value(tmp_path: Path, name, breaker, fragments) -> None:
    rows = _good_rows(tmp_path)
    rows[2] = breaker(rows[2])
    good, bad = tmp_path / "day_0", tmp_path / "day_1"
    good.write_text("\n".join(_good_rows(tmp_path)) + "\n")
    bad.write_text("\n".join(rows) + "\n")
    out = tmp_path / "pre"
    with pytest.raises(CriteoFormatError) as info:
        preprocess([good, bad], out, progress=False, frequency_threshold=0)
    text = str(info.value)
    assert "\n" not in text and str(bad) in text, text
    for fragment in fragments:
        assert fragment in text, (fragment, text)
    assert not out.exists(), sorted(p.name for p in out.iterdir())  # nothing half-written, not even day_0's


def test_empty_file(tmp_path: Path) -> None:
    empty = tmp_path / "train.txt"
    empty.write_text("")
    with pytest.raises(CriteoFormatError, match=r"train\.txt is empty"):
        preprocess([empty], tmp_path / "pre", progress=False)
    assert not (tmp_path / "pre").exists()


def test_preprocessing_logs_its_work_and_reuse(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    src = tmp_path / "train.txt"
    src.write_text("\n".join(_good_rows(tmp_path)) + "\n")
    log = logging.getLogger("test.preprocess")
    with caplog.at_level(logging.INFO, logger="test.preprocess"):
        preprocess([src], tmp_path / "pre", progress=False, log=log)
        first = caplog.text
        caplog.clear()
        preprocess([src], tmp_path / "pre", progress=False, log=log)
    assert "preprocessing 1 Criteo TSV file(s) (train.txt)" in first and "preprocessing done: 40 rows" in first
    assert "reusing" in caplog.text and "preprocessing 1" not in caplog.text, caplog.text


def test_eval_split_errors_name_the_config_keys() -> None:
    cfg = DataConfig(eval_fraction=0.01)
    with pytest.raises(ConfigError) as info:
        check_split([3000], cfg, batch_size=64, world_size=2)
    text = str(info.value)
    for key in ("data.eval_fraction=0.01", "30 evaluation rows", "train.batch_size=64", "2 rank(s) = 128"):
        assert key in text, text
    with pytest.raises(ConfigError, match="training rows"):
        check_split([300], DataConfig(eval_fraction=0.9), batch_size=64, world_size=1)
    check_split([3000], DataConfig(eval_fraction=0.1), batch_size=64, world_size=2)  # fits


@pytest.mark.multiprocess
def test_cli_reports_bad_data_in_one_line_with_exit_code_2(tmp_path: Path) -> None:
    rows = _good_rows(tmp_path, n=3000)
    rows[1233] = _edit(rows[1233], 9, "4294967296")
    root = tmp_path / "criteo"
    root.mkdir()
    (root / "train.txt").write_text("\n".join(rows) + "\n")
    run = cli("train", *TINY, "data=criteo_kaggle", f"data.root={root}", f"train.output_dir={tmp_path / 'out'}")
    assert_user_error(run, str(root / "train.txt"), "line 1234", "I9='4294967296'")
    assert not (root / "preprocessed").exists()
    small = cli("train", *TINY, f"data.root={tmp_path / 'syn'}", "data.eval_fraction=0.01",
                f"train.output_dir={tmp_path / 'out2'}")
    assert_user_error(small, "data.eval_fraction=0.01", "train.batch_size=64")


# ------------------------------------------------------- TorchRec's .npy arrays as users have them


def _write_npy_days(root: Path, rows: List[int], sparse_suffix: str = "_sparse_contig_freq.npy",
                    seed: int = 0) -> None:
    """A data.root of TorchRec's arrays, as its scripts write them (float32 dense, int32
    labels, integer ids)."""
    rng = np.random.default_rng(seed)
    root.mkdir(parents=True, exist_ok=True)
    for day, n in enumerate(rows):
        np.save(root / f"day_{day}_dense.npy", rng.random((n, 13), dtype=np.float32))
        np.save(root / f"day_{day}_labels.npy", (rng.random((n, 1)) < 0.3).astype(np.int32))
        np.save(root / f"day_{day}{sparse_suffix}", rng.integers(1, 40, size=(n, 26)).astype(np.int32))


@pytest.mark.parametrize("kind,dtype,fragments", [
    ("labels", np.float32, ["day_1_labels.npy", "dtype float32", "int32"]),
    ("dense", np.float64, ["day_1_dense.npy", "dtype float64", "float32"]),
    ("sparse_contig_freq", np.float32, ["day_1_sparse_contig_freq.npy", "dtype float32", "integer"]),
])
def test_npy_dtypes_are_checked_when_opened(tmp_path: Path, kind: str, dtype, fragments: List[str]) -> None:
    _write_npy_days(tmp_path, [200, 200])
    path = tmp_path / f"day_1_{kind}.npy"
    np.save(path, np.load(path).astype(dtype))
    with pytest.raises(CriteoFormatError) as info:
        open_torchrec_binary(tmp_path, "terabyte", num_days=2)
    for fragment in fragments:
        assert fragment in str(info.value), str(info.value)
    with pytest.raises(UserError) as early:  # the launching process says the same
        check_data_files(DataConfig(source="criteo", layout="terabyte", root=str(tmp_path), num_days=2))
    assert str(early.value) == str(info.value)


@pytest.mark.parametrize("world_size", [1, 2])
def test_npy_labels_and_ids_are_checked_batch_by_batch(tmp_path: Path, world_size: int) -> None:
    _write_npy_days(tmp_path, [200, 200])
    labels = np.load(tmp_path / "day_1_labels.npy")
    labels[37, 0] = 2  # row 237 of the split: in batch 7 of 32 rows
    np.save(tmp_path / "day_1_labels.npy", labels)
    pre = open_torchrec_binary(tmp_path, "terabyte", num_days=2)  # headers are fine: opened
    assert pre is not None
    seen = []
    for rank in range(world_size):
        train, _ = make_dataloaders(pre, 32, rank, world_size, eval_fraction=0.2)
        try:
            for _ in train:
                pass
        except CriteoFormatError as e:
            seen.append((rank, str(e)))
    # batch 7 (rows 224..255) is rank 7 % world_size's
    assert seen == [(7 % world_size, f"{tmp_path / 'day_1_labels.npy'}, row 37: label=2 is invalid: must be 0 or 1")]

    _write_npy_days(tmp_path, [200, 200])
    ids = np.load(tmp_path / "day_0_sparse_contig_freq.npy")
    ids[5, 3] = -7
    np.save(tmp_path / "day_0_sparse_contig_freq.npy", ids)
    train, _ = make_dataloaders(open_torchrec_binary(tmp_path, "terabyte", num_days=2), 32, 0, 1, eval_fraction=0.1)
    with pytest.raises(CriteoFormatError, match=r"day_0_sparse_contig_freq\.npy, row 5: C4 id -7 is invalid"):
        next(iter(train))


def test_truncated_npy_is_one_line_naming_the_file(tmp_path: Path) -> None:
    _write_npy_days(tmp_path, [200, 200])
    dense = tmp_path / "day_1_dense.npy"
    dense.write_bytes(dense.read_bytes()[: dense.stat().st_size // 2])
    cfg = DataConfig(source="criteo", layout="terabyte", root=str(tmp_path), num_days=2)
    with pytest.raises(UserError) as info:
        check_data_files(cfg)
    text = str(info.value)
    assert text.startswith(f"{dense} is truncated") and "(200, 13) float32" in text and "\n" not in text, text


def test_a_root_of_sparse_files_only_or_too_few_days_names_what_is_missing(tmp_path: Path) -> None:
    _write_npy_days(tmp_path / "contig", [50, 50])
    for p in (tmp_path / "contig").glob("day_*_[dl]*.npy"):
        p.unlink()  # only contiguous_preproc_criteo.py's output left
    with pytest.raises(UserError) as info:
        check_data_files(DataConfig(source="criteo", layout="terabyte", root=str(tmp_path / "contig"), num_days=2))
    assert "found sparse files" in str(info.value) and "put the dense and label files beside them" in str(info.value)

    _write_npy_days(tmp_path / "three", [50, 50, 50])
    with pytest.raises(UserError) as info:
        check_data_files(DataConfig(source="criteo", layout="terabyte", root=str(tmp_path / "three"), num_days=24))
    assert "data.num_days=24" in str(info.value) and "holds 3 of them" in str(info.value), info.value


def test_ids_are_hashed_modulo_smaller_tables_as_dlrm_main_does(tmp_path: Path,
                                                               caplog: pytest.LogCaptureFixture) -> None:
    _write_npy_days(tmp_path, [200, 200], sparse_suffix="_sparse.npy")  # raw ids, as npy_preproc_criteo writes
    raw = np.load(tmp_path / "day_0_sparse.npy").astype(np.int64)
    raw[:, 0] += 10_000_000  # a raw hash far beyond any small table
    np.save(tmp_path / "day_0_sparse.npy", raw)
    pre = open_torchrec_binary(tmp_path, "terabyte", num_days=2)
    tables = [5000] + [7] * 25
    log = logging.getLogger("test.hash")
    with caplog.at_level(logging.INFO, logger="test.hash"):
        hashed = hash_to_tables(pre, tables, log)
    assert hashed.cardinalities == tuple(tables)
    assert sum("hashed modulo model.num_embeddings_per_feature" in r.getMessage() for r in caplog.records) == 1
    train, _ = make_dataloaders(hashed, 50, 0, 1, eval_fraction=0.2)
    first = next(iter(train)).sparse_features.values().numpy().reshape(26, -1).T
    assert np.array_equal(first, raw[:50] % np.array(tables))  # what TorchRec's pipe does with hashes=tables
    assert hash_to_tables(pre, None, log) is pre


def test_resume_is_checked_before_the_ranks_start(tmp_path: Path) -> None:
    from torchrec_proactive.app.compose import compose_config, flatten

    cfg = compose_config(["experiment=ci_tiny", f"train.output_dir={tmp_path}", "train.resume=true"])
    step = tmp_path / "checkpoints" / "step_00000010"
    step.mkdir(parents=True)
    saved = dict(flatten(cfg), **{"model.embedding_dim": cfg.model.embedding_dim + 1})
    (step / "MANIFEST.json").write_text(json.dumps({"format": 2, "step": 10, "world_size": 1, "ranks": [{}],
                                                    "state": {}, "created": 0.0, "config": saved}))
    with pytest.raises(UserError, match=r"cannot resume from .*step_00000010.*model\.embedding_dim"):
        check_resume(cfg)


@pytest.mark.multiprocess
def test_cli_refuses_a_truncated_npy_before_any_rank_starts(tmp_path: Path) -> None:
    _write_npy_days(tmp_path / "root", [300, 300])
    labels = tmp_path / "root" / "day_0_labels.npy"
    labels.write_bytes(labels.read_bytes()[:200])
    run = cli_here("train", *TINY, "data=criteo_terabyte", f"data.root={tmp_path / 'root'}", "data.num_days=2",
                   f"train.output_dir={tmp_path / 'out'}")
    assert_user_error(run, str(labels), "is truncated")
    assert "[rank " not in run.err and not (tmp_path / "out").exists(), run  # no rank started
