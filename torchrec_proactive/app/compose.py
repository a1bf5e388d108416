"""Composing ``conf/`` with Hydra's compose API into a typed :class:`Config`.

The compose API (not ``@hydra.main``) keeps Hydra out of the process: no working
directory change, no logging takeover, and it can run once per rank or several times in
one process (tests, ``compare``).
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict, fields, is_dataclass
from pathlib import Path
from typing import Any, Dict, Optional, Sequence

from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from ..config.schema import Config, register

CONFIG_NAME = "config"
ENV_CONFIG_DIR = "TORCHREC_PROACTIVE_CONFIG_DIR"


def find_config_dir(config_dir: Optional[str] = None) -> Path:
    """``config_dir``, else ``$TORCHREC_PROACTIVE_CONFIG_DIR``, else the repository's
    ``conf/`` next to the package (editable installs, checkouts), else ``./conf``."""
    candidates = [config_dir, os.environ.get(ENV_CONFIG_DIR)]
    candidates += [str(Path(__file__).resolve().parents[2] / "conf"), "conf"]
    for c in candidates:
        if c and (Path(c) / f"{CONFIG_NAME}.yaml").is_file():
            return Path(c).resolve()
    if config_dir:
        raise FileNotFoundError(f"--config-dir {config_dir!r} has no {CONFIG_NAME}.yaml")
    raise FileNotFoundError(
        f"cannot find the conf/ directory (looked next to the package and in {os.getcwd()}); "
        f"pass --config-dir or set {ENV_CONFIG_DIR}"
    )


def compose_config(overrides: Sequence[str] = (), config_dir: Optional[str] = None) -> Config:
    """Composes ``config.yaml`` with Hydra ``overrides`` and validates it into a :class:`Config`.

    Raises Hydra's ``ConfigCompositionException`` for unknown keys, groups or options and
    for values of the wrong type, and ``ValueError`` (naming field, value and limit) for
    values out of range.
    """
    register()
    # `experiment` is in the defaults list (as `experiment: null`), so the canonical form is
    # `experiment=name`; accept the `+experiment=name` habit from other Hydra projects too.
    overrides = [o[1:] if o.startswith("+experiment=") else o for o in overrides]
    with initialize_config_dir(config_dir=str(find_config_dir(config_dir)), version_base="1.3"):
        cfg = compose(CONFIG_NAME, overrides=list(overrides))
    _reject_unknown_keys(cfg, Config, "")
    return OmegaConf.to_object(cfg)  # type: ignore[return-value]  # runs every __post_init__


def _reject_unknown_keys(node: Any, schema: type, prefix: str) -> None:
    """Hydra lets ``+key=value`` add keys even to typed nodes, and ``to_object`` then drops
    them silently; a key the schema does not know is a mistake, so say so."""
    known = {f.name: f.type for f in fields(schema)}
    for key in node.keys():
        name = f"{prefix}{key}"
        if key not in known:
            where = f"'{prefix[:-1]}'" if prefix else "the top level"
            raise ValueError(f"{name} is not a config key; {where} has {sorted(known)}")
        child_schema = OmegaConf.get_type(node, key) if OmegaConf.is_dict(node[key]) else None
        if child_schema is not None and is_dataclass(child_schema):
            _reject_unknown_keys(node[key], child_schema, f"{name}.")


def to_yaml(cfg: Config) -> str:
    return OmegaConf.to_yaml(OmegaConf.structured(cfg))


def flatten(cfg: Config) -> Dict[str, Any]:
    """``{"group.field": value}`` with JSON-friendly values (lists stay lists)."""
    out: Dict[str, Any] = {}

    def walk(prefix: str, node: Any) -> None:
        if isinstance(node, dict):
            for k, v in node.items():
                walk(f"{prefix}.{k}" if prefix else k, v)
        else:
            out[prefix] = node

    walk("", asdict(cfg))
    return out


def config_hash(cfg: Config) -> str:
    return hashlib.sha256(json.dumps(flatten(cfg), sort_keys=True).encode()).hexdigest()[:16]


def diff(a: Dict[str, Any], b: Dict[str, Any], keys: Optional[Sequence[str]] = None) -> Dict[str, Any]:
    """``{key: (a's value, b's value)}`` for keys whose values differ."""
    names = sorted(set(a) | set(b)) if keys is None else keys
    return {k: (a.get(k), b.get(k)) for k in names if a.get(k) != b.get(k)}
