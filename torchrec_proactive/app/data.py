"""Data for a run: generate (synthetic) and preprocess once on rank 0, then load per rank."""

from __future__ import annotations

import json
import logging
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, List

import torch.distributed as dist

from ..config.schema import DataConfig
from ..data import SyntheticCriteoSpec, generate
from ..data.criteo import PreprocessedCriteo, make_dataloaders, preprocess

_SPEC_STAMP = "spec.json"


def synthetic_spec(cfg: DataConfig) -> SyntheticCriteoSpec:
    return SyntheticCriteoSpec(
        layout=cfg.layout, num_samples=cfg.num_samples, cardinality_scale=cfg.cardinality_scale,
        max_cardinality=cfg.max_cardinality, zipf_alpha=cfg.zipf_alpha, seed=cfg.seed,
        num_files=1 if cfg.layout == "kaggle" else cfg.num_days,
    )


def dataset_dir(cfg: DataConfig) -> Path:
    """``criteo``: ``root``. ``synthetic``: a subdirectory of ``root`` named after the spec,
    so two specs never share files."""
    if cfg.source == "criteo":
        return Path(cfg.root)
    tag = (f"{cfg.layout}_n{cfg.num_samples}_x{cfg.cardinality_scale:g}_max{cfg.max_cardinality}"
           f"_z{cfg.zipf_alpha:g}_s{cfg.seed}")
    if cfg.layout == "terabyte":
        tag += f"_d{cfg.num_days}"
    return Path(cfg.root) / tag


def _generate_if_needed(cfg: DataConfig, log: logging.Logger, progress: bool) -> List[Path]:
    """Generates the synthetic TSV files unless a complete set for the same spec exists
    (the spec stamp is written after the files, so a partial set is regenerated)."""
    spec = synthetic_spec(cfg)
    raw = dataset_dir(cfg) / "raw"
    stamp = raw / _SPEC_STAMP
    want = json.dumps(asdict(spec), sort_keys=True)
    paths = [raw / n for n in spec.file_names()]
    if stamp.is_file() and stamp.read_text() == want and all(p.is_file() for p in paths):
        return paths
    log.info("generating synthetic Criteo data (%d rows, %s layout) in %s", spec.num_samples, spec.layout, raw)
    paths = generate(spec, raw, progress=progress)
    stamp.write_text(want)
    return paths


def _criteo_files(cfg: DataConfig) -> List[Path]:
    root = Path(cfg.root)
    names = ["train.txt"] if cfg.layout == "kaggle" else [f"day_{d}" for d in range(cfg.num_days)]
    files = [root / n for n in names]
    missing = [str(f) for f in files if not f.is_file()]
    if missing:
        raise FileNotFoundError(
            f"data.source=criteo with layout {cfg.layout!r} needs {names[0]}"
            f"{' .. ' + names[-1] if len(names) > 1 else ''} in data.root={cfg.root!r}; missing: "
            f"{missing[:3]}{' ...' if len(missing) > 3 else ''}. Download and decompress the "
            f"Criteo files there, or use data=synthetic"
        )
    return files


def prepare(cfg: DataConfig, log: logging.Logger, progress: bool = False) -> PreprocessedCriteo:
    """Rank 0 generates (synthetic) and preprocesses; every rank gets the result."""
    box: List[Any] = [None]
    error: List[Any] = [None]
    if dist.get_rank() == 0:
        try:
            tsv = _generate_if_needed(cfg, log, progress) if cfg.source == "synthetic" else _criteo_files(cfg)
            out = Path(cfg.preprocessed_dir) if cfg.preprocessed_dir else dataset_dir(cfg) / "preprocessed"
            box[0] = preprocess(tsv, out, progress=progress, frequency_threshold=cfg.frequency_threshold)
        except Exception as e:  # every rank must fail, not hang in the broadcast
            error[0] = f"{type(e).__name__}: {e}"
    dist.broadcast_object_list(error, src=0)
    if error[0] is not None:
        raise RuntimeError(f"data preparation failed on rank 0: {error[0]}")
    dist.broadcast_object_list(box, src=0)
    return box[0]


@dataclass
class Loaders:
    train: Any
    eval: Any
    cardinalities: List[int]

    @property
    def steps_per_epoch(self) -> int:
        return len(self.train)


def loaders(pre: PreprocessedCriteo, cfg: DataConfig, batch_size: int) -> Loaders:
    train, evaluation = make_dataloaders(
        pre, batch_size, dist.get_rank(), dist.get_world_size(), eval_fraction=cfg.eval_fraction,
        shuffle_batches=cfg.shuffle_batches,
    )
    return Loaders(train, evaluation, list(pre.cardinalities))
