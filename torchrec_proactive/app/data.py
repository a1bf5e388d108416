"""Data for a run: generate (synthetic) and preprocess once on rank 0, then load per rank."""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, List, Optional, Sequence

import torch.distributed as dist

from ..config.schema import DataConfig
from ..data import SyntheticCriteoSpec, generate, read_generated
from ..data.criteo import (
    PREPROCESS_MANIFEST,
    CriteoFormatError,
    PreprocessedCriteo,
    batch_counts,
    make_dataloaders,
    open_torchrec_binary,
    preprocess,
    split_rows,
    torchrec_file_names,
)
from ..data.criteo_synth import spec_json
from ..data.history import HistoryLoader, HistorySpec
from .preflight import missing_data_message
from .errors import ConfigError, PeerFailure, UserError


# For a second run on the same data (compare): its preparation says nothing new.
QUIET = logging.getLogger("torchrec_proactive.data.quiet")
QUIET.addHandler(logging.NullHandler())
QUIET.propagate = False


def synthetic_spec(cfg: DataConfig) -> SyntheticCriteoSpec:
    return SyntheticCriteoSpec(
        layout=cfg.layout, num_samples=cfg.num_samples, cardinality_scale=cfg.cardinality_scale,
        max_cardinality=cfg.max_cardinality, zipf_alpha=cfg.zipf_alpha, seed=cfg.seed,
        num_files=1 if cfg.layout == "kaggle" else cfg.num_days,
    )


def dataset_dir(cfg: DataConfig) -> Path:
    """``criteo``: ``root``. ``synthetic``: ``root`` itself when it holds a data set written
    by ``torchrec-proactive gen-data --out-dir <root>``, else a subdirectory of ``root``
    named after the spec (generated on first use), so two specs never share files."""
    if cfg.source == "criteo" or read_generated(cfg.root) is not None:
        return Path(cfg.root)
    tag = (f"{cfg.layout}_n{cfg.num_samples}_x{cfg.cardinality_scale:g}_max{cfg.max_cardinality}"
           f"_z{cfg.zipf_alpha:g}_s{cfg.seed}")
    if cfg.layout == "terabyte":
        tag += f"_d{cfg.num_days}"
    return Path(cfg.root) / tag


def _synthetic_files(cfg: DataConfig, log: logging.Logger, progress: bool) -> List[Path]:
    """The TSV files of a synthetic run: ``gen-data``'s in ``data.root`` if it wrote a data
    set there, else this spec's own, generated unless a complete set exists (the spec stamp
    is written after the files, so a partial set is regenerated)."""
    given = read_generated(cfg.root)
    if given is not None:
        spec, paths = given
        # The generator fields of data.* describe data that train would make; say that
        # gen-data's own spec wins, so a mismatch is visible in the log.
        log.info("data.root=%s holds a data set written by gen-data (%d rows, %s layout, seed %d): using it; "
                 "data.num_samples and the other generator fields apply only to data train generates",
                 cfg.root, spec.num_samples, spec.layout, spec.seed)
        return paths
    real = [name for name in ("train.txt", "day_0", "train_sparse.npy", "day_0_sparse.npy",
                              "day_0_sparse_multi_hot.npz") if (Path(cfg.root) / name).exists()]
    if real:
        log.warning("data=synthetic generates its own data: the Criteo files in data.root=%s (%s) are not used; "
                    "to train on them choose data=criteo_kaggle or data=criteo_terabyte", cfg.root, ", ".join(real))
    spec = synthetic_spec(cfg)
    raw = dataset_dir(cfg) / "raw"
    found = read_generated(raw)
    if found is not None and spec_json(found[0]) == spec_json(spec):
        log.info("data: reusing the synthetic data set generated earlier for this spec in %s", raw)
        return found[1]
    log.info("generating synthetic Criteo data (%d rows, %s layout) in %s", spec.num_samples, spec.layout, raw)
    return generate(spec, raw, progress=progress)


def _criteo_files(cfg: DataConfig) -> List[Path]:
    root = Path(cfg.root)
    names = ["train.txt"] if cfg.layout == "kaggle" else [f"day_{d}" for d in range(cfg.num_days)]
    files = [root / n for n in names]
    if not all(f.is_file() for f in files):
        raise UserError(missing_data_message(cfg))
    return files


def _tsvs_present(cfg: DataConfig) -> bool:
    names = ["train.txt"] if cfg.layout == "kaggle" else [f"day_{d}" for d in range(cfg.num_days)]
    return all((Path(cfg.root) / n).is_file() for n in names)


def _torchrec_binary(cfg: DataConfig, log: logging.Logger) -> Optional[PreprocessedCriteo]:
    """``data.source=criteo``: TorchRec-preprocessed files in ``data.preprocessed_dir`` or
    ``data.root``, used in place; ``None`` when neither holds a complete set."""
    if cfg.source != "criteo":
        return None
    for where in ([cfg.preprocessed_dir] if cfg.preprocessed_dir else []) + [cfg.root]:
        if (Path(where) / PREPROCESS_MANIFEST).is_file() and _tsvs_present(cfg):
            continue  # our own preprocessing output: preprocess() checks it is fresh for the TSVs
        found = open_torchrec_binary(where, cfg.layout, cfg.num_days, log=log, multi_hot=cfg.multi_hot)
        if found is not None:
            if cfg.multi_hot and list(found.multi_hot_sizes or ()) != list(cfg.multi_hot_sizes or ()):
                raise ConfigError(f"data.multi_hot_sizes={list(cfg.multi_hot_sizes or ())} is invalid: the files in "
                                  f"{where} have {list(found.multi_hot_sizes or ())} ids per sample")
            return found
    if cfg.multi_hot:
        raise UserError(f"data.root={cfg.root!r} is missing MLPerf DLRM-v2's multi-hot files of data.multi_hot=true: "
                        f"needs day_{{0..{cfg.num_days - 1}}}_sparse_multi_hot.npz with day_{{i}}_dense.npy and "
                        f"day_{{i}}_labels.npy")
    return None


def prepare_here(cfg: DataConfig, log: logging.Logger, progress: bool = False) -> PreprocessedCriteo:
    """:func:`prepare` in this process alone, outside any process group (the launcher's
    checks, before the ranks start: they then reuse what it made)."""
    return _prepare_here(cfg, log, progress)


def _prepare_here(cfg: DataConfig, log: logging.Logger, progress: bool) -> PreprocessedCriteo:
    try:
        binary = _torchrec_binary(cfg, log)
        if binary is not None:
            return binary
        tsv = _synthetic_files(cfg, log, progress) if cfg.source == "synthetic" else _criteo_files(cfg)
        out = Path(cfg.preprocessed_dir) if cfg.preprocessed_dir else dataset_dir(cfg) / "preprocessed"
        return preprocess(tsv, out, progress=progress, frequency_threshold=cfg.frequency_threshold, log=log)
    except CriteoFormatError as e:  # file, line, field and value: the user's to fix
        raise UserError(str(e)) from e
    except OSError as e:
        # A directory that cannot be created or written (a file in the way, no permission,
        # a read-only mount) is the user's to fix: name the keys that choose the paths.
        where = f"data.preprocessed_dir={cfg.preprocessed_dir!r}" if cfg.preprocessed_dir else ""
        keys = f"data.root={cfg.root!r}" + (f" or {where}" if where else "")
        raise UserError(f"{keys} cannot be used: {e.strerror or e} ({e.filename})" if e.filename
                        else f"{keys} cannot be used: {e}") from e


def prepare(cfg: DataConfig, log: logging.Logger, progress: bool = False) -> PreprocessedCriteo:
    """Rank 0 generates (synthetic) and preprocesses; every rank gets the result.

    If rank 0 fails, it raises its own error and every other rank raises
    :class:`PeerFailure` naming rank 0 (so a launch reports rank 0's error, not a waiter's).
    """
    box: List[Any] = [None]
    error: List[Any] = [None]
    failure: Optional[BaseException] = None
    if dist.get_rank() == 0:
        try:
            box[0] = _prepare_here(cfg, log, progress)
        except Exception as e:  # every rank must fail, not hang in the broadcast
            failure = e
            error[0] = (f"{type(e).__name__}: {e}", str(e) if isinstance(e, UserError) else None)
    dist.broadcast_object_list(error, src=0)
    if failure is not None:
        raise failure
    if error[0] is not None:
        text, user_message = error[0]
        raise PeerFailure(f"rank 0 failed to prepare the data: {text}", origin_rank=0, user_message=user_message)
    dist.broadcast_object_list(box, src=0)
    return box[0]


@dataclass
class Loaders:
    train: Any
    eval: Any
    cardinalities: List[int]
    train_rows: Optional[int] = None  # rows of the training split (all ranks)
    batch_size: Optional[int] = None

    @property
    def steps_per_epoch(self) -> int:
        return len(self.train)

    def steps_per_epoch_on(self, world_size: int) -> Optional[int]:
        """The steps of an epoch of this data on ``world_size`` ranks (as the loaders cut it:
        whole rounds of ``world_size`` batches), or None where the split is not known."""
        if self.train_rows is None or not self.batch_size:
            return None
        return batch_counts(self.train_rows, self.batch_size, world_size, drop_last=True)[0] // world_size


def check_split(num_samples: List[int], cfg: DataConfig, batch_size: int, world_size: int) -> None:
    """Raises :class:`ConfigError` naming the config keys when the training or evaluation
    split would give some rank no batch (fewer rows than ``batch_size * world_size``)."""
    train, evaluation = split_rows(num_samples, cfg.eval_fraction)
    total = sum(num_samples)
    need = batch_size * world_size
    for split, parts in (("training", train), ("evaluation", evaluation)):
        rows = sum(p.stop - p.start for p in parts)
        if rows < need:
            fix = ("raise data.eval_fraction" if split == "evaluation" else "lower data.eval_fraction")
            raise ConfigError(
                f"data.eval_fraction={cfg.eval_fraction:g} leaves {rows} {split} rows of {total}, fewer than "
                f"train.batch_size={batch_size} x {world_size} rank(s) = {need}: {fix}, lower train.batch_size "
                f"or use more data (data.num_samples for synthetic data)")


def hash_to_tables(pre: PreprocessedCriteo, table_rows: Optional[Sequence[int]],
                   log: logging.Logger) -> PreprocessedCriteo:
    """``pre`` with its ids taken modulo ``table_rows`` (``model.num_embeddings_per_feature``)
    where the tables would not hold them, as TorchRec's ``dlrm_main`` does (it passes its
    table sizes as the pipe's ``hashes``); says so once in ``log``. Raw hashes are always
    taken modulo the tables when sizes are set; contiguous ids only when a table is smaller
    than its ids need. Invariant on return: every id is < its table's rows."""
    if table_rows is None or pre.multi_hot_sizes is not None:  # MLPerf's multi-hot ids are hashed already
        return pre
    rows = tuple(int(r) for r in table_rows)
    small = [f for f, (r, c) in enumerate(zip(rows, pre.cardinalities)) if r < c]
    if pre.hashes is None and not small:
        return pre
    if pre.hashes != rows:
        shown = ", ".join(f"cat_{f} {pre.cardinalities[f]} -> {rows[f]}" for f in small[:3])
        log.info("data: ids hashed modulo model.num_embeddings_per_feature, as TorchRec's dlrm_main does%s",
                 f" ({len(small)} table(s) smaller than their ids: {shown}{' ...' if len(small) > 3 else ''})"
                 if small else "")
    return replace(pre, hashes=rows, cardinalities=rows)


def loaders(pre: PreprocessedCriteo, cfg: DataConfig, batch_size: int) -> Loaders:
    check_split(list(pre.num_samples), cfg, batch_size, dist.get_world_size())
    train, evaluation = make_dataloaders(
        pre, batch_size, dist.get_rank(), dist.get_world_size(), eval_fraction=cfg.eval_fraction,
        shuffle_batches=cfg.shuffle_batches,
    )
    rows = sum(p.stop - p.start for p in split_rows(list(pre.num_samples), cfg.eval_fraction)[0])
    return Loaders(train, evaluation, list(pre.cardinalities), train_rows=rows, batch_size=batch_size)


def with_histories(data: Loaders, spec: HistorySpec) -> Loaders:
    """``data`` whose training and evaluation batches gain each sample's history (the
    ``history`` key of their KJT, :mod:`torchrec_proactive.data.history`): a function of the
    sample alone, so resumes, ``compare`` and evaluation see the same history for it."""
    return replace(data, train=HistoryLoader(data.train, spec), eval=HistoryLoader(data.eval, spec))
