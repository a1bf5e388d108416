"""What a resumed run may change, and how far it stands, in words.

A checkpoint holds tables, optimizer state, a position in the data and RNG states. A config
change that leaves all of them meaningful is a valid resume: the sharding or the cache (the
checkpoint reshards; caches are flushed into it), the prefetch depth and link (they never
change the numerics), the learning rates and their warm-up (no state), the length of
training, logging, paths. What would make the saved state wrong is refused, naming the key:
the model (table shapes, dims, architecture), the data (its rows, split and order), the
optimizer types and their epsilons (the state's meaning), the batch size (the position in
the data) and the seed (the saved random streams continue; a new seed would not act).

Needs neither torch nor TorchRec.
"""

from __future__ import annotations

from typing import Any, Dict, Mapping, Tuple

from .errors import ConfigError

# Refused when they differ (prefixes end in "."); every other key may change.
REFUSED = ("model.", "data.", "optimizer.embedding", "optimizer.embedding_eps", "optimizer.dense",
           "optimizer.dense_eps", "train.batch_size", "train.seed")
# Exceptions to REFUSED: names and paths of the same thing.
ALLOWED = ("model.name", "data.root", "data.preprocessed_dir")
# Never listed as a change: how this invocation was asked to run, not what it trains.
_UNREMARKABLE = ("train.resume", "train.output_dir", "train.checkpoint_dir", "train.progress_bar")

_MISSING = object()


def _refused(key: str) -> bool:
    if key in ALLOWED:
        return False
    return any(key.startswith(p) if p.endswith(".") else key == p for p in REFUSED)


def _defaults() -> Dict[str, Any]:
    """The schema's default of every flattened key."""
    from dataclasses import asdict

    from ..config.schema import Config

    out: Dict[str, Any] = {}
    for group, fields in asdict(Config()).items():
        out.update({f"{group}.{k}": v for k, v in fields.items()})
    return out


def config_changes(saved: Mapping[str, Any], current: Mapping[str, Any]) -> Dict[str, Tuple[Any, Any]]:
    """``{key: (saved value, current value)}`` for every flattened key that differs (a key
    one side lacks counts as a difference, its value shown as ``None``) - except a key the
    checkpoint predates (absent from its config) that holds its schema default now: a key
    is added with the default that keeps what runs did before it (``model.history_length``
    is no change to a DLRM checkpoint saved before it existed)."""
    out: Dict[str, Tuple[Any, Any]] = {}
    defaults = _defaults()
    for key in sorted(set(saved) | set(current)):
        a, b = saved.get(key, _MISSING), current.get(key, _MISSING)
        if a is _MISSING and key in defaults and b == defaults[key]:
            continue
        if a != b:
            out[key] = (None if a is _MISSING else a, None if b is _MISSING else b)
    return out


def refuse_changes(saved: Mapping[str, Any], current: Mapping[str, Any], where: Any) -> Dict[str, Tuple[Any, Any]]:
    """The allowed changes between the checkpoint's config and this run's; raises
    :class:`ConfigError` naming every key whose change would make the saved state wrong."""
    if not isinstance(saved, Mapping):
        raise ConfigError(f"cannot resume from {where}: its config is a {type(saved).__name__}, not a mapping")
    changes = config_changes(saved, current)
    refused = {k: v for k, v in changes.items() if _refused(k)}
    if refused:
        detail = ", ".join(f"{k}: checkpoint {a!r} vs now {b!r}" for k, (a, b) in refused.items())
        raise ConfigError(f"cannot resume from {where}: {detail} (the saved tables, optimizer state or position "
                          f"would be wrong; sharding, cache, prefetch, link, learning rates and the length of "
                          f"training may change)")
    return {k: v for k, v in changes.items() if k not in _UNREMARKABLE}


def describe_changes(changes: Mapping[str, Tuple[Any, Any]]) -> str:
    """``"cache.load_factor 0.2 -> 0.5, ..."`` (for the log)."""
    return ", ".join(f"{k} {a!r} -> {b!r}" for k, (a, b) in changes.items())


def describe_progress(checkpoint: str, saved_step: int, saved_world: int, step: int, world: int, total: int,
                      batch_size: int, budget: str) -> str:
    """Where a resumed run stands, in steps of this run and in samples: what the checkpoint
    did (in its own steps and ranks), what that is here, and what remains of ``total``.

    Positions move between world sizes in samples (a step here consumes ``world *
    batch_size`` of them); ``total`` counts steps at this world size (``budget`` says which
    setting made it, e.g. ``train.max_steps=20``)."""
    per_step = world * batch_size
    saved_samples = saved_step * saved_world * batch_size
    here = (f" = step {step} on {world} rank(s)" if (saved_step, saved_world) != (step, world) else "")
    remain = max(total - step, 0)
    return (f"{checkpoint} holds {saved_step} step(s) on {saved_world} rank(s) x {batch_size} samples = "
            f"{saved_samples} samples{here}; this run has {total} steps of {per_step} samples ({budget}: "
            f"{total * per_step} samples): {remain} steps = {remain * per_step} samples remain")
