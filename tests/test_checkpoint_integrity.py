"""Checkpoints as a user (or a disk) leaves them: nothing wrong loads, nothing right is refused.

* every path a checkpoint names resolves inside it (DCP storage entries, ``LATEST``);
* damaged bytes are refused by per-file checksums, naming the file and the intact checkpoints;
* a broken manifest or ``.metadata`` is one :class:`CheckpointError` line (exit 2 at the CLI),
  never a traceback, and nothing is written (a deterministic fuzz over both files);
* what changes no saved state may change on resume, and is listed in the log;
* a resume across world sizes says what was done and what remains, in steps and samples.

One small 1-rank run (``ci_tiny``, 6 steps, checkpoints at 3 and 6) is made once; each test
works on a copy of it. Most checks call the trainer's resume checks and the checkpointer in
this process; a few run the CLI as a user does.
"""

from __future__ import annotations

import copy
import hashlib
import json
import logging
import pickle
import random
import shutil
from pathlib import Path
from typing import Any, Callable, Dict, List, Tuple

import pytest

from .test_cli import TINY, assert_user_error, cli, cli_here

pytestmark = pytest.mark.multiprocess  # the run it starts from is made by the CLI

RUN_ARGS = [*TINY, "train.checkpoint_every=3", "optimizer=adam"]


# ---------------------------------------------------------------------- the run and its copies
@pytest.fixture(scope="module")
def made(tmp_path_factory) -> Tuple[Path, Path]:
    """(data dir, run dir) of one finished 6-step run with checkpoints at steps 3 and 6."""
    root = tmp_path_factory.mktemp("made")
    run = cli("train", *RUN_ARGS, f"data.root={root / 'data'}", f"train.output_dir={root / 'run'}")
    assert run.rc == 0, run
    return root / "data", root / "run"


@pytest.fixture
def run_dir(made, tmp_path) -> Path:
    target = tmp_path / "run"
    shutil.copytree(made[1], target)
    return target


def _ckpt(run_dir: Path):
    from torchrec_proactive.app.checkpoint import Checkpointer

    return Checkpointer(run_dir / "checkpoints", rank=0, world_size=1, keep=2, log=logging.getLogger("test"))


def _cfg(made, run_dir: Path, *extra: str):
    from torchrec_proactive.app.compose import compose_config

    return compose_config([*RUN_ARGS, f"data.root={made[0]}", f"train.output_dir={run_dir}", "train.resume=true",
                           *extra])


def _resume_checks(made, run_dir: Path, path: Path = None) -> Dict[str, Any]:
    """What a resume reads, in this process: the trainer's checks, then every tensor and value."""
    from torchrec_proactive.app import loop

    ckpt = _ckpt(run_dir)
    path = path or ckpt.latest()
    if hasattr(loop, "check_resume"):
        loop.check_resume(ckpt, path, _cfg(made, run_dir))
        state = ckpt.load(path, None)
    else:  # (before the checks had a name: what Trainer.resume did)
        from torchrec_proactive.app.compose import flatten

        state = ckpt.load(path, flatten(_cfg(made, run_dir)))
        loop.Position(**state["position"])
    return state


def _snapshot(directory: Path) -> Dict[str, str]:
    return {str(p.relative_to(directory)): hashlib.md5(p.read_bytes()).hexdigest()
            for p in sorted(directory.rglob("*")) if p.is_file()}


def _reseal(step_dir: Path, manifest: Dict[str, Any] = None) -> None:
    """Records the files' present sizes and checksums in the manifest, and its own seal, as a
    save would: the damage then reaches the checks behind the checksums."""
    from torchrec_proactive.app import checkpoint as ck

    manifest = manifest if manifest is not None else json.loads((step_dir / "MANIFEST.json").read_text())
    if isinstance(manifest, dict) and isinstance(manifest.get("files"), dict):
        for name in list(manifest["files"]):
            if (step_dir / name).is_file():
                manifest["files"][name] = {"bytes": (step_dir / name).stat().st_size,
                                           "sha256": ck.file_digest(step_dir / name)}
    if isinstance(manifest, dict) and "seal" in manifest and hasattr(ck, "seal"):
        manifest["seal"] = ck.seal(manifest)
    (step_dir / "MANIFEST.json").write_text(json.dumps(manifest))


def _refused(call: Callable[[], Any], *fragments: str) -> str:
    from torchrec_proactive.app.errors import UserError

    with pytest.raises(UserError) as info:
        call()
    message = str(info.value)
    assert "\n" not in message and message, message
    for fragment in fragments:
        assert fragment in message, (fragment, message)
    return message


def _metadata(step_dir: Path):
    try:
        from torchrec_proactive.checkpoint import _MetadataUnpickler
    except ImportError:  # (before the reader moved to the public module)
        from torchrec_proactive.app.checkpoint import _MetadataUnpickler

    with open(step_dir / ".metadata", "rb") as fh:
        return _MetadataUnpickler(fh).load()


def _table_record(step_dir: Path) -> Tuple[str, int, int]:
    """(file, offset, length) of an embedding table's weights in the DCP shards."""
    md = _metadata(step_dir)
    for index, info in md.storage_data.items():
        if "embedding_bags" in index.fqn and index.fqn.endswith("weight") and info.length > 4096:
            return info.relative_path, info.offset, info.length
    raise AssertionError("no table record")


def _flip(file: Path, offset: int, n: int = 64) -> None:
    data = bytearray(file.read_bytes())
    for i in range(offset, offset + n):
        data[i] ^= 0xFF
    file.write_bytes(bytes(data))


# ---------------------------------------------------------------------- paths stay inside
@pytest.mark.parametrize("escape", ["absolute", "dotdot"])
def test_a_storage_entry_outside_its_checkpoint_is_refused(made, run_dir: Path, escape: str):
    step6, step3 = run_dir / "checkpoints" / "step_00000006", run_dir / "checkpoints" / "step_00000003"
    md = _metadata(step6)
    for info in md.storage_data.values():  # step 3's tensors, loaded as step 6's
        info.relative_path = (str((step3 / info.relative_path).resolve()) if escape == "absolute"
                              else f"../step_00000003/{info.relative_path}")
    (step6 / ".metadata").write_bytes(pickle.dumps(md))
    _reseal(step6)
    before = _snapshot(run_dir)
    _refused(lambda: _resume_checks(made, run_dir), "outside the checkpoint directory", "step_00000006")
    assert _snapshot(run_dir) == before


def test_latest_naming_a_directory_outside_is_refused_and_the_step_check_is_kept(made, run_dir: Path, tmp_path):
    from torchrec_proactive.app.errors import UserError

    elsewhere = tmp_path / "elsewhere"
    shutil.copytree(run_dir / "checkpoints" / "step_00000003", elsewhere)
    (run_dir / "checkpoints" / "LATEST").write_text(str(elsewhere))
    ckpt = _ckpt(run_dir)
    _refused(ckpt.latest, "LATEST", str(elsewhere), "step_<8 digits>")
    # a manifest read from outside the step directories is refused, whatever step it says
    manifest = json.loads((elsewhere / "MANIFEST.json").read_text())
    manifest["step"] = manifest["state"]["position"]["step"] = 6
    _reseal(elsewhere, manifest)
    with pytest.raises(UserError):
        ckpt.manifest(elsewhere)


# ---------------------------------------------------------------------- links
def test_a_latest_that_is_a_link_is_refused_not_followed(made, run_dir: Path, tmp_path):
    """LATEST is a file the save writes; a link to a file elsewhere (naming step 3, older than
    the step 6 this LATEST named) is refused, not followed."""
    outside = tmp_path / "latest_elsewhere"
    outside.write_text("step_00000003")
    latest = run_dir / "checkpoints" / "LATEST"
    latest.unlink()
    latest.symlink_to(outside)
    _refused(_ckpt(run_dir).latest, "LATEST", "symbolic link", str(outside))


def test_a_latest_link_at_the_cli_is_one_line_exit_2(made, run_dir: Path, tmp_path):
    outside = tmp_path / "latest_elsewhere"
    outside.write_text("step_00000003")
    latest = run_dir / "checkpoints" / "LATEST"
    latest.unlink()
    latest.symlink_to(outside)
    before = {k: v for k, v in _snapshot(run_dir).items() if not k.endswith(".log")}
    run = cli_here("train", *RUN_ARGS, "train.max_steps=8", f"data.root={made[0]}", f"train.output_dir={run_dir}",
                   "train.resume=true")
    assert_user_error(run, "LATEST", "symbolic link")
    assert {k: v for k, v in _snapshot(run_dir).items() if not k.endswith(".log")} == before


@pytest.mark.parametrize("latest", ["names it", "missing"])
@pytest.mark.parametrize("where", ["outside", "inside"])
def test_a_linked_step_directory_is_refused_not_skipped(made, run_dir: Path, tmp_path, where: str, latest: str):
    """step_00000006 as a link to the directory moved elsewhere (or beside it): refused in one
    line naming it, never skipped for the older step 3."""
    checkpoints = run_dir / "checkpoints"
    step6 = checkpoints / "step_00000006"
    target = tmp_path / "moved" if where == "outside" else checkpoints / "moved_step_6"
    shutil.move(str(step6), str(target))
    step6.symlink_to(target, target_is_directory=True)
    if latest == "missing":
        (checkpoints / "LATEST").unlink()
    _refused(_ckpt(run_dir).latest, "step_00000006", "symbolic link", "step_00000003")


def test_a_linked_checkpoints_directory_resumes_and_saves_through_the_link(made, run_dir: Path, tmp_path):
    """checkpoints/ as a whole on another disk, linked: a legitimate set-up. The resume reads
    through the link and the new checkpoints land behind it."""
    disk = tmp_path / "big_disk"
    disk.mkdir()
    shutil.move(str(run_dir / "checkpoints"), str(disk / "checkpoints"))
    (run_dir / "checkpoints").symlink_to(disk / "checkpoints", target_is_directory=True)
    assert _ckpt(run_dir).latest().name == "step_00000006"
    assert _resume_checks(made, run_dir)["position"]["step"] == 6
    run = cli("train", *RUN_ARGS, "train.max_steps=8", f"data.root={made[0]}", f"train.output_dir={run_dir}",
              "train.resume=true")
    assert run.rc == 0, run
    assert run.result()["steps"] == 8 and run.result()["resumed_from"].endswith("step_00000006"), run
    assert (run_dir / "checkpoints").is_symlink()
    assert (disk / "checkpoints" / "step_00000008" / "MANIFEST.json").is_file()
    assert (disk / "checkpoints" / "LATEST").read_text() == "step_00000008"


# ---------------------------------------------------------------------- numbers in the manifest
INT64_MAX = 2**63 - 1
HUGE = 10**30


def _set_position(field: str, value: int) -> Callable[[Dict[str, Any]], None]:
    def change(m: Dict[str, Any]) -> None:
        for position in (m["state"]["position"], m["position"]):
            position[field] = value
    return change


def _set_counter(value: int) -> Callable[[Dict[str, Any]], None]:
    def change(m: Dict[str, Any]) -> None:
        m["ranks"][0]["optimizer_step"] = value
    return change


# (change, the fragments the one line must hold: the field, the value, the limit). The made
# run: 1 rank, train.epochs=2, train.max_steps=6, 37 steps an epoch; step 6 is epoch 0, batch 6.
NUMBERS = {
    "batch_in_epoch huge": (_set_position("batch_in_epoch", HUGE), ["position.batch_in_epoch", str(HUGE),
                                                                    "position.step 6"]),
    "batch_in_epoch within int64": (_set_position("batch_in_epoch", 10**12), ["position.batch_in_epoch",
                                                                             str(10**12), "position.step 6"]),
    "epoch huge": (_set_position("epoch", HUGE), ["position.epoch", str(HUGE), "train.epochs=2"]),
    "epoch past the run's": (_set_position("epoch", 3), ["position.epoch", "3", "train.epochs=2"]),
    "the last epoch mid-way": (lambda m: (_set_position("epoch", 2)(m), _set_position("batch_in_epoch", 6)(m)),
                               ["position.batch_in_epoch", "train.epochs=2"]),
    "optimizer_step huge": (_set_counter(HUGE), ["optimizer_step", str(HUGE), str(INT64_MAX)]),
    "optimizer_step past int64": (_set_counter(INT64_MAX + 1), ["optimizer_step", str(INT64_MAX + 1),
                                                                str(INT64_MAX)]),
}


@pytest.mark.parametrize("case", list(NUMBERS))
def test_a_number_the_run_cannot_mean_is_refused_naming_the_field_and_the_limit(made, run_dir: Path, case: str):
    change, fragments = NUMBERS[case]
    _manifest_edit(run_dir / "checkpoints" / "step_00000006", change)
    before = _snapshot(run_dir)
    _refused(lambda: _resume_checks(made, run_dir), "step_00000006", *fragments)
    assert _snapshot(run_dir) == before


@pytest.mark.parametrize("case", ["epoch huge", "optimizer_step huge", "batch_in_epoch within int64"])
def test_a_number_the_run_cannot_mean_at_the_cli_is_one_line_exit_2(made, run_dir: Path, case: str):
    """Before the check: trained "epoch 1000000000000000000000000000000", or a traceback
    (OverflowError, StopIteration) and exit 1."""
    change, fragments = NUMBERS[case]
    _manifest_edit(run_dir / "checkpoints" / "step_00000006", change)
    before = {k: v for k, v in _snapshot(run_dir).items() if not k.endswith(".log")}
    run = cli_here("train", *RUN_ARGS, "train.max_steps=8", f"data.root={made[0]}", f"train.output_dir={run_dir}",
                   "train.resume=true")
    assert_user_error(run, "step_00000006", *fragments)
    assert {k: v for k, v in _snapshot(run_dir).items() if not k.endswith(".log")} == before


def test_the_numbers_of_an_untouched_checkpoint_pass(made, run_dir: Path):
    state = _resume_checks(made, run_dir)
    assert state["position"] == {"step": 6, "epoch": 0, "batch_in_epoch": 6}


# ---------------------------------------------------------------------- intact is not damaged
def test_a_checkpoint_that_does_not_fit_the_model_is_not_called_damaged(made, run_dir: Path):
    """Files that match their checksums and still do not load into the live model (here one
    dense tensor of another shape) are not damage: no "damaged", no advice to delete it."""
    import torch

    ckpt = _ckpt(run_dir)
    path = ckpt.latest()
    template = ckpt._whole_tensors(path, "cpu")
    model = template["model"]
    key = next(k for k, v in model.items() if isinstance(v, torch.Tensor) and v.dim() == 1 and "dense" in k)
    model[key] = torch.empty(model[key].numel() + 1)
    message = _refused(lambda: ckpt.load(path, None, template=template), "step_00000006", "checksums")
    assert "damaged" not in message and "delete" not in message, message


def test_adam_tables_pass_the_launch_check_for_column_wise(made, run_dir: Path):
    """Adam's state is per element: a column-wise resume on 2 ranks is not refused at launch
    (the 2-rank load itself is checked in test_resume_diagnosis)."""
    from torchrec_proactive.app.preflight import check_resume

    check_resume(_cfg(made, run_dir, "sharding.type=column_wise"), world_size=2)


# ---------------------------------------------------------------------- damaged bytes
def test_flipped_bytes_in_a_table_record_are_refused_naming_the_file_and_the_intact_ones(made, run_dir: Path):
    step6 = run_dir / "checkpoints" / "step_00000006"
    name, offset, length = _table_record(step6)
    _flip(step6 / name, offset + length // 2)
    before = _snapshot(run_dir)
    resumed = cli_here("train", *RUN_ARGS, "train.max_steps=8", f"data.root={made[0]}", f"train.output_dir={run_dir}",
                       "train.resume=true")
    assert_user_error(resumed, f"step_00000006/{name}", "checksum", "intact checkpoints", "step_00000003")
    now = _snapshot(run_dir)
    assert {k: v for k, v in now.items() if not k.endswith(".log")} == \
        {k: v for k, v in before.items() if not k.endswith(".log")}
    # the intact one still resumes
    shutil.rmtree(step6)
    (run_dir / "checkpoints" / "LATEST").unlink()
    assert _resume_checks(made, run_dir)["position"]["step"] == 3


# ---------------------------------------------------------------------- one line, never a traceback
def _set_metadata(step6: Path, change: Callable[[Any], Any]) -> None:
    md = _metadata(step6)
    md = change(md) or md
    (step6 / ".metadata").write_bytes(pickle.dumps(md))


def _as_list(md):
    md.state_dict_metadata = list(md.state_dict_metadata.items())


def _manifest_edit(step6: Path, change: Callable[[Dict[str, Any]], None]) -> None:
    manifest = json.loads((step6 / "MANIFEST.json").read_text())
    change(manifest)
    _reseal(step6, manifest)


def _bad_dtype(m):
    m["ranks"][0]["rng"]["torch"]["dtype"] = "Tensor"


def _extra_position_key(m):
    m["state"]["position"]["extra"] = 1


CASES = {
    "empty .metadata": lambda d: ((d / ".metadata").write_bytes(b""), _reseal(d)),
    "deleted .metadata": lambda d: ((d / ".metadata").unlink(), _reseal(d)),
    "state_dict_metadata as a list": lambda d: (_set_metadata(d, _as_list), _reseal(d)),
    "ranks: []": lambda d: _manifest_edit(d, lambda m: m.update(ranks=[])),
    "an extra key in the position": lambda d: _manifest_edit(d, _extra_position_key),
    "a bad dtype tag": lambda d: _manifest_edit(d, _bad_dtype),
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_broken_checkpoint_is_one_line_and_writes_nothing(made, run_dir: Path, case: str):
    CASES[case](run_dir / "checkpoints" / "step_00000006")
    before = _snapshot(run_dir)
    _refused(lambda: _resume_checks(made, run_dir), "step_00000006")
    assert _snapshot(run_dir) == before


def test_a_deleted_metadata_at_the_cli_is_one_line_exit_2(made, run_dir: Path):
    (run_dir / "checkpoints" / "step_00000006" / ".metadata").unlink()
    before = {k: v for k, v in _snapshot(run_dir).items() if not k.endswith(".log")}
    run = cli_here("train", *RUN_ARGS, "train.max_steps=8", f"data.root={made[0]}", f"train.output_dir={run_dir}",
                   "train.resume=true")
    assert_user_error(run, ".metadata", "step_00000006", "step_00000003")
    assert {k: v for k, v in _snapshot(run_dir).items() if not k.endswith(".log")} == before


# ---------------------------------------------------------------------- fuzz
def _paths(tree: Any, prefix: Tuple = ()) -> List[Tuple]:
    out = [prefix]
    if isinstance(tree, dict):
        for k, v in tree.items():
            out += _paths(v, prefix + (k,))
    elif isinstance(tree, list):
        for i, v in enumerate(tree):
            out += _paths(v, prefix + (i,))
    return out


def _retyped(value: Any, rng: random.Random) -> Any:
    choices = [None, "x", -1, 1.5, [], {}, [value], {"k": value}, True]
    return rng.choice([c for c in choices if type(c) is not type(value)])


def _mutate_tree(tree: Any, rng: random.Random) -> str:
    """One random structural change of a JSON-like tree, in place; says which."""
    paths = [p for p in _paths(tree) if p]
    path = rng.choice(paths)
    parent = tree
    for part in path[:-1]:
        parent = parent[part]
    kind = rng.choice(["retype", "drop", "add"])
    if kind == "retype":
        parent[path[-1]] = _retyped(parent[path[-1]], rng)
    elif kind == "drop":
        del parent[path[-1]]
    elif isinstance(parent, dict):
        parent[f"extra_{rng.randrange(100)}"] = rng.choice([0, "x", None, [1], {"a": 1}])
    else:
        parent.append(rng.choice([0, "x", None, {"a": 1}]))
    return f"{kind} {'.'.join(map(str, path))}"


def _mutate_bytes(data: bytes, rng: random.Random) -> Tuple[bytes, str]:
    if rng.random() < 0.4:
        cut = rng.randrange(len(data))
        return data[:cut], f"truncated at {cut}"
    out = bytearray(data)
    at = rng.randrange(len(out))
    for i in range(at, min(at + rng.choice([1, 4, 64]), len(out))):
        out[i] = rng.randrange(256)
    return bytes(out), f"bytes flipped at {at}"


def _mutate_metadata_objects(md: Any, rng: random.Random) -> str:
    """Retype, drop or add a field somewhere in DCP's metadata objects."""
    targets = [("md", md)]
    targets += [(f"tensor {k}", v) for k, v in list(md.state_dict_metadata.items())[:3]]
    targets += [(f"storage {k.fqn}", v) for k, v in list(md.storage_data.items())[:3]]
    name, obj = rng.choice(targets)
    field = rng.choice(sorted(vars(obj)))
    kind = rng.choice(["retype", "drop", "add"])
    if kind == "retype":
        setattr(obj, field, _retyped(getattr(obj, field), rng))
    elif kind == "drop":
        delattr(obj, field)
    else:
        setattr(obj, f"extra_{field}", 1)
    return f"{kind} {name}.{field}"


def _fuzz_case(seed: int, step6: Path) -> Tuple[str, bool]:
    """Damages step 6 (seeded); returns (what, whether the checksums were re-recorded)."""
    rng = random.Random(seed)
    target = rng.choice(["manifest", "metadata"])
    form = rng.choice(["bytes", "structure"])
    sealed = rng.random() < 0.6
    if target == "manifest":
        text = (step6 / "MANIFEST.json").read_text()
        if form == "bytes":
            data, what = _mutate_bytes(text.encode(), rng)
            (step6 / "MANIFEST.json").write_bytes(data)
            return f"manifest {what}", False
        manifest = json.loads(text)
        what = _mutate_tree(manifest, rng)
        if sealed:
            _reseal(step6, manifest)
        else:
            (step6 / "MANIFEST.json").write_text(json.dumps(manifest))
        return f"manifest {what}", sealed
    if form == "bytes":
        data, what = _mutate_bytes((step6 / ".metadata").read_bytes(), rng)
        (step6 / ".metadata").write_bytes(data)
    else:
        md = _metadata(step6)
        what = _mutate_metadata_objects(md, rng)
        (step6 / ".metadata").write_bytes(pickle.dumps(md))
    if sealed:
        _reseal(step6)
    return f".metadata {what}", sealed


def test_fuzzed_manifests_and_metadata_are_refused_in_one_line_and_write_nothing(made, tmp_path: Path):
    """60 seeded damages of step 6's manifest or ``.metadata`` (truncated, bytes flipped,
    values retyped, keys dropped or added), each on a fresh copy. Unsealed (the checksums as
    saved): every one is refused. Re-sealed (checksums recorded anew, as someone editing on
    purpose would): refused, or - where the change means nothing, e.g. an unknown extra key -
    read as saved. Never another exception; never a file changed."""
    from torchrec_proactive.app.errors import UserError

    pristine = tmp_path / "pristine"
    shutil.copytree(made[1], pristine)
    want = _resume_checks(made, pristine)
    outcomes = {"refused": 0, "read": 0}
    for seed in range(60):
        run_dir = tmp_path / f"case{seed}"
        shutil.copytree(pristine, run_dir)
        what, sealed = _fuzz_case(seed, run_dir / "checkpoints" / "step_00000006")
        before = _snapshot(run_dir)
        try:
            got = _resume_checks(made, run_dir, run_dir / "checkpoints" / "step_00000006")
        except UserError as e:
            assert "\n" not in str(e) and "step_00000006" in str(e), (seed, what, str(e))
            outcomes["refused"] += 1
        else:
            assert sealed, (seed, what, "an unsealed change was read")
            assert got["position"] == want["position"] and sorted(got) == sorted(want), (seed, what)
            outcomes["read"] += 1
        assert _snapshot(run_dir) == before, (seed, what)
        shutil.rmtree(run_dir)
    assert outcomes["refused"] >= 50, outcomes  # 59 of these 60 seeds


# ---------------------------------------------------------------------- what may change on resume
def test_changes_that_keep_the_saved_state_valid_are_allowed_and_listed(made, run_dir: Path):
    run = cli("train", *RUN_ARGS, "train.max_steps=8", f"data.root={made[0]}", f"train.output_dir={run_dir}",
              "train.resume=true", "optimizer.dense_lr=0.0003", "optimizer.embedding_lr=0.01",
              "cache.load_factor=0.5", "sharding.type=row_wise", "prefetch.depth=1", "link.latency_us=50")
    assert run.rc == 0, run
    assert run.result()["steps"] == 8, run
    line = next(line for line in run.err.splitlines() if "config changed since step_00000006" in line)
    for change in ("optimizer.dense_lr 0.001 -> 0.0003", "optimizer.embedding_lr", "cache.load_factor 0.2 -> 0.5",
                   "sharding.type 'table_wise' -> 'row_wise'", "prefetch.depth", "train.max_steps 6 -> 8",
                   "link.latency_us"):
        assert change in line, (change, line)


@pytest.mark.parametrize("key,value", [("model.over_arch_layer_sizes", "[32,1]"), ("optimizer.embedding", "adagrad"),
                                       ("optimizer.dense", "sgd"), ("train.batch_size", "32"),
                                       ("data.num_samples", "999")])
def test_changes_that_make_the_saved_state_wrong_are_refused_naming_the_key(key: str, value: str):
    from torchrec_proactive.app.compose import compose_config, flatten
    from torchrec_proactive.app.errors import ConfigError
    from torchrec_proactive.app.resume import refuse_changes

    saved = flatten(compose_config(["experiment=ci_tiny"]))
    now = flatten(compose_config(["experiment=ci_tiny", f"{key}={value}", "optimizer.dense_lr=0.5",
                                  "cache.load_factor=0.9", "sharding.type=row_wise"]))
    with pytest.raises(ConfigError, match=rf"{key}: checkpoint .* vs now") as info:
        refuse_changes(saved, now, "ckpt")
    assert "dense_lr" not in str(info.value) and "load_factor" not in str(info.value)


def test_the_learning_rate_of_a_resumed_run_is_its_own():
    from torchrec_proactive.app.checkpoint import restore_param_groups

    current = [{"params": ["a"], "lr": 0.001, "eps": 1e-8}]
    saved = [[{"params": ["a"], "lr": 0.05, "eps": 1e-8, "initial_accumulator_value": 0.1}]]
    assert restore_param_groups(current, saved, keep=("lr",)) == \
        [{"params": ["a"], "lr": 0.001, "eps": 1e-8, "initial_accumulator_value": 0.1}]


# ---------------------------------------------------------------------- progress in steps and samples
def test_a_two_rank_run_resumed_on_one_rank_says_what_was_done_and_what_remains(tmp_path: Path):
    data, out = tmp_path / "data", tmp_path / "run"
    args = ["experiment=ci_tiny", "train.eval_max_batches=2", f"data.root={data}", f"train.output_dir={out}"]
    first = cli("train", "--nproc", "2", *args, "train.max_steps=10")
    assert first.rc == 0, first
    batch = json.loads((out / "checkpoints" / "step_00000010" / "MANIFEST.json").read_text())["config"][
        "train.batch_size"]
    done = 10 * 2 * batch
    # 10 steps of 2 ranks are 20 steps of 1: train.max_steps=20 on 1 rank is done
    same = cli("train", "--nproc", "1", *args, "train.max_steps=20", "train.resume=true")
    assert same.rc == 0, same
    line = next(line for line in same.err.splitlines() if "already finished" in line)
    for words in (f"10 step(s) on 2 rank(s) x {batch} samples = {done} samples", "step 20 on 1 rank(s)",
                  f"train.max_steps=20: {done} samples", "0 steps = 0 samples remain"):
        assert words in line, (words, line)
    # train.max_steps=30 on 1 rank: 10 steps of 1 rank remain, and they are trained
    more = cli("train", "--nproc", "1", *args, "train.max_steps=30", "train.resume=true")
    assert more.rc == 0, more
    line = next(line for line in more.err.splitlines() if "resumed from" in line)
    assert f"10 steps = {10 * batch} samples remain" in line, line
    assert more.result()["steps"] == 30 and not more.result()["already_finished"]
    # on 2 ranks, a damaged shard of the latest is refused by every rank alike (each hashed a
    # share of the files): one line, exit 2, no rank left waiting
    latest = out / "checkpoints" / (out / "checkpoints" / "LATEST").read_text()
    name, offset, length = _table_record(latest)
    _flip(latest / name, offset + length // 2)
    damaged = cli("train", "--nproc", "2", *args, "train.max_steps=40", "train.resume=true")
    assert_user_error(damaged, f"{latest.name}/{name}", "checksum", "intact checkpoints")


def test_a_checkpoint_at_the_end_of_an_epoch_on_more_ranks_resumes_in_the_next_epoch(tmp_path: Path):
    """720 training rows of 64: 11 batches an epoch on 1 rank, 5 on 2. Step 10 of 1 rank is
    all 5 steps of epoch 0 on 2 ranks: the resume continues at epoch 1 (before: "the training
    loader yielded 0 of 1 batches expected (epoch 0, batch 5)", exit 1)."""
    data, out = tmp_path / "data", tmp_path / "run"
    args = ["experiment=ci_tiny", "data.num_samples=900", "train.eval_max_batches=2", f"data.root={data}",
            f"train.output_dir={out}"]
    first = cli("train", "--nproc", "1", *args, "train.max_steps=10")
    assert first.rc == 0, first
    position = json.loads((out / "checkpoints" / "step_00000010" / "MANIFEST.json").read_text())["position"]
    assert position == {"step": 10, "epoch": 0, "batch_in_epoch": 10}
    more = cli("train", "--nproc", "2", *args, "train.resume=true")
    assert more.rc == 0, more
    assert "at step 5 (epoch 1, batch 0)" in more.err, more
    assert more.result()["steps"] == 10 and not more.result()["already_finished"]


def test_a_forged_position_past_the_epochs_batches_is_refused_at_the_cli(made, run_dir: Path):
    """A consistent, re-sealed manifest at epoch 0 with no train.max_steps in its config: only
    the data bounds its position (37 batches an epoch on 1 rank). One line, exit 2, naming the
    field and the limit; before: a RuntimeError from the loop, exit 1."""
    def change(m: Dict[str, Any]) -> None:
        _set_position("step", 37)(m)
        _set_position("batch_in_epoch", 37)(m)
        m["step"] = 37
        m["config"]["train.max_steps"] = None

    checkpoints = run_dir / "checkpoints"
    forged = (checkpoints / "step_00000006").rename(checkpoints / "step_00000037")
    (checkpoints / "LATEST").write_text(forged.name)
    _manifest_edit(forged, change)
    run = cli("train", *RUN_ARGS, "train.max_steps=null", f"data.root={made[0]}", f"train.output_dir={run_dir}",
              "train.resume=true")
    assert_user_error(run, "step_00000037", "position.batch_in_epoch is 37", "37 batches")


def test_progress_is_described_in_steps_and_samples():
    from torchrec_proactive.app.resume import describe_progress

    text = describe_progress("step_00000010", 10, 2, 20, 1, 25, 16, "train.max_steps=25")
    assert text == ("step_00000010 holds 10 step(s) on 2 rank(s) x 16 samples = 320 samples = step 20 on 1 rank(s); "
                    "this run has 25 steps of 16 samples (train.max_steps=25: 400 samples): 5 steps = 80 samples "
                    "remain")


def test_a_manifest_that_is_a_link_is_refused_not_followed(made, run_dir: Path, tmp_path):
    """The manifest is the file the save writes last; a link to one elsewhere (however
    well sealed) is refused in one line, as DCP's files are."""
    step6 = run_dir / "checkpoints" / "step_00000006"
    outside = tmp_path / "manifest_elsewhere.json"
    shutil.copy(step6 / "MANIFEST.json", outside)
    (step6 / "MANIFEST.json").unlink()
    (step6 / "MANIFEST.json").symlink_to(outside)
    _refused(lambda: _ckpt(run_dir).manifest(step6), "MANIFEST.json", "symbolic link")


def test_a_data_file_linked_outside_is_named_once_and_not_called_damaged(made, run_dir: Path, tmp_path):
    """A DCP file moved out and linked back: the refusal names the file once, the whole
    checkpoint directory, and says to put the file back - not to delete an intact checkpoint."""
    step6 = run_dir / "checkpoints" / "step_00000006"
    data = sorted(step6.glob("*.distcp"))[0]
    outside = tmp_path / "moved.distcp"
    shutil.move(str(data), str(outside))
    data.symlink_to(outside)
    message = _refused(lambda: _ckpt(run_dir).verify(step6), data.name, str(step6), "links outside")
    assert message.count(data.name) == 1 and "damaged" not in message and "delete" not in message, message
