"""Run directories: one run per directory, and where its checkpoints are.

The default ``train.output_dir`` is new for every run (``outputs/<date>/<time>``, the
pattern of Hydra's run directories). A directory that already holds a run - a complete
checkpoint, or a rank's metrics - is refused unless ``train.resume=true``: a fresh run
there would overwrite its checkpoints and append to its logs.

Needs neither torch nor TorchRec, so the CLI checks before it starts any rank.
"""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional

from ..config.schema import Config
from .errors import CheckpointError, UserError

MANIFEST = "MANIFEST.json"
LATEST = "LATEST"
STEP_DIR = re.compile(r"step_\d{8}")  # a checkpoint's directory name (the step, zero-padded)
# Set by the Hydra app for the ranks it launches: Hydra's job log (<run dir>/<mode>.log),
# where rank 0's log goes too.
JOB_LOG_ENV = "TORCHREC_PROACTIVE_JOB_LOG"


# Each launch's record in its run directory: <run dir>/launches/<n>/ (001 the first launch,
# then one per resume). Hydra's .hydra/ is overwritten by every launch into the directory.
LAUNCHES = "launches"


def record_launch(run_dir: Path, files: Mapping[str, str]) -> Path:
    """Writes ``files`` (name -> text) as the next launch record of ``run_dir``
    (``launches/001``, ``launches/002``, ...) and returns its directory."""
    root = Path(run_dir) / LAUNCHES
    root.mkdir(parents=True, exist_ok=True)
    n = 1 + max((int(p.name) for p in root.iterdir() if p.name.isdigit()), default=0)
    while True:
        target = root / f"{n:03d}"
        try:
            target.mkdir()
            break
        except FileExistsError:  # (another launch took the number)
            n += 1
    for name, text in files.items():
        (target / name).write_text(text)
    return target


def hydra_record(directory: Path) -> Dict[str, str]:
    """The YAML files of a Hydra record (``.hydra/``), by name; empty if there is none."""
    directory = Path(directory)
    return {p.name: p.read_text() for p in sorted(directory.glob("*.yaml"))} if directory.is_dir() else {}


def checkpoint_dir(cfg: Config) -> Path:
    """``train.checkpoint_dir``, else ``<train.output_dir>/checkpoints``."""
    return Path(cfg.train.checkpoint_dir or Path(cfg.train.output_dir) / "checkpoints")


def complete_checkpoints(directory: Path) -> List[Path]:
    """Complete checkpoints (``step_<8 digits>`` directories with a manifest, not links) in
    ``directory``, oldest first. (``directory`` itself may be a link, e.g. to a larger disk.)"""
    directory = Path(directory)
    if not directory.is_dir():
        return []
    return sorted(p for p in directory.glob("step_*")
                  if STEP_DIR.fullmatch(p.name) and not p.is_symlink() and (p / MANIFEST).is_file())


def _refuse_link(link: Path, older: Optional[Path]) -> CheckpointError:
    try:
        target = os.readlink(link)
    except OSError:
        target = "?"
    instead = f"delete the link to resume from {older.name}" if older is not None else \
        "delete the link to start from scratch"
    return CheckpointError(
        f"{link}: is a symbolic link (to {target}), not a checkpoint directory this program wrote; refusing to load "
        f"it, and not resuming from an older checkpoint in its place: move the directory it names here as "
        f"{link.name}, or {instead}"
    )


def latest_checkpoint(directory: Path) -> Optional[Path]:
    """The checkpoint ``LATEST`` names if complete, else the newest complete one, or ``None``.

    ``LATEST`` may name only a step directory of ``directory`` (a bare ``step_<8 digits>``);
    anything else - an absolute path, ``..``, another name - is refused (:class:`CheckpointError`):
    every path a checkpoint names resolves inside it. ``LATEST`` is a file the save writes:
    as a link it is refused, not followed. A step directory that is a link, where it would be
    loaded or is newer than the one that would, is refused too: never skipped for an older
    checkpoint. (The checkpoints directory itself may be a link.)"""
    directory = Path(directory)
    pointer = directory / LATEST
    complete = complete_checkpoints(directory)
    if pointer.is_symlink():
        try:
            target = os.readlink(pointer)
        except OSError:
            target = "?"
        raise CheckpointError(f"{pointer}: is a symbolic link (to {target}), not the file a save writes; refusing to "
                              f"follow it (delete it to resume from the newest complete checkpoint)")
    links = sorted(p for p in directory.glob("step_*") if STEP_DIR.fullmatch(p.name) and p.is_symlink()) \
        if directory.is_dir() else []
    if pointer.is_file():
        try:
            name = pointer.read_text().strip()
        except (OSError, UnicodeDecodeError) as e:
            raise CheckpointError(f"{pointer}: cannot be read ({e}); delete it to resume from the newest complete "
                                  f"checkpoint") from None
        if not STEP_DIR.fullmatch(name):
            raise CheckpointError(f"{pointer}: names {name[:120]!r}, not a step directory of {directory} "
                                  f"(step_<8 digits>); refusing to follow it (delete it to resume from the newest "
                                  f"complete checkpoint)")
        cand = directory / name
        if cand.is_symlink():
            raise _refuse_link(cand, complete[-1] if complete else None)
        if (cand / MANIFEST).is_file():
            newer = [p for p in links if p.name > cand.name]
            if newer:
                raise _refuse_link(newer[-1], cand)
            return cand
    # pointer missing or pointing at an incomplete save
    newest = complete[-1] if complete else None
    newer = [p for p in links if newest is None or p.name > newest.name]
    if newer:
        raise _refuse_link(newer[-1], newest)
    return newest


def previous_run(cfg: Config) -> Optional[str]:
    """What a previous run left in this run's directories (in words, for a message), or ``None``."""
    latest = latest_checkpoint(checkpoint_dir(cfg))
    if latest is not None:
        return f"a previous run (its latest checkpoint is step {int(latest.name.split('_')[-1])}, in {latest})"
    logs = sorted(Path(cfg.train.output_dir).glob("rank_*/metrics.jsonl"))
    if logs:
        return f"a previous run (its metrics: {logs[0]})"
    return None


def check_run_dir(cfg: Config) -> None:
    """Raises :class:`UserError` if a fresh run (``train.resume=false``) would start where a
    previous run left checkpoints or metrics.

    Collective inside a process group of several ranks (every rank fails together if any
    rank sees a previous run, e.g. on a node-local disk); outside one it only looks.
    """
    found = None if cfg.train.resume else previous_run(cfg)
    dist: Any = sys.modules.get("torch.distributed")  # never imported just for this
    if dist is not None and dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        seen: List[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(seen, found)
        found = next((s for s in seen if s is not None), None)
    if found is not None:
        raise UserError(
            f"train.output_dir={cfg.train.output_dir!r} holds {found}; pass train.resume=true to continue it, "
            f"or another train.output_dir (the default, outputs/<date>/<time>, is new for every run)"
        )
