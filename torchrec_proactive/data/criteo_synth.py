"""Generator of synthetic data in the exact Criteo TSV format.

Real Criteo (Kaggle display-advertising or the 1TB click logs) cannot be downloaded in
every environment, so this module writes files that TorchRec's own Criteo preprocessing
accepts unchanged and that share the properties that matter for embedding caching:

* Format: every line is ``label \\t I1..I13 \\t C1..C26``; integers are decimal counts,
  categoricals are 8-digit lowercase hex hashes, and missing values are empty fields.
* Skew: category ids follow a bounded Zipf law within each feature's cardinality, so a
  small fraction of rows receives the bulk of the accesses (Bagpipe reports that about 1%
  of Criteo's embedding rows take most lookups). With the default ``zipf_alpha=1.1`` and a
  10M-row feature, the top 1% of rows take roughly 85% of that feature's accesses.
* Popularity is not visible in the hash: ranks go through a keyed bijection of the 32-bit
  hash space, so distinct ids stay distinct but the hash says nothing about the rank.
* Learnable labels: the click probability is the logistic of per-category random effects
  of a few features plus a term in two integer features, so a model (or even a per-category
  target mean) beats AUROC 0.5 clearly.

Everything is a deterministic function of the spec (including ``seed``).
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import List, Optional, Sequence, Tuple, Union

import numpy as np
from tqdm import tqdm

NUM_INT_FEATURES = 13
NUM_CAT_FEATURES = 26
LAYOUTS = ("kaggle", "terabyte")

KAGGLE_CARDINALITIES: Tuple[int, ...] = (
    1460, 583, 10131227, 2202608, 305, 24, 12517, 633, 3, 93145, 5683, 8351593, 3194,
    27, 14992, 5461306, 10, 5652, 2173, 4, 7046547, 18, 15, 286181, 105, 142572,
)  # fmt: skip
TERABYTE_CARDINALITIES: Tuple[int, ...] = (
    40000000, 39060, 17295, 7424, 20265, 3, 7122, 1543, 63, 40000000, 3067956, 405282,
    10, 2209, 11938, 155, 4, 976, 14, 40000000, 40000000, 40000000, 590152, 12973, 108, 36,
)  # fmt: skip

# Hashes are 8 hex digits, so a feature cannot have more distinct values than this.
MAX_HASH_SPACE = 1 << 32
# Typical click-through rates of the released data sets.
_DEFAULT_POSITIVE_RATE = {"kaggle": 0.256, "terabyte": 0.034}

# Fraction of empty fields per column. Real Criteo has a few integer columns that are
# mostly missing and a few categorical columns missing about half of the time; the
# exact values here are illustrative, not measured.
_INT_MISSING_RATE = np.array(
    [0.45, 0.0, 0.2, 0.22, 0.03, 0.22, 0.04, 0.0, 0.04, 0.45, 0.04, 0.77, 0.22]
)
_CAT_MISSING_RATE = np.array(
    [0, 0, 0.03, 0.03, 0, 0.12, 0, 0, 0, 0, 0, 0.03, 0,
     0, 0, 0.03, 0, 0, 0.44, 0.44, 0.03, 0, 0.76, 0.03, 0.44, 0.44]
)  # fmt: skip
# Integer features are heavy-tailed counts: floor(expm1(max(mu + sigma * z, 0))).
_INT_LOG_MEAN = np.array([0.8, 2.5, 1.5, 1.8, 6.0, 3.0, 1.5, 2.0, 3.5, 0.5, 1.0, 0.3, 1.8])
_INT_LOG_STD = np.array([1.0, 1.5, 1.2, 1.0, 2.0, 1.6, 1.3, 1.1, 1.4, 0.8, 1.0, 1.0, 1.2])
# TorchRec's tsv_to_npys casts integers to int32; keep well clear of overflow.
_INT_MAX = 1 << 30

# The label model. Informative categoricals mix small and large vocabularies.
_INFORMATIVE_CATS = (2, 5, 8, 13, 16)
_CAT_EFFECT_STD = 0.8
_INFORMATIVE_INTS = (1, 7)  # columns without missing values
_INT_WEIGHTS = (0.5, -0.4)

# Written by `generate` after every file is in place: the spec of a complete data set.
SPEC_FILE = "spec.json"

_CHUNK_ROWS = 65536
_CALIBRATION_ROWS = 20000
_MASK32 = np.uint64(0xFFFFFFFF)


@dataclass(frozen=True)
class SyntheticCriteoSpec:
    """What to generate. All fields are validated in ``__post_init__``.

    Invariants after construction: ``cardinalities()`` has 26 entries, each in
    ``[min_cardinality, min(max_cardinality, 2**32)]``; every output file has at least one
    row; Kaggle layout has exactly one file.
    """

    layout: str = "kaggle"
    num_samples: int = 10000
    cardinality_scale: float = 1.0
    max_cardinality: Optional[int] = None
    min_cardinality: int = 2
    zipf_alpha: float = 1.1
    seed: int = 0
    num_files: int = 1
    # None: the layout's typical click-through rate (Kaggle ~25.6%, Terabyte ~3.4%).
    positive_rate: Optional[float] = None

    def __post_init__(self) -> None:
        if self.layout not in LAYOUTS:
            raise ValueError(f"layout={self.layout!r} is invalid: must be one of {LAYOUTS}")
        _require_int("num_samples", self.num_samples, 1)
        _require_int("min_cardinality", self.min_cardinality, 2)
        _require_int("seed", self.seed, 0)
        _require_int("num_files", self.num_files, 1)
        if not (isinstance(self.cardinality_scale, (int, float)) and self.cardinality_scale > 0
                and math.isfinite(self.cardinality_scale)):  # fmt: skip
            raise ValueError(
                f"cardinality_scale={self.cardinality_scale!r} is invalid: "
                "must be a finite number > 0"
            )
        if not (isinstance(self.zipf_alpha, (int, float)) and self.zipf_alpha > 0
                and math.isfinite(self.zipf_alpha)):  # fmt: skip
            raise ValueError(
                f"zipf_alpha={self.zipf_alpha!r} is invalid: must be a finite number > 0"
            )
        if self.max_cardinality is not None:
            _require_int("max_cardinality", self.max_cardinality, self.min_cardinality)
        if self.layout == "kaggle" and self.num_files != 1:
            raise ValueError(
                f"num_files={self.num_files} is invalid for layout='kaggle': must be 1 (train.txt)"
            )
        if self.num_files > self.num_samples:
            raise ValueError(
                f"num_files={self.num_files} is invalid: must be <= num_samples={self.num_samples}"
                " so that every file has at least one row"
            )
        if self.positive_rate is not None and not (0.0 < self.positive_rate < 1.0):
            raise ValueError(f"positive_rate={self.positive_rate!r} is invalid: must be in (0, 1)")
        largest = max(self.cardinalities())
        if largest > MAX_HASH_SPACE:
            raise ValueError(
                f"cardinality_scale={self.cardinality_scale} gives a cardinality of {largest}, "
                f"above the limit {MAX_HASH_SPACE} of 8-hex-digit hashes; set max_cardinality"
            )

    def base_cardinalities(self) -> Tuple[int, ...]:
        return KAGGLE_CARDINALITIES if self.layout == "kaggle" else TERABYTE_CARDINALITIES

    def cardinalities(self) -> List[int]:
        """Per-feature number of distinct values: scaled, then clamped to [min, max]."""
        out = []
        for base in self.base_cardinalities():
            card = max(self.min_cardinality, int(round(base * self.cardinality_scale)))
            if self.max_cardinality is not None:
                card = min(card, self.max_cardinality)
            out.append(card)
        return out

    def file_names(self) -> List[str]:
        """Kaggle: ``train.txt``; Terabyte: ``day_0`` .. ``day_{n-1}`` (no extension)."""
        if self.layout == "kaggle":
            return ["train.txt"]
        return [f"day_{i}" for i in range(self.num_files)]

    def rows_per_file(self) -> List[int]:
        """Near-equal split of ``num_samples``; the first files take the remainder."""
        base, extra = divmod(self.num_samples, self.num_files)
        return [base + (1 if i < extra else 0) for i in range(self.num_files)]

    def effective_positive_rate(self) -> float:
        if self.positive_rate is not None:
            return self.positive_rate
        return _DEFAULT_POSITIVE_RATE[self.layout]


def _require_int(name: str, value: object, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise ValueError(f"{name}={value!r} is invalid: must be an int >= {minimum}")
    if value < minimum:
        raise ValueError(f"{name}={value} is invalid: must be >= {minimum}")


def sample_zipf_ranks(rng: np.random.Generator, n: int, alpha: float, size: int) -> np.ndarray:
    """Draws ``size`` popularity ranks in ``[0, n)``; rank ``r`` has weight ~ ``(r+1)**-alpha``.

    Uses the inverse CDF of the continuous power law on ``[1, n+1)`` and floors it, which
    needs O(size) memory even for n = 40M (an exact discrete CDF would need O(n)).
    """
    u = rng.random(size)
    log_top = math.log(n + 1.0)
    exponent = 1.0 - alpha
    if abs(exponent) < 1e-9:
        x = np.exp(u * log_top)
    else:
        # (1 + u * ((n+1)**e - 1)) ** (1/e), written with expm1/log1p to stay accurate
        # when e is close to 0.
        span = math.expm1(exponent * log_top)
        x = np.exp(np.log1p(u * span) / exponent)
    return np.clip(np.floor(x).astype(np.int64) - 1, 0, n - 1)


def mix32(values: np.ndarray, key: int) -> np.ndarray:
    """Keyed bijection of ``[0, 2**32)``: add the key, then the murmur3 finaliser.

    Every step (add mod 2**32, xor-shift right, multiply by an odd constant mod 2**32) is
    invertible, so distinct inputs keep distinct outputs: no two categories merge.
    """
    x = (values.astype(np.uint64) + np.uint64(key)) & _MASK32
    x ^= x >> np.uint64(16)
    x = (x * np.uint64(0x85EBCA6B)) & _MASK32
    x ^= x >> np.uint64(13)
    x = (x * np.uint64(0xC2B2AE35)) & _MASK32
    x ^= x >> np.uint64(16)
    return x


@dataclass(frozen=True)
class _Keys:
    """Per-feature keys derived from the seed: one for the hash, one for the label effect."""

    hash_keys: Tuple[int, ...]
    effect_keys: Tuple[int, ...]

    @staticmethod
    def from_seed(seed: int) -> "_Keys":
        state = np.random.SeedSequence([seed, 0x5EED]).generate_state(2 * NUM_CAT_FEATURES)
        keys = [int(k) for k in state]
        return _Keys(tuple(keys[:NUM_CAT_FEATURES]), tuple(keys[NUM_CAT_FEATURES:]))


@dataclass
class _Chunk:
    """Latent draws for ``n`` rows, before formatting."""

    z: np.ndarray  # [n, 13] standard normals behind the integer features
    int_missing: np.ndarray  # [n, 13] bool
    ranks: np.ndarray  # [n, 26] int64 popularity ranks
    cat_missing: np.ndarray  # [n, 26] bool


def _draw_chunk(rng: np.random.Generator, n: int, cards: Sequence[int], alpha: float) -> _Chunk:
    z = rng.standard_normal((n, NUM_INT_FEATURES))
    int_missing = rng.random((n, NUM_INT_FEATURES)) < _INT_MISSING_RATE
    ranks = np.empty((n, NUM_CAT_FEATURES), dtype=np.int64)
    for f, card in enumerate(cards):
        ranks[:, f] = sample_zipf_ranks(rng, card, alpha, n)
    cat_missing = rng.random((n, NUM_CAT_FEATURES)) < _CAT_MISSING_RATE
    return _Chunk(z, int_missing, ranks, cat_missing)


def _logits_without_bias(chunk: _Chunk, keys: _Keys) -> np.ndarray:
    """Per-category effects are uniform with std ``_CAT_EFFECT_STD``, a pure function of
    (feature, rank) via ``mix32``, so no O(cardinality) table is ever built. A missing
    category contributes nothing."""
    logit = np.zeros(len(chunk.z))
    for col, weight in zip(_INFORMATIVE_INTS, _INT_WEIGHTS):
        logit += weight * chunk.z[:, col]
    for f in _INFORMATIVE_CATS:
        u = mix32(chunk.ranks[:, f], keys.effect_keys[f]).astype(np.float64) / MAX_HASH_SPACE
        effect = _CAT_EFFECT_STD * math.sqrt(12.0) * (u - 0.5)
        logit += np.where(chunk.cat_missing[:, f], 0.0, effect)
    return logit


def _calibrate_bias(spec: SyntheticCriteoSpec, keys: _Keys) -> float:
    """Bias so that the expected positive rate matches the target (bisection on a sample
    drawn from its own RNG stream, so it does not perturb the data streams)."""
    rng = np.random.default_rng(np.random.SeedSequence([spec.seed, 0xCA1B]))
    chunk = _draw_chunk(rng, _CALIBRATION_ROWS, spec.cardinalities(), spec.zipf_alpha)
    logit = _logits_without_bias(chunk, keys)
    target = spec.effective_positive_rate()
    lo, hi = -30.0, 30.0
    for _ in range(60):
        mid = 0.5 * (lo + hi)
        if np.mean(_sigmoid(logit + mid)) < target:
            lo = mid
        else:
            hi = mid
    return 0.5 * (lo + hi)


def _sigmoid(x: np.ndarray) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-x))


_HEX_DIGITS = np.frombuffer(b"0123456789abcdef", dtype=np.uint8)
_NIBBLE_SHIFTS = np.arange(28, -1, -4, dtype=np.uint64)


def _hex8(values: np.ndarray) -> np.ndarray:
    """uint32-range values -> array of 8-char lowercase hex strings (vectorised)."""
    nibbles = (values.astype(np.uint64)[:, None] >> _NIBBLE_SHIFTS) & np.uint64(0xF)
    chars = np.ascontiguousarray(_HEX_DIGITS[nibbles.astype(np.intp)])
    return chars.view("S8").ravel().astype("U8")


def _format_lines(labels: np.ndarray, chunk: _Chunk, keys: _Keys) -> str:
    counts = np.floor(np.expm1(np.maximum(_INT_LOG_MEAN + _INT_LOG_STD * chunk.z, 0.0)))
    counts = np.minimum(counts, _INT_MAX).astype(np.int64)
    columns: List[List[str]] = [labels.astype(np.int64).astype(str).tolist()]
    for j in range(NUM_INT_FEATURES):
        text = counts[:, j].astype(str)
        columns.append(np.where(chunk.int_missing[:, j], "", text).tolist())
    for f in range(NUM_CAT_FEATURES):
        text = _hex8(mix32(chunk.ranks[:, f], keys.hash_keys[f]))
        columns.append(np.where(chunk.cat_missing[:, f], "", text).tolist())
    return "".join("\t".join(row) + "\n" for row in zip(*columns))


def generate(
    spec: SyntheticCriteoSpec, out_dir: Union[str, Path], progress: bool = True
) -> List[Path]:
    """Writes ``spec.num_files`` Criteo TSV files into ``out_dir`` and returns their paths.

    Each file is written to a temporary name and renamed at the end, so a path that exists
    is always complete. File ``i`` uses its own RNG stream, so the output depends only on
    the spec, not on chunking or on which files were written before. The spec is written
    last, to ``out_dir/spec.json`` (:data:`SPEC_FILE`), so that :func:`read_generated`
    finds only complete data sets.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    keys = _Keys.from_seed(spec.seed)
    bias = _calibrate_bias(spec, keys)
    cards = spec.cardinalities()
    paths: List[Path] = []
    bar = tqdm(total=spec.num_samples, unit="rows", desc="synthetic criteo", disable=not progress)
    with bar:
        for file_idx, (name, rows) in enumerate(zip(spec.file_names(), spec.rows_per_file())):
            rng = np.random.default_rng(np.random.SeedSequence([spec.seed, 0xF11E, file_idx]))
            final = out / name
            tmp = out / f".{name}.{os.getpid()}.partial"
            with open(tmp, "w", encoding="ascii", newline="") as fh:
                for start in range(0, rows, _CHUNK_ROWS):
                    n = min(_CHUNK_ROWS, rows - start)
                    chunk = _draw_chunk(rng, n, cards, spec.zipf_alpha)
                    if start == 0:
                        # TorchRec's tsv_to_npys shifts integers by the *file's* minimum
                        # before the log; an empty field reads as 0 and counts are >= 0,
                        # so forcing one empty field pins every file's minimum to 0 and
                        # keeps the dense transform identical across day files.
                        chunk.int_missing[0, 0] = True
                    logit = bias + _logits_without_bias(chunk, keys)
                    labels = rng.random(n) < _sigmoid(logit)
                    fh.write(_format_lines(labels, chunk, keys))
                    bar.update(n)
            os.replace(tmp, final)
            paths.append(final)
    tmp = out / f".{SPEC_FILE}.{os.getpid()}.partial"
    tmp.write_text(spec_json(spec))
    os.replace(tmp, out / SPEC_FILE)
    return paths


def spec_json(spec: SyntheticCriteoSpec) -> str:
    """The spec as written to :data:`SPEC_FILE` (sorted keys, so equal specs read equal)."""
    return json.dumps(asdict(spec), sort_keys=True)


def read_generated(directory: Union[str, Path]) -> Optional[Tuple[SyntheticCriteoSpec, List[Path]]]:
    """The spec and files of the complete data set :func:`generate` wrote into ``directory``,
    or ``None`` if there is none (no :data:`SPEC_FILE`, or a file it lists is missing)."""
    stamp = Path(directory) / SPEC_FILE
    if not stamp.is_file():
        return None
    try:
        spec = SyntheticCriteoSpec(**json.loads(stamp.read_text()))
    except (ValueError, TypeError):  # not ours, or from an incompatible version: regenerate
        return None
    paths = [Path(directory) / name for name in spec.file_names()]
    return (spec, paths) if all(p.is_file() for p in paths) else None
