"""Typed schema of the Hydra config tree in ``conf/`` (one dataclass per config group).

Every group's YAML variants are merged onto these dataclasses, registered in Hydra's
ConfigStore by :func:`register`, so a misspelled key or a value of the wrong type fails
when the config is composed. Range and cross-field checks live in ``__post_init__`` and
run when the composed config is turned into objects (``OmegaConf.to_object``, done by
:func:`torchrec_proactive.app.compose.compose_config`); each names the field, the value
and the limit.

This module imports neither TorchRec nor torch, so configs can be checked anywhere.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import List, Optional, Sequence

ARCHS = ("dlrm", "dcnv2", "sequence")
DATA_SOURCES = ("synthetic", "criteo")
DATA_LAYOUTS = ("kaggle", "terabyte")
SHARDING_TYPES = ("table_wise", "row_wise", "column_wise", "table_row_wise", "auto")
KERNELS = ("fused_uvm_caching", "fused")
PREFETCH_MODES = ("off", "fixed", "auto")
EVICTION_POLICIES = ("lru", "lfu")
EMBEDDING_OPTIMIZERS = ("sgd", "adagrad", "rowwise_adagrad", "adam")
DENSE_OPTIMIZERS = ("sgd", "adagrad", "adam")
LINK_KINDS = ("emulated", "none")
TIER_KINDS = ("dram", "ssd")
DEVICES = ("auto", "cpu", "cuda")
NUM_SPARSE_FEATURES = 26  # Criteo's categorical columns
NUM_DENSE_FEATURES = 13  # Criteo's integer columns


def _fail(name: str, value: object, limit: str) -> None:
    raise ValueError(f"{name}={value!r} is invalid: {limit}")


def _choice(name: str, value: str, choices: Sequence[str]) -> None:
    if value not in choices:
        _fail(name, value, f"must be one of {list(choices)}")


def _at_least(name: str, value: Optional[float], minimum: float) -> None:
    if value is not None and not value >= minimum:
        _fail(name, value, f"must be >= {minimum}")


def _positive(name: str, value: float) -> None:
    if not (value > 0 and math.isfinite(value)):
        _fail(name, value, "must be a finite number > 0")


def _sizes(name: str, sizes: Sequence[int]) -> None:
    if len(sizes) == 0:
        _fail(name, list(sizes), "must list at least one layer size")
    for s in sizes:
        if s < 1:
            _fail(name, list(sizes), f"every layer size must be >= 1 (got {s})")


@dataclass(kw_only=True)
class ModelConfig:
    """DLRM (dot interaction) or DCNv2 (low-rank cross net), TorchRec's reference models, or a
    small sequence recommender (pooled Criteo features plus a synthetic user history)."""

    name: str = "debug"
    """Label of the variant."""
    arch: str = "dlrm"
    """``dlrm``: ``torchrec.models.dlrm.DLRM``; ``dcnv2``: ``DLRM_DCN`` as in MLPerf's DCNv2;
    ``sequence``: the pooled features beside a user history served by an ``EmbeddingCollection``
    (``app/sequence.py``; the history from ``data/history.py``)."""
    embedding_dim: int = 16
    """Width of every embedding table (DLRM needs one width for its pairwise interaction)."""
    dense_arch_layer_sizes: List[int] = field(default_factory=lambda: [64, 16])
    """Bottom MLP over the 13 dense features; the last size must equal ``embedding_dim``."""
    over_arch_layer_sizes: List[int] = field(default_factory=lambda: [64, 1])
    """Top MLP; the last size must be 1 (one logit)."""
    dcn_num_layers: int = 3
    """``dcnv2`` only: cross layers."""
    dcn_low_rank_dim: int = 64
    """``dcnv2`` only: rank of each cross layer's weight factorisation."""
    num_embeddings_per_feature: Optional[List[int]] = None
    """Rows per table; ``None`` takes the data set's cardinalities (what preprocessing saw)."""
    history_length: int = 8
    """``sequence`` only: most ids in a user history (lengths are uniform on 1..this)."""
    history_rows: int = 10_000
    """``sequence`` only: rows of the history table ``t_history`` (the item catalogue)."""
    history_zipf_alpha: float = 1.1
    """``sequence`` only: skew of history ids, Zipf(alpha) over the rows (larger = hotter head)."""

    def __post_init__(self) -> None:
        _choice("model.arch", self.arch, ARCHS)
        _at_least("model.embedding_dim", self.embedding_dim, 1)
        _sizes("model.dense_arch_layer_sizes", self.dense_arch_layer_sizes)
        _sizes("model.over_arch_layer_sizes", self.over_arch_layer_sizes)
        if self.dense_arch_layer_sizes[-1] != self.embedding_dim:
            _fail("model.dense_arch_layer_sizes", list(self.dense_arch_layer_sizes),
                  f"the last size must equal model.embedding_dim={self.embedding_dim}")
        if self.over_arch_layer_sizes[-1] != 1:
            _fail("model.over_arch_layer_sizes", list(self.over_arch_layer_sizes), "the last size must be 1")
        _at_least("model.dcn_num_layers", self.dcn_num_layers, 1)
        _at_least("model.dcn_low_rank_dim", self.dcn_low_rank_dim, 1)
        if self.num_embeddings_per_feature is not None:
            rows = list(self.num_embeddings_per_feature)
            if len(rows) != NUM_SPARSE_FEATURES:
                _fail("model.num_embeddings_per_feature", f"<{len(rows)} entries>",
                      f"must have {NUM_SPARSE_FEATURES} entries (one per Criteo categorical feature)")
            if min(rows) < 1:
                _fail("model.num_embeddings_per_feature", min(rows), "every table needs >= 1 row")
        _at_least("model.history_length", self.history_length, 1)
        _at_least("model.history_rows", self.history_rows, 2)
        _positive("model.history_zipf_alpha", self.history_zipf_alpha)


@dataclass(kw_only=True)
class DataConfig:
    """Where the Criteo-format data comes from and how it is split."""

    name: str = "synthetic"
    """Label of the variant."""
    source: str = "synthetic"
    """``synthetic``: generated Criteo-format TSV; ``criteo``: the released TSV files in ``root``."""
    layout: str = "kaggle"
    """``kaggle`` (one ``train.txt``) or ``terabyte`` (``day_0`` .. ``day_{num_days-1}``)."""
    root: str = "data/synthetic"
    """``criteo``: directory holding the TSV files. ``synthetic``: a directory written by
    ``torchrec-proactive gen-data --out-dir`` (used as it is), else the parent directory of
    data sets generated on first use (each in a subdirectory named after its spec, so specs
    never collide). A relative path means the directory the command runs from: the default
    generates into ``./data/synthetic``."""
    preprocessed_dir: Optional[str] = None
    """Binary (npy) output of preprocessing; ``None``: ``<data set dir>/preprocessed``, inside
    the data directory (set it, and ``cache.profile_path``, to leave that directory unwritten)."""
    num_days: int = 24
    """``terabyte`` layout: number of day files (24 in the release)."""
    num_samples: int = 100_000
    """``synthetic``: rows to generate."""
    cardinality_scale: float = 1.0
    """``synthetic``: multiplies Criteo's per-feature cardinalities."""
    max_cardinality: Optional[int] = 20_000
    """``synthetic``: cap on any feature's cardinality (keeps small features realistic)."""
    zipf_alpha: float = 1.1
    """``synthetic``: skew of category popularity (larger = hotter head)."""
    seed: int = 0
    """``synthetic``: generator seed (the whole data set is a function of the spec)."""
    frequency_threshold: int = 3
    """Preprocessing maps ids seen fewer times than this (in all files) to one shared row
    (TorchRec's Criteo default is 3; 0 keeps every id)."""
    eval_fraction: float = 0.1
    """Last fraction of all rows held out for evaluation (never trained on)."""
    shuffle_batches: bool = False
    """Permute rows within each training batch (TorchRec's option; numpy's global RNG)."""
    multi_hot: bool = False
    """``criteo`` + ``terabyte``: read MLPerf DLRM-v2's multi-hot features,
    ``<root>/day_{i}_sparse_multi_hot.npz`` (with ``day_{i}_{dense,labels}.npy``), in place."""
    multi_hot_sizes: Optional[List[int]] = None
    """With ``multi_hot``: ids per sample of each of the 26 features, as in the files (MLPerf:
    3,2,1,2,6,1,1,1,1,7,3,8,1,6,9,5,1,1,1,12,100,27,10,3,1,1); sizes the caches and is
    checked against the files."""

    def __post_init__(self) -> None:
        _choice("data.source", self.source, DATA_SOURCES)
        _choice("data.layout", self.layout, DATA_LAYOUTS)
        if not self.root:
            _fail("data.root", self.root, "must name a directory")
        _at_least("data.num_days", self.num_days, 1)
        _at_least("data.num_samples", self.num_samples, 2)
        _positive("data.cardinality_scale", self.cardinality_scale)
        _at_least("data.max_cardinality", self.max_cardinality, 2)
        _positive("data.zipf_alpha", self.zipf_alpha)
        _at_least("data.seed", self.seed, 0)
        _at_least("data.frequency_threshold", self.frequency_threshold, 0)
        if not 0.0 < self.eval_fraction < 1.0:
            _fail("data.eval_fraction", self.eval_fraction, "must be in (0, 1)")
        if self.multi_hot:
            if self.source != "criteo" or self.layout != "terabyte":
                _fail("data.multi_hot", True, "needs data.source='criteo' and data.layout='terabyte' (MLPerf DLRM-v2's files)")
            sizes = self.multi_hot_sizes
            if sizes is None or len(sizes) != NUM_SPARSE_FEATURES or min(sizes) < 1:
                _fail("data.multi_hot_sizes", None if sizes is None else list(sizes),
                      f"must list {NUM_SPARSE_FEATURES} sizes >= 1 with data.multi_hot=true")


@dataclass(kw_only=True)
class ShardingConfig:
    """How the embedding tables are split over ranks."""

    type: str = "table_wise"
    """One TorchRec sharding type for every table, or ``auto`` for TorchRec's planner."""
    kernel: str = "fused_uvm_caching"
    """``fused_uvm_caching``: proactive host tier + device cache (ours); ``fused``: stock
    TorchRec kernel, everything resident (the no-cache reference)."""

    def __post_init__(self) -> None:
        _choice("sharding.type", self.type, SHARDING_TYPES)
        _choice("sharding.kernel", self.kernel, KERNELS)


@dataclass(kw_only=True)
class PrefetchConfig:
    """How far ahead cold rows are fetched (``prefetch_depth``, k)."""

    mode: str = "fixed"
    """``off``: reactive, rows fetched inside the lookup (TorchRec's behaviour, depth 0);
    ``fixed``: fetch ``depth`` batches ahead; ``auto``: measure, then pick the depth."""
    depth: int = 2
    """``fixed``: the depth k (>= 0; 0 is reactive, as ``off``, so a sweep such as
    ``-m prefetch.depth=0,2,4`` needs no group change). Must be 0 with ``off``; ignored by
    ``auto``."""
    max_depth: int = 4
    """``auto``: largest depth it may choose (the cache must hold depth + 1 batches)."""
    warmup_steps: int = 8
    """``auto``: reactive steps measured before choosing (they are ordinary training steps;
    depth does not change the numerics)."""

    def __post_init__(self) -> None:
        _choice("prefetch.mode", self.mode, PREFETCH_MODES)
        if self.mode == "off" and self.depth != 0:
            _fail("prefetch.depth", self.depth, "must be 0 with prefetch.mode='off' (use prefetch=fixed for k >= 1)")
        if self.mode == "fixed" and self.depth < 0:
            _fail("prefetch.depth", self.depth, "must be >= 0 with prefetch.mode='fixed' (0 is reactive)")
        _at_least("prefetch.max_depth", self.max_depth, 1)
        _at_least("prefetch.warmup_steps", self.warmup_steps, 3)

    @property
    def initial_depth(self) -> int:
        """Depth the pipeline starts with (``auto`` starts reactive while it measures)."""
        return self.depth if self.mode == "fixed" else 0

    @property
    def capacity_depth(self) -> int:
        """Deepest depth this config may run at: caches are sized for it."""
        return {"off": 0, "fixed": self.depth, "auto": self.max_depth}[self.mode]


@dataclass(kw_only=True)
class CacheConfig:
    """The device cache in front of each proactive table shard."""

    load_factor: float = 0.2
    """Cache rows as a fraction of each local shard's rows."""
    eviction_policy: str = "lru"
    """``lru`` or ``lfu`` for slots that no in-flight batch pins."""
    fit_depth: bool = True
    """Grow caches that cannot hold ``depth + 1`` batches of ids (small tables, tiny load
    factors) to that size, logging each change, instead of failing at the first batch. The
    depth is ``sized_for_depth`` (default: the run's own), so runs at different depths get
    different caches unless that is set (a ``-m`` sweep over the depth sets it)."""
    sized_for_depth: Optional[int] = None
    """The prefetch depth the caches are sized for: ``fit_depth``'s growth and, with
    ``budget_bytes``, the floors the planner keeps (the rows ``depth + 1`` batches pin).
    ``None``: the run's own (``prefetch.depth``; ``prefetch.max_depth`` with ``auto``; 0 with
    ``off``). At least that depth. A ``-m`` sweep whose jobs run different depths sets it to
    the largest for every job, so that the caches stay the same and only the depth differs."""
    budget_bytes: int = 0
    """0: every table gets ``load_factor``. > 0 (with ``sharding.type=auto``): per-table cache
    sizes chosen by TorchRec's planner from the data's miss-ratio curves (see
    ``torchrec-proactive profile-cache``) under this many device bytes per rank, as TorchRec's
    storage model counts them (cache rows, their optimizer state, I/O buffers); never below
    the rows ``depth + 1`` batches pin, and a budget that cannot hold those is refused, naming
    the minimum (``profile-cache`` prints it too). ``load_factor`` and ``fit_depth`` are then
    unused. -1 (CUDA only): the device memory the other tables leave, after TorchRec's 15% for
    the dense part."""
    profile_batches: int = 200
    """Global batches sampled from the training data to measure the miss-ratio curves."""
    profile_path: str = ""
    """Where the cache profile is kept; empty: ``cache_profile.json`` in the data set's directory
    (inside the data directory; a training run copies it into its run directory too)."""

    def __post_init__(self) -> None:
        if not 0.0 < self.load_factor <= 1.0:
            _fail("cache.load_factor", self.load_factor, "must be in (0, 1]")
        _at_least("cache.budget_bytes", self.budget_bytes, -1)
        _at_least("cache.sized_for_depth", self.sized_for_depth, 0)
        _at_least("cache.profile_batches", self.profile_batches, 2)
        _choice("cache.eviction_policy", self.eviction_policy, EVICTION_POLICIES)


@dataclass(kw_only=True)
class OptimizerConfig:
    """Fused (in-backward) embedding optimizer and the dense optimizer."""

    embedding: str = "rowwise_adagrad"
    """FBGEMM ``EmbOptimType`` of the tables: sgd, adagrad, rowwise_adagrad or adam (EXACT_*)."""
    embedding_lr: float = 0.05
    """Learning rate of the embedding optimizer."""
    embedding_eps: float = 1e-8
    """Epsilon of the adaptive embedding optimizers."""
    dense: str = "adagrad"
    """``torch.optim`` optimizer of the MLPs: sgd, adagrad or adam."""
    dense_lr: float = 0.05
    """Learning rate of the dense optimizer."""
    dense_eps: float = 1e-8
    """Epsilon of the adaptive dense optimizers."""
    warmup_steps: int = 0
    """Linear warm-up of the dense learning rate: step ``s`` uses ``dense_lr * min(1, s /
    warmup_steps)`` (TorchRec's reference DLRM trainer: ``--lr_warmup_steps``); 0: none."""

    def __post_init__(self) -> None:
        _choice("optimizer.embedding", self.embedding, EMBEDDING_OPTIMIZERS)
        _choice("optimizer.dense", self.dense, DENSE_OPTIMIZERS)
        _positive("optimizer.embedding_lr", self.embedding_lr)
        _positive("optimizer.embedding_eps", self.embedding_eps)
        _positive("optimizer.dense_lr", self.dense_lr)
        _positive("optimizer.dense_eps", self.dense_eps)
        _at_least("optimizer.warmup_steps", self.warmup_steps, 0)


@dataclass(kw_only=True)
class LinkConfig:
    """The host-to-device link on CPU (on CUDA the copy stream is the link; this is ignored)."""

    kind: str = "emulated"
    """``emulated``: copies complete no earlier than ``latency + bytes / bandwidth`` (figures
    measured with it are labelled emulated); ``none``: plain in-process copy."""
    bandwidth_gbps: float = 0.5
    """Emulated bandwidth in GB/s (1e9 bytes per second)."""
    latency_us: float = 200.0
    """Emulated fixed cost per fetch, in microseconds."""

    def __post_init__(self) -> None:
        _choice("link.kind", self.kind, LINK_KINDS)
        _positive("link.bandwidth_gbps", self.bandwidth_gbps)
        _at_least("link.latency_us", self.latency_us, 0.0)


@dataclass(kw_only=True)
class TierConfig:
    """Where the proactive tables' rows live below the device cache."""

    kind: str = "dram"
    """``dram``: every row in host memory (the host tier); ``ssd``: tables larger than host
    memory - each table shard's rows in a file under ``tier.dir``, behind a DRAM host cache
    of ``tier.host_cache_mb`` (TorchRec's ``key_value`` kernel with ``KeyValueParams``)."""
    dir: str = ""
    """``ssd``: the directory of the tables' files (a local NVMe disk; ``@local_rank`` is
    replaced by the rank's local rank). The files are scratch, removed at the end of the run."""
    host_cache_mb: float = 64.0
    """``ssd``: each table shard's host cache, in MiB (TorchRec's ``l2_cache_size`` is whole
    GB per group; this is finer)."""
    host_budget_mb: float = 0.0
    """``ssd``: > 0 plans the host caches from the data instead: each rank's tables share this
    many MiB of DRAM, split by their miss-ratio curves (measured on ``cache.profile_batches``
    batches at the disk depth) where a byte saves the most disk reads; the tables are then
    placed table-wise (the curves measure whole tables). 0: ``tier.host_cache_mb`` each."""
    disk_depth: Optional[int] = None
    """``ssd``: how many batches ahead the tables' disk reads are queued (the pipeline's
    ``disk_depth``, >= the prefetch depth: a disk read takes longer than a step, a DRAM
    fetch does not). Unset: at the prefetch depth, when each batch is planned. The host
    caches hold ``disk_depth + 1`` batches' rows; the device caches ``depth + 1``."""

    def __post_init__(self) -> None:
        _choice("tier.kind", self.kind, TIER_KINDS)
        _positive("tier.host_cache_mb", self.host_cache_mb)
        _at_least("tier.host_budget_mb", self.host_budget_mb, 0)
        if self.host_budget_mb and self.kind != "ssd":
            _fail("tier.host_budget_mb", self.host_budget_mb, f"plans the host caches of tables on disk: needs "
                  f"tier=ssd, got tier.kind={self.kind!r}")
        if self.disk_depth is not None:
            _at_least("tier.disk_depth", self.disk_depth, 0)
        if self.kind == "ssd" and not self.dir:
            _fail("tier.dir", self.dir, "must name a directory for the tables' files with tier=ssd (a local NVMe disk)")


@dataclass(kw_only=True)
class TrainConfig:
    """The loop: length, batch, evaluation, logging, checkpoints, seeds."""

    epochs: int = 1
    """Passes over the training split."""
    max_steps: Optional[int] = None
    """Stop after this many steps in total (counted across epochs and resumes)."""
    batch_size: int = 256
    """Samples per rank per step."""
    eval: bool = True
    """Evaluate (AUROC, log loss) on the held-out split after each epoch and at the end."""
    eval_max_batches: Optional[int] = None
    """Cap on evaluation batches per rank (``None``: the whole held-out split)."""
    log_every: int = 20
    """Steps between log lines (loss, samples/s, stall, hit rate)."""
    output_dir: str = "outputs/${now:%Y-%m-%d}/${now:%H-%M-%S}"
    """Run directory; every rank writes under ``<output_dir>/rank_<r>`` only. The default is
    new for every run (Hydra's run-directory pattern); a directory that holds a previous
    run is refused unless ``resume`` is set."""
    save_checkpoints: bool = True
    """Write checkpoints at all (``compare`` turns them off)."""
    checkpoint_dir: Optional[str] = None
    """``None``: ``<output_dir>/checkpoints``."""
    checkpoint_every: int = 0
    """Steps between checkpoints; 0: only at the end of each epoch and of training."""
    keep_checkpoints: int = 2
    """Complete checkpoints kept (older ones are deleted after a new one is complete)."""
    resume: bool = False
    """Continue from the latest complete checkpoint in ``checkpoint_dir`` (if any); a run
    that already finished reports its final results and trains nothing."""
    seed: int = 0
    """Seed of torch / numpy / random on every rank."""
    device: str = "auto"
    """``auto`` (CUDA when available), ``cpu`` or ``cuda``."""
    progress_bar: bool = True
    """tqdm bars on rank 0 when its stderr is a terminal (never in redirected logs)."""

    def __post_init__(self) -> None:
        _at_least("train.epochs", self.epochs, 1)
        _at_least("train.max_steps", self.max_steps, 1)
        _at_least("train.batch_size", self.batch_size, 1)
        _at_least("train.eval_max_batches", self.eval_max_batches, 1)
        _at_least("train.log_every", self.log_every, 1)
        _at_least("train.checkpoint_every", self.checkpoint_every, 0)
        _at_least("train.keep_checkpoints", self.keep_checkpoints, 1)
        _at_least("train.seed", self.seed, 0)
        _choice("train.device", self.device, DEVICES)
        if not self.output_dir:
            _fail("train.output_dir", self.output_dir, "must name a directory")


@dataclass(kw_only=True)
class Config:
    """The whole run. Groups are chosen in ``conf/config.yaml``'s defaults list."""

    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    sharding: ShardingConfig = field(default_factory=ShardingConfig)
    prefetch: PrefetchConfig = field(default_factory=PrefetchConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    link: LinkConfig = field(default_factory=LinkConfig)
    tier: TierConfig = field(default_factory=TierConfig)
    train: TrainConfig = field(default_factory=TrainConfig)

    def __post_init__(self) -> None:
        if self.prefetch.mode == "auto" and self.train.max_steps is not None \
                and self.train.max_steps < self.prefetch.warmup_steps:
            _fail("prefetch.warmup_steps", self.prefetch.warmup_steps,
                  f"must be <= train.max_steps={self.train.max_steps} with prefetch.mode='auto'")
        if self.cache.budget_bytes and (self.sharding.type != "auto" or self.sharding.kernel != "fused_uvm_caching"):
            _fail("cache.budget_bytes", self.cache.budget_bytes,
                  f"needs sharding.type='auto' and sharding.kernel='fused_uvm_caching' (the planner chooses the "
                  f"cache sizes), got sharding.type={self.sharding.type!r}, sharding.kernel={self.sharding.kernel!r}")
        if self.cache.sized_for_depth is not None and self.cache.sized_for_depth < self.prefetch.capacity_depth:
            _fail("cache.sized_for_depth", self.cache.sized_for_depth,
                  f"must be >= the run's prefetch depth {self.prefetch.capacity_depth} (the caches must hold depth + 1 "
                  f"batches; leave it unset to size them for the run's own depth)")
        if self.tier.disk_depth is not None and self.tier.kind != "ssd":
            _fail("tier.disk_depth", self.tier.disk_depth, f"applies to tables on disk: needs tier=ssd, got tier.kind="
                  f"{self.tier.kind!r}")
        if self.tier.disk_depth is not None and self.tier.disk_depth < self.prefetch.capacity_depth:
            _fail("tier.disk_depth", self.tier.disk_depth,
                  f"must be >= the prefetch depth {self.prefetch.capacity_depth} (the disk hop runs at least as far "
                  f"ahead as the host-to-device hop)")
        if self.tier.host_budget_mb and self.sharding.type not in ("auto", "table_wise"):
            _fail("tier.host_budget_mb", self.tier.host_budget_mb,
                  f"plans whole tables' host caches (the curves measure whole tables): needs sharding.type='auto' "
                  f"or 'table_wise', got {self.sharding.type!r}")
        if self.tier.kind == "ssd" and self.sharding.kernel != "fused_uvm_caching":
            _fail("tier.kind", self.tier.kind, f"'ssd' needs sharding.kernel='fused_uvm_caching' (the proactive tables), "
                  f"got {self.sharding.kernel!r}")
        if self.model.arch == "sequence":
            self._check_sequence()
        if self.sharding.kernel == "fused" and self.prefetch.capacity_depth != 0:
            _fail("prefetch.mode", self.prefetch.mode,
                  "must be 'off' (or 'fixed' with depth 0) with sharding.kernel='fused' (stock tables have "
                  "nothing to prefetch)")

    def _check_sequence(self) -> None:
        """What ``model.arch='sequence'``'s history table (an ``EmbeddingCollection``) cannot
        have yet: refused at composition, one line naming the keys."""
        if self.tier.kind == "ssd":
            _fail("tier.kind", self.tier.kind, "model.arch='sequence' keeps its history table (an EmbeddingCollection) "
                  "in DRAM: the disk tier serves EmbeddingBagCollection tables only for now; use tier=dram")
        if self.cache.budget_bytes:
            _fail("cache.budget_bytes", self.cache.budget_bytes, "cache planning from profiles covers "
                  "EmbeddingBagCollection tables only, not the history table of model.arch='sequence'; use "
                  "cache.budget_bytes=0 (cache.load_factor for every table)")
        if self.sharding.type == "table_row_wise":
            _fail("sharding.type", self.sharding.type, "the history table of model.arch='sequence' (an "
                  "EmbeddingCollection) shards table_wise, row_wise or column_wise (as stock TorchRec's), or auto")

    @property
    def cache_depth(self) -> int:
        """The prefetch depth the caches are sized for (``cache.sized_for_depth`` or the run's own)."""
        return self.prefetch.capacity_depth if self.cache.sized_for_depth is None else self.cache.sized_for_depth


GROUPS = {
    "model": ModelConfig,
    "data": DataConfig,
    "sharding": ShardingConfig,
    "prefetch": PrefetchConfig,
    "cache": CacheConfig,
    "optimizer": OptimizerConfig,
    "link": LinkConfig,
    "tier": TierConfig,
    "train": TrainConfig,
}
SCHEMA_NAME = "proactive_schema"

_registered = False


def register() -> None:
    """Registers the schema in Hydra's ConfigStore (idempotent).

    ``conf/config.yaml`` lists ``proactive_schema`` in its defaults, so every group's
    variants are merged onto a typed node.
    """
    global _registered
    if _registered:
        return
    from hydra.core.config_store import ConfigStore

    cs = ConfigStore.instance()
    cs.store(name=SCHEMA_NAME, node=Config)
    _registered = True
