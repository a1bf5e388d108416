"""Composing the packaged configs with Hydra's compose API into a typed :class:`Config`.

The CLI itself is a Hydra application (``hydra.main``, :mod:`.hydra_app`); the compose API
is what each rank, the example script and the tests use: no working directory change, no
logging takeover, and it can run once per rank or several times in one process. Both
search the same path: the packaged configs, then ``--config-dir``, then ``hydra.searchpath``.
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
from omegaconf import OmegaConf, open_dict
from omegaconf.errors import ConfigKeyError, OmegaConfBaseException

from ..config.schema import GROUPS, Config, register
from .errors import ConfigError

CONFIG_NAME = "config"
ENV_CONFIG_DIR = "TORCHREC_PROACTIVE_CONFIG_DIR"
# The schema's train.output_dir: "Hydra's run directory" unless a config or override sets it.
DEFAULT_OUTPUT_DIR = "outputs/${now:%Y-%m-%d}/${now:%H-%M-%S}"


def packaged_config_dir() -> Path:
    """The configs shipped inside the package (``torchrec_proactive/conf``).

    In a checkout it is a symlink to the repository's top-level ``conf/`` (the source of
    truth); a wheel build copies the files it points at into the package, so an installed
    package or a container image carries them without a checkout."""
    here = Path(__file__).resolve().parents[1] / "conf"
    if not (here / f"{CONFIG_NAME}.yaml").is_file():
        raise ConfigError(f"the packaged configs are missing: {here} has no {CONFIG_NAME}.yaml (a broken install?)")
    return here


def find_config_dir(config_dir: Optional[str] = None) -> Path:
    """The directory holding the primary ``config.yaml``: the packaged configs.

    ``config_dir`` is kept for callers of the old signature: an extra directory is never the
    primary one any more, it is *added* to Hydra's search path (see :func:`extra_config_dirs`)."""
    return packaged_config_dir()


def extra_config_dirs(config_dir: Optional[str] = None) -> List[Path]:
    """Directories added to Hydra's search path after the packaged configs, as Hydra's own
    ``--config-dir`` does: ``config_dir``, else ``$TORCHREC_PROACTIVE_CONFIG_DIR``. Each may
    hold only the files it adds (``experiment/my_run.yaml``)."""
    given = config_dir or os.environ.get(ENV_CONFIG_DIR)
    if not given:
        return []
    path = Path(given).expanduser()
    if not path.is_dir():
        key = "--config-dir" if config_dir else f"${ENV_CONFIG_DIR}"
        raise ConfigError(f"{key}={given!r} is invalid: no such directory")
    return [path.resolve()]


def _quote(text: str) -> str:
    """``text`` as a quoted value of Hydra's override grammar."""
    return "'" + text.replace("\\", "\\\\").replace("'", "\\'") + "'"


def with_search_path(overrides: Sequence[str], config_dir: Optional[str] = None) -> List[str]:
    """``overrides`` with the extra config directories merged into ``hydra.searchpath`` (in
    front of any the user gave), so the compose API searches what ``hydra.main`` with
    ``--config-dir`` searches."""
    extra = [f"file://{p}" for p in extra_config_dirs(config_dir)]
    if not extra:
        return list(overrides)
    rest, given = [], []
    for o in overrides:
        if o.lstrip("+~").startswith("hydra.searchpath="):
            from hydra.core.override_parser.overrides_parser import OverridesParser

            try:
                value = OverridesParser.create().parse_override(o).value()
            except HydraException as e:
                raise ConfigError(_explain(e)) from e
            given = list(value) if isinstance(value, (list, tuple)) else [value]
        else:
            rest.append(o)
    paths = extra + [str(v) for v in given if str(v) not in extra]
    return [*rest, f"hydra.searchpath=[{','.join(_quote(p) for p in paths)}]"]


def compose_config(overrides: Sequence[str] = (), config_dir: Optional[str] = None,
                   config_name: str = CONFIG_NAME) -> Config:
    """Composes ``config.yaml`` with Hydra ``overrides`` and validates it into a :class:`Config`.

    The packaged configs come first in the search path; ``config_dir`` (or
    ``$TORCHREC_PROACTIVE_CONFIG_DIR``) and any ``hydra.searchpath`` override add to them.
    ``hydra.*`` overrides are accepted; ``train.output_dir`` defaults to ``hydra.run.dir``.

    Every mistake raises :class:`~torchrec_proactive.app.errors.ConfigError` (a
    ``ValueError``) with a one-line message naming the key, the value and the limit: unknown
    keys, groups and options, values of the wrong type, overrides Hydra cannot parse (the
    Hydra exception is its ``__cause__``), and values out of range (from the schema).
    """
    register()
    # `experiment` is in the defaults list (as `experiment: null`), so the canonical form is
    # `experiment=name`; accept the `+experiment=name` habit from other Hydra projects too.
    overrides = with_search_path(canonical_overrides(overrides), config_dir)
    try:
        with initialize_config_dir(config_dir=str(packaged_config_dir()), version_base="1.3"):
            cfg = compose(config_name, overrides=list(overrides), return_hydra_config=True)
            if uses_default_output_dir(cfg, overrides):
                run_dir = OmegaConf.select(cfg, "hydra.run.dir")
                if run_dir:
                    cfg.train.output_dir = str(run_dir)
            with open_dict(cfg):
                del cfg["hydra"]
            return validate(cfg)
    except HydraException as e:
        raise ConfigError(_explain(e)) from e
    except OmegaConfBaseException as e:  # e.g. an interpolation that does not resolve
        raise ConfigError(f"{getattr(e, 'full_key', '') or 'config'}: {_first_line(e)}") from e


def canonical_overrides(overrides: Sequence[str]) -> List[str]:
    """``+experiment=x`` as ``experiment=x`` (``experiment`` is in the defaults list)."""
    return [o[1:] if o.startswith("+experiment=") else o for o in overrides]


def uses_default_output_dir(cfg: Any, overrides: Sequence[str]) -> bool:
    """True when neither an override nor a config file set ``train.output_dir``: the run
    then goes to Hydra's run directory (``hydra.run.dir``, or the job's directory in a
    ``-m`` sweep)."""
    if any(o.lstrip("+~").startswith("train.output_dir=") for o in overrides):
        return False
    raw = OmegaConf.to_container(cfg.train, resolve=False)
    return isinstance(raw, dict) and raw.get("output_dir") == DEFAULT_OUTPUT_DIR


def validate(cfg: Any) -> Config:
    """A composed tree (no ``hydra`` node) as a validated :class:`Config`; raises
    :class:`ConfigError` for a key the schema does not know or a value out of range."""
    _reject_unknown_keys(cfg, Config, "")
    try:
        return OmegaConf.to_object(cfg)  # type: ignore[return-value]  # runs every __post_init__
    except ValueError as e:  # the schema's range checks name field, value and limit already
        raise ConfigError(str(e)) from e
    except OmegaConfBaseException as e:  # e.g. an interpolation that does not resolve
        raise ConfigError(f"{getattr(e, 'full_key', '') or 'config'}: {_first_line(e)}") from e


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
    if message.startswith("Ambiguous value for argument"):  # Hydra explains it on three more lines
        return (f"{_first_line(message)}: a sweep needs -m/--multirun; a list is written key=[a,b], "
                f"a string with a comma key='a,b'")
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
    where = re.match(r"In '([^']+)'", message)
    full_key = getattr(cause, "full_key", None) if isinstance(cause, OmegaConfBaseException) else None
    if where and full_key:  # a mistake inside a config file (e.g. a --config-dir experiment): name the key
        known = unknown_key_message(full_key) if isinstance(cause, ConfigKeyError) else None
        return f"In '{where.group(1)}': {known or f'{full_key}: {_first_line(cause)}'}"
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
    roots = [packaged_config_dir(), *extra_config_dirs(config_dir)]
    return {g: sorted({p.stem for root in roots for p in (root / g).glob("*.yaml")})
            for g in [*GROUPS, "experiment"]}


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
