"""Composing ``conf/`` with Hydra's compose API into a typed :class:`Config`.

The compose API (not ``@hydra.main``) keeps Hydra out of the process: no working
directory change, no logging takeover, and it can run once per rank or several times in
one process (tests, ``compare``).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from dataclasses import asdict, fields, is_dataclass
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, get_type_hints

from hydra import compose, initialize_config_dir
from hydra.errors import HydraException, MissingConfigException, OverrideParseException
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from ..config.schema import GROUPS, Config, register
from .errors import ConfigError

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
        raise ConfigError(f"--config-dir={config_dir!r} is invalid: it has no {CONFIG_NAME}.yaml")
    raise ConfigError(
        f"cannot find the conf/ directory (looked next to the package and in {os.getcwd()}); "
        f"pass --config-dir or set {ENV_CONFIG_DIR}"
    )


def compose_config(overrides: Sequence[str] = (), config_dir: Optional[str] = None) -> Config:
    """Composes ``config.yaml`` with Hydra ``overrides`` and validates it into a :class:`Config`.

    Every mistake raises :class:`~torchrec_proactive.app.errors.ConfigError` (a
    ``ValueError``) with a one-line message naming the key, the value and the limit: unknown
    keys, groups and options, values of the wrong type, overrides Hydra cannot parse (the
    Hydra exception is its ``__cause__``), and values out of range (from the schema).
    """
    register()
    # `experiment` is in the defaults list (as `experiment: null`), so the canonical form is
    # `experiment=name`; accept the `+experiment=name` habit from other Hydra projects too.
    overrides = [o[1:] if o.startswith("+experiment=") else o for o in overrides]
    try:
        with initialize_config_dir(config_dir=str(find_config_dir(config_dir)), version_base="1.3"):
            cfg = compose(CONFIG_NAME, overrides=list(overrides))
    except HydraException as e:
        raise ConfigError(_explain(e)) from e
    _reject_unknown_keys(cfg, Config, "")
    try:
        return OmegaConf.to_object(cfg)  # type: ignore[return-value]  # runs every __post_init__
    except ValueError as e:  # the schema's range checks name field, value and limit already
        raise ConfigError(str(e)) from e


def _first_line(text: object) -> str:
    return str(text).strip().splitlines()[0] if str(text).strip() else ""


def _explain(e: HydraException) -> str:
    """One line for a Hydra composition error, in the words of this project's config."""
    cause = e.__cause__ or e.__context__
    message = str(e)
    if isinstance(e, MissingConfigException) and e.missing_cfg_file and "/" in e.missing_cfg_file:
        group, option = e.missing_cfg_file.rsplit("/", 1)
        return f"{group}={option} is not an option of group '{group}'; it has {sorted(e.options or [])}"
    if isinstance(e, OverrideParseException):
        return (f"cannot parse override {e.override!r}: {_first_line(e.message)} (Hydra's override grammar: "
                f"https://hydra.cc/docs/advanced/override_grammar/basic/)")
    unknown = re.match(r"Could not override '([^']+)'", message)
    if unknown:
        explained = unknown_key_message(unknown.group(1))
        if explained:
            return explained
    merging = re.match(r"Error merging override (.+)", _first_line(message))
    if merging and isinstance(cause, OmegaConfBaseException):
        key, _, value = merging.group(1).partition("=")
        full_key = getattr(cause, "full_key", None) or key
        reason = _first_line(cause)
        bad = re.match(r"Value '(.*)' (?:of type '\w+' could not be converted to (\w+)|is not a valid (\w+))",
                       reason)
        if bad:
            kind = (bad.group(2) or bad.group(3)).lower()
            article = "an" if kind[0] in "aeiou" else "a"
            hint = " (true or false)" if kind == "bool" else ""
            return f"{full_key}={bad.group(1)!r} is invalid: must be {article} {kind}{hint}"
        return f"{full_key}={value!r} is invalid: {reason}"
    detail = _first_line(cause) if cause is not None else ""
    return _first_line(message) + (f": {detail}" if detail and detail not in message else "")


def unknown_key_message(key: str) -> Optional[str]:
    """``"<key> is not a config key; '<parent>' has [...]"`` if the schema has no ``key``
    (dotted), else ``None``. The same words for ``key=v`` and ``+key=v``."""
    schema: Any = Config
    parts = key.split(".")
    for i, part in enumerate(parts):
        if schema is None or not is_dataclass(schema):
            return None  # below a leaf (a list, a dict-valued field): not ours to judge
        hints = get_type_hints(schema)
        if part not in hints:
            parent = ".".join(parts[:i])
            where = f"'{parent}'" if parent else "the top level"
            known = sorted(hints) + (["experiment"] if not parent else [])
            return f"{key} is not a config key; {where} has {known}"
        schema = hints[part]
    return None


def _reject_unknown_keys(node: Any, schema: type, prefix: str) -> None:
    """Hydra lets ``+key=value`` add keys even to typed nodes, and ``to_object`` then drops
    them silently; a key the schema does not know is a mistake, so say so."""
    known = {f.name: f.type for f in fields(schema)}
    for key in node.keys():
        name = f"{prefix}{key}"
        if key not in known:
            raise ConfigError(unknown_key_message(name) or f"{name} is not a config key")
        child_schema = OmegaConf.get_type(node, key) if OmegaConf.is_dict(node[key]) else None
        if child_schema is not None and is_dataclass(child_schema):
            _reject_unknown_keys(node[key], child_schema, f"{name}.")


def config_tree(config_dir: Optional[str] = None) -> Dict[str, List[str]]:
    """``{group: [option, ...]}`` of the config directory, ``experiment`` included (for
    ``--help``): the YAML files of each group's folder."""
    root = find_config_dir(config_dir)
    return {g: sorted(p.stem for p in (root / g).glob("*.yaml")) for g in [*GROUPS, "experiment"]}


def to_yaml(cfg: Config) -> str:
    """The config as YAML (what ``--cfg`` prints and each rank writes to ``config.yaml``)."""
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
