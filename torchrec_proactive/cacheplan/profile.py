"""A cache profile: each table's miss-ratio curve, measured on a sample of a run's batches.

The profile is a JSON file (``cache_profile.json``) with a *fingerprint* of what it was
measured on (the data files' names, sizes and modification times, the tables, the global
batch size, the depth, the sample): a later run reuses it while the fingerprint matches and
profiles again when anything in it changed.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any, Dict, Iterable, List, Mapping, Optional, Sequence, Tuple

import numpy as np
from torchrec import EmbeddingBagConfig, KeyedJaggedTensor

from .curve import MissRatioCurve, shard_steps

__all__ = ["table_ids", "profile_batches", "fingerprint", "save_profile", "load_profile", "PROFILE_FILE"]

PROFILE_FILE = "cache_profile.json"
# 2: curves carry pinned_ids; multi-rank profiles measure whole global batches (version 1's
# measured rank 0's share of each, so its floors were too low for runs on several ranks).
_VERSION = 2


def table_ids(kjt: KeyedJaggedTensor, tables: Sequence[EmbeddingBagConfig]) -> Dict[str, np.ndarray]:
    """The ids each table looks up in one batch (all of its features together)."""
    per_key = kjt.to_dict()
    out: Dict[str, np.ndarray] = {}
    for t in tables:
        parts = [per_key[f].values().numpy() for f in t.feature_names if f in per_key]
        out[t.name] = np.concatenate(parts).astype(np.int64) if parts else np.zeros(0, dtype=np.int64)
    return out


def profile_batches(kjts: Iterable[KeyedJaggedTensor], tables: Sequence[EmbeddingBagConfig], depth: int,
                    warmup: int = 0, row_wise_shards: int = 1) -> Dict[str, MissRatioCurve]:
    """Every table's curve over the given (global) batches' sparse features. With
    ``row_wise_shards=n > 1``: measured per row-wise shard (TorchRec's blocks of
    ``ceil(rows / n)`` rows) and combined, for plans that shard the tables row-wise."""
    steps: Dict[str, List[np.ndarray]] = {t.name: [] for t in tables}
    for kjt in kjts:
        for name, ids in table_ids(kjt, tables).items():
            steps[name].append(ids)
    if not all(steps.values()):
        raise ValueError("cache profile: no batches to profile")
    if row_wise_shards <= 1:
        return {t.name: MissRatioCurve.from_steps(steps[t.name], t.num_embeddings, depth=depth, warmup=warmup)
                for t in tables}
    out = {}
    for t in tables:
        block = -(-t.num_embeddings // row_wise_shards)
        bounds = [(lo, min(lo + block, t.num_embeddings)) for lo in range(0, t.num_embeddings, block)]
        out[t.name] = MissRatioCurve.combine_shards(
            [MissRatioCurve.from_steps(shard_steps(steps[t.name], lo, hi), hi - lo, depth=depth, warmup=warmup)
             for lo, hi in bounds])
    return out


def fingerprint(files: Sequence[Path], **what: Any) -> str:
    """A digest of the data files (name, size, modification time) and of ``what``."""
    h = hashlib.sha256()
    for f in sorted(Path(x) for x in files):
        st = f.stat()
        h.update(f"{f.resolve()}|{st.st_size}|{st.st_mtime_ns}\n".encode())
    h.update(json.dumps(what, sort_keys=True, default=str).encode())
    return h.hexdigest()[:32]


def save_profile(path: Path, curves: Mapping[str, MissRatioCurve], fp: str, meta: Optional[Dict[str, Any]] = None) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    doc = {"version": _VERSION, "fingerprint": fp, **(meta or {}),
           "tables": {name: {"expected_lookups": c.expected_lookups, "cacheability": c.cacheability,
                             "min_load_factor": c.min_load_factor, "min_slots": c.pinned_rows,
                             "min_slots_device_planner": max(c.pinned_rows, c.pinned_ids), "curve": c.to_dict()}
                      for name, c in curves.items()}}
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(doc, indent=1))
    tmp.replace(path)  # readers never see half a profile
    return path


def load_profile(path: Path, fp: Optional[str] = None) -> Optional[Tuple[Dict[str, MissRatioCurve], Dict[str, Any]]]:
    """The curves saved at ``path`` and the rest of the document, or None when there is no
    profile there or (given ``fp``) it was measured on something else."""
    path = Path(path)
    if not path.is_file():
        return None
    try:
        doc = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"cache profile {path}: not JSON ({e.msg} at line {e.lineno}); delete it to profile again") from None
    if doc.get("version") != _VERSION or (fp is not None and doc.get("fingerprint") != fp):
        return None
    curves = {name: MissRatioCurve.from_dict(t["curve"]) for name, t in doc["tables"].items()}
    return curves, {k: v for k, v in doc.items() if k != "tables"}
