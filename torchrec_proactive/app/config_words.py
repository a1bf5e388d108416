"""The library's messages in the words of the config a CLI user edits.

The store and the sharder name their own parameters (``cache_load_factor``,
``prefetch_depth``); a user of ``torchrec-proactive train`` sets ``cache.load_factor`` and
``prefetch.*``. Both the launcher (``entry``) and the trainer (``train``) translate, so the
translation lives here, below both of them.
"""

from __future__ import annotations

import re
from typing import Any, Tuple

from .errors import ConfigError


def in_config_words(text: str, cfg: Any, with_values: bool = True) -> str:
    """``text`` (a message of the store or the sharder) with the library's parameter names
    replaced by the config keys a user of the CLI sets (and their values, ``with_values``)."""
    # the sharder's advice when a plan has no proactive table: the config's word for it
    kernel = f"sharding.kernel=fused_uvm_caching (now {cfg.sharding.kernel})" if with_values else "sharding.kernel"
    text = text.replace('ParameterConstraints(compute_kernels=["fused_uvm_caching"], '
                        'cache_params=CacheParams(load_factor=...))', kernel)
    if cfg.cache.budget_bytes:
        # the planner sized each cache from cache.budget_bytes; cache.load_factor is not used
        budget = f"cache.budget_bytes={cfg.cache.budget_bytes}" if with_values else "cache.budget_bytes"
        load_factor = f"this table's planned load factor (from {budget}: raise the budget)"
    else:
        load_factor = f"cache.load_factor (now {cfg.cache.load_factor:g})" if with_values else "cache.load_factor"
    for library_name in ("CacheParams.load_factor", "cache_load_factor"):
        text = text.replace(library_name, load_factor)
    # a table on disk: its host cache is the config's (planned from tier.host_budget_mb, or
    # tier.host_cache_mb per table)
    tier = getattr(cfg, "tier", None)
    if tier is not None and getattr(tier, "kind", None) == "ssd":
        key, value = host_cache_key(cfg)
        raise_it = f"raise {key} (now {value:g})" if with_values else f"raise {key}"
        need = _per_shard_need(text) if key == "tier.host_cache_mb" else ""
        raise_it += f" to {need}" if need else ""
        text = re.sub(r"raise host_cache_bytes \(or KeyValueParams\.l2_cache_size\)"
                      r"( to at least \d+ bytes( for each of its \d+ tables)? \([^)]*\))?",
                      lambda m: raise_it + (" (leave headroom: batches vary)" if m.group(1) else ""), text)
        # (the store's refusal, quoted by the deferral warning: the same advice)
        text = re.sub(r"(give the host cache at least \d+ rows \(\d+ bytes\))\. Nothing changed",
                      lambda m: f"{m.group(1)}: {raise_it}", text)
    return text


def host_cache_key(cfg: Any) -> Tuple[str, float]:
    """The config key (and its value) that sizes the host caches of tables on disk:
    ``tier.host_budget_mb`` where the caches are planned from it, else ``tier.host_cache_mb``."""
    tier = cfg.tier
    return ("tier.host_budget_mb", tier.host_budget_mb) if tier.host_budget_mb else ("tier.host_cache_mb",
                                                                                       tier.host_cache_mb)


def _per_shard_need(text: str) -> str:
    """What each table's ``tier.host_cache_mb`` must be for the host cache a store message
    asks for: the store sizes one host cache per group of tables ('t_a+t_b'), the config
    each table shard's share of it (empty when the message gives no size)."""
    # (imported here: the launching process imports this module, and the library's imports
    # TorchRec, which only the ranks need)
    from ..integration.disk_tier import host_cache_need

    need = host_cache_need(text)
    if need is None:
        return ""
    total, tables = need
    mib = total / tables / 2**20
    return f"at least {mib:.3g} per table shard" + (f", {tables} tables in this group" if tables > 1 else "")


def capacity_error(cfg: Any, e: Exception) -> ConfigError:
    """The store's capacity error in the words of the config: it knows the sharder's
    ``cache_load_factor`` and ``prefetch_depth``; the user set ``cache.load_factor`` and
    ``prefetch.*``."""
    depth = {"off": "prefetch=off (depth 0)", "fixed": f"prefetch.depth={cfg.prefetch.depth}",
             "auto": f"prefetch=auto (prefetch.max_depth={cfg.prefetch.max_depth})"}[cfg.prefetch.mode]
    # (The message starts with the value already.)
    detail = in_config_words(str(e), cfg, with_values=False).replace("prefetch_depth", "depth")
    lower = "" if cfg.prefetch.mode == "off" else " or lower the depth"
    if cfg.cache.budget_bytes:
        return ConfigError(f"cache.budget_bytes={cfg.cache.budget_bytes} is too small for {depth}: {detail}; raise "
                           f"cache.budget_bytes or cache.profile_batches (the planned floors come from that sample)"
                           f"{lower}")
    fixes = "raise cache.load_factor" + (", set cache.fit_depth=true" if not cfg.cache.fit_depth else "") + lower
    return ConfigError(f"cache.load_factor={cfg.cache.load_factor:g} is too small for {depth}: {detail}; {fixes}")


def host_cache_error(cfg: Any, e: Exception) -> ConfigError:
    """A host cache (``tier=ssd``) too small for the batches in flight, in config words: the
    store says how many rows and bytes it needs; the user sets ``tier.host_cache_mb`` (per
    table shard) and the depths."""
    depth = f"prefetch.depth={cfg.prefetch.capacity_depth}"
    if cfg.tier.disk_depth is not None:
        depth += f" and tier.disk_depth={cfg.tier.disk_depth}"
    text = str(e)
    # The store sizes one host cache per group of tables ('t_a+t_b'); the config sizes each
    # table's share: say what each share needs.
    each = _per_shard_need(text)
    each = f" ({each})" if each else ""
    if cfg.tier.host_budget_mb:  # (the host caches were planned: the budget is the user's word)
        return ConfigError(f"tier.host_budget_mb={cfg.tier.host_budget_mb:g} planned a host cache too small for "
                           f"{depth}: {text}; raise tier.host_budget_mb or lower the depths")
    return ConfigError(f"tier.host_cache_mb={cfg.tier.host_cache_mb:g} is too small for {depth}: {text}; raise "
                       f"tier.host_cache_mb{each} or lower the depths")
