"""Checks of a run's inputs in the launching process, before any rank starts: the data
files (headers only) and, on resume, the checkpoint to continue from.

Every failure is a :class:`~torchrec_proactive.app.errors.UserError` (one line, exit code 2)
that would otherwise come from the ranks after their start-up. Data checks need only NumPy;
the checkpoint check calls the checkpoint module's own readers.
"""

from __future__ import annotations

import logging
import tempfile
from pathlib import Path
from typing import Optional, Tuple

from ..config.schema import Config, DataConfig
from ..data.npy_files import (
    CriteoFormatError,
    check_array,
    check_torchrec_files,
    describe_missing,
    find_torchrec_files,
    torchrec_file_names,
)
from .errors import UserError

PREPROCESS_MANIFEST = "manifest.json"  # data.criteo's: our own preprocessing's output


def tsv_names(cfg: DataConfig) -> list:
    return ["train.txt"] if cfg.layout == "kaggle" else [f"day_{d}" for d in range(cfg.num_days)]


def missing_data_message(cfg: DataConfig) -> str:
    """Why ``data.root`` holds no usable Criteo data set, in config words."""
    root = Path(cfg.root)
    partial = describe_missing(root, cfg.layout, cfg.num_days)
    if partial is not None:
        return partial
    names = tsv_names(cfg)
    missing = [str(root / n) for n in names if not (root / n).is_file()]
    first, *rest = torchrec_file_names(cfg.layout, cfg.num_days)
    npy = f"{first}_{{dense,labels,sparse_contig_freq|sparse}}.npy" + (f" .. {rest[-1]}_*" if rest else "")
    return (f"data.root={cfg.root!r} is missing the Criteo files of data.source=criteo with data.layout="
            f"{cfg.layout!r}: needs {names[0]}{' .. ' + names[-1] if len(names) > 1 else ''}, missing "
            f"{missing[:3]}{' ...' if len(missing) > 3 else ''}, and no TorchRec-preprocessed files "
            f"({npy}) either. Put the decompressed Criteo files or TorchRec's npy files there, or use data=synthetic")


def check_data_files(cfg: DataConfig) -> None:
    """``data.source=criteo``: the arrays the ranks will open are whole and of TorchRec's
    dtypes, or the TSVs to preprocess are there. Synthetic data is made by rank 0."""
    if cfg.source != "criteo":
        return
    tsvs = all((Path(cfg.root) / n).is_file() for n in tsv_names(cfg))
    try:
        for where in ([cfg.preprocessed_dir] if cfg.preprocessed_dir else []) + [cfg.root]:
            if (Path(where) / PREPROCESS_MANIFEST).is_file() and tsvs:
                continue  # our own preprocessing output, checked against the TSVs on rank 0
            if cfg.multi_hot:
                for name in torchrec_file_names(cfg.layout, cfg.num_days):
                    for kind, columns in (("dense", 13), ("labels", 1)):
                        path = Path(where) / f"{name}_{kind}.npy"
                        if path.is_file():
                            check_array(path, kind, columns)
                continue  # rank 0 reports missing multi-hot files
            files = find_torchrec_files(where, cfg.layout, cfg.num_days)
            if files is not None:
                check_torchrec_files(files)
                return
    except CriteoFormatError as e:
        raise UserError(str(e)) from None
    if not tsvs and not cfg.multi_hot:
        raise UserError(missing_data_message(cfg))


# Sharding types that keep every table's columns whole (one column shard).
_WHOLE_COLUMNS = ("table_wise", "row_wise", "table_row_wise")


def planned_column_splits(sharding: str, world_size: int, dim: int) -> Optional[Tuple[Tuple[int, int], ...]]:
    """The column ranges ``sharding.type`` gives a table of ``dim`` columns on ``world_size``
    ranks (the app's plans, :mod:`torchrec_proactive.planning`: ``column_wise`` is TorchRec's
    even split over every rank), or ``None`` where only the plan knows (``auto``)."""
    if sharding in _WHOLE_COLUMNS:
        return ((0, dim),)
    if sharding == "column_wise" and world_size >= 1 and dim % world_size == 0:
        width = dim // world_size
        return tuple((i * width, (i + 1) * width) for i in range(world_size))
    return None


def check_resume(cfg: Config, world_size: Optional[int] = None) -> None:
    """``train.resume``: the checkpoint the ranks would load has a readable manifest, a config
    it may continue, numbers its run could have saved, and readable metadata - checked with
    the checkpoint module's own readers. With ``world_size`` (the ranks to be started) and an
    explicit ``sharding.type``, also that no table with row-wise optimizer state would be
    split into other column shards than saved. Anything other than a user error is left for
    the ranks to report."""
    from .rundir import checkpoint_dir, latest_checkpoint

    if not cfg.train.resume or not cfg.train.save_checkpoints:
        return
    path = latest_checkpoint(checkpoint_dir(cfg))
    if path is None:
        return
    from .checkpoint import Checkpointer, check_column_layout, read_metadata, row_wise_state_tables
    from .compose import flatten
    from .resume import refuse_changes
    from .saved_state import check_numbers

    # The whole check, checksums included (one more read of the checkpoint's bytes, here
    # before Hydra or any rank writes anything; the ranks verify again, each a share, since
    # a scheduler may start them without this process).
    reader = Checkpointer(checkpoint_dir(cfg), 0, 1, 0, logging.getLogger(__name__))
    try:
        manifest = reader.manifest(path)
        refuse_changes(manifest.get("config", {}), flatten(cfg), path)  # (cheap, and the likelier mistake)
        check_numbers(manifest, path)
        reader.verify(path)
        md = read_metadata(path)
        if world_size is not None:
            planned = {key: planned_column_splits(cfg.sharding.type, world_size, record.dim)
                       for key, record in row_wise_state_tables(md).items()}
            check_column_layout(path, manifest, md, planned,
                                f"sharding.type={cfg.sharding.type!r} on {world_size} rank(s)")
    except UserError:
        raise
    except Exception:  # not a mistake this check can name: the ranks report it as before
        return


def check_inputs(cfg: Config, world_size: Optional[int] = None) -> None:
    """Everything :mod:`.preflight` checks, in the order the ranks would meet it
    (``world_size``: the ranks to be started, where known)."""
    check_data_files(cfg.data)
    check_tier_dir(cfg)
    check_resume(cfg, world_size)


def check_tier_dir(cfg: Config) -> None:
    """``tier=ssd``: ``tier.dir`` can be created and written (the ranks put their tables'
    files in fresh sub-directories of it). ``@local_rank`` is checked for local rank 0."""
    if cfg.tier.kind != "ssd":
        return
    from ..integration.disk_tier import resolve_directory

    path = resolve_directory(cfg.tier.dir, local_rank=0)
    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path, prefix=".probe-"):
            pass
    except OSError as e:
        raise UserError(f"tier.dir={cfg.tier.dir!r} cannot hold the tables' files: {e.strerror or e} "
                        f"({e.filename or path}); give a writable directory on a local disk") from None
