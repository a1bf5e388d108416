"""Bad data gets one line naming the file, the line number, the field and the value (exit
code 2 from the CLI) and leaves nothing half-written; eval-split errors name the config
keys; preprocessing says what it does and when it reuses earlier output."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import List

import pytest

from tests.test_cli import TINY, assert_user_error, cli
from torchrec_proactive.app.data import check_split
from torchrec_proactive.app.errors import ConfigError
from torchrec_proactive.config.schema import DataConfig
from torchrec_proactive.data import SyntheticCriteoSpec, generate
from torchrec_proactive.data.criteo import CriteoFormatError, preprocess


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
