"""Row-sparse optimizers applied to cached rows in backward ("fused" optimizers).

They reproduce FBGEMM's TBE update rules (``EmbOptimType``; the CUDA kernels where FBGEMM's
CPU kernels differ) for the rows that received a gradient in the step (rows without a
gradient are not touched, as in FBGEMM). ``g`` is the gradient of the row summed over every
occurrence in the batch (all features sharing the table), as FBGEMM aggregates it; with
``gradient_clipping`` FBGEMM first clamps the *pooled output's* gradient to
``[-max_gradient, max_gradient]`` (:func:`clip_output_gradient`), before that sum.

* ``EXACT_SGD``:             w -= lr * g                                   (weight_decay ignored)
* ``EXACT_ADAGRAD``:         m += g*g;  w -= lr * g / (sqrt(m) + eps)       (weight_decay ignored)
* ``EXACT_ROWWISE_ADAGRAD``: by ``weight_decay_mode`` (NONE by default: weight_decay ignored)
      L2:       m += mean((g + wd*w)^2);  k = lr / (sqrt(m) + eps);  w = (1 - k*wd) * w - k * g
      DECOUPLE: m += mean(g^2);           k = lr / (sqrt(m) + eps);  w = (1 - lr*wd) * w - k * g
      then, with ``max_norm > 0``, a row whose norm exceeds it is scaled down to it (CUDA rule)
* ``ADAM``:                  m1 = b1*m1 + (1-b1)*g;  m2 = b2*m2 + (1-b2)*g*g;
      w -= lr * (m1/(1-b1^t) / (sqrt(m2/(1-b2^t)) + eps) + wd * w)     (any weight_decay_mode)
      ``t`` is the table's step counter, which FBGEMM advances on every forward (eval too).

The arithmetic runs in FP32 whatever the table's dtype; the new row is rounded once into the
table's dtype (:func:`round_rows`): to nearest (FBGEMM's CPU kernel), or stochastically for
FP16 tables when ``stochastic_rounding`` is on (FBGEMM's CUDA kernels; the caller chooses).
docs/optimizers.md has the table of every parameter.

Optimizer state lives next to its row: it moves between host and device with the row,
so every state tensor has the row as its first dimension.
"""

from __future__ import annotations

import enum
import math
import warnings
from dataclasses import dataclass
from typing import Any, Dict, Mapping, Optional, Tuple

import torch

from .stochastic_rounding import (  # noqa: F401 - the rounding rule's public names, here as before
    round_rows,
    rounding_bits,
    stochastic_round_fp16,
)


class OptimType(str, enum.Enum):
    """Names match ``fbgemm_gpu.split_embedding_configs.EmbOptimType`` values."""

    EXACT_SGD = "exact_sgd"
    EXACT_ADAGRAD = "exact_adagrad"
    EXACT_ROWWISE_ADAGRAD = "exact_row_wise_adagrad"
    ADAM = "adam"

    @classmethod
    def parse(cls, value: Any) -> "OptimType":
        """Accepts an ``OptimType``, an FBGEMM ``EmbOptimType`` or their string value."""
        raw = getattr(value, "value", value)
        try:
            return cls(str(raw).lower())
        except ValueError:
            known = ", ".join(m.value for m in cls)
            raise ValueError(f"unsupported fused optimizer {value!r}; supported: {known}") from None


class WeightDecayMode(enum.IntEnum):
    """FBGEMM's ``WeightDecayMode`` values that need no extra configuration."""

    NONE = 0
    L2 = 1
    DECOUPLE = 2

    @classmethod
    def parse(cls, value: Any) -> "WeightDecayMode":
        """Accepts FBGEMM's ``WeightDecayMode``, its int value or its name."""
        raw = getattr(value, "value", value)
        try:
            return cls(int(raw)) if not isinstance(raw, str) else cls[raw.upper()]
        except (KeyError, ValueError):
            name = getattr(value, "name", value)
            raise ValueError(
                f"fused param weight_decay_mode={name!r} is not supported; supported: "
                f"{', '.join(m.name for m in cls)} (FBGEMM's COUNTER, COWCLIP and DECOUPLE_GLOBAL need "
                f"per-row counters the tiered store does not keep)"
            ) from None


# Fused params that steer the update and the fused params FBGEMM's TBE would take them from.
_FUSED_KEYS = ("learning_rate", "eps", "beta1", "beta2", "weight_decay", "weight_decay_mode",
               "gradient_clipping", "max_gradient", "max_norm", "stochastic_rounding")


@dataclass(frozen=True)
class OptimizerConfig:
    """Hyper-parameters of a fused row optimizer (FBGEMM's TBE names and defaults).

    ``weight_decay`` is read only where FBGEMM reads it: ``ADAM`` always, row-wise Adagrad
    per ``weight_decay_mode``; SGD and Adagrad ignore it. ``stochastic_rounding`` applies to
    FP16 tables on CUDA only, keyed by ``(rounding_seed, step, row, column)`` so that a run is
    reproducible and independent of which cache slot holds a row.
    """

    optim: OptimType = OptimType.EXACT_SGD
    learning_rate: float = 0.01
    eps: float = 1.0e-8
    beta1: float = 0.9
    beta2: float = 0.999
    weight_decay: float = 0.0
    weight_decay_mode: WeightDecayMode = WeightDecayMode.NONE
    gradient_clipping: bool = False
    max_gradient: float = 1.0
    max_norm: float = 0.0
    stochastic_rounding: bool = True
    rounding_seed: int = 0

    def __post_init__(self) -> None:
        if not (self.learning_rate >= 0 and math.isfinite(self.learning_rate)):
            raise ValueError(f"learning_rate must be finite and >= 0, got {self.learning_rate}")
        if self.eps <= 0:
            raise ValueError(f"eps must be > 0, got {self.eps}")
        for name in ("beta1", "beta2"):
            v = getattr(self, name)
            if not 0.0 <= v < 1.0:
                raise ValueError(f"{name} must be in [0, 1), got {v}")
        if not math.isfinite(self.weight_decay):
            raise ValueError(f"weight_decay must be finite, got {self.weight_decay}")
        if self.gradient_clipping and not self.max_gradient > 0:
            raise ValueError(f"max_gradient must be > 0 with gradient_clipping, got {self.max_gradient}")
        if not self.max_norm >= 0:
            raise ValueError(f"max_norm must be >= 0, got {self.max_norm}")
        object.__setattr__(self, "weight_decay_mode", WeightDecayMode.parse(self.weight_decay_mode))

    @classmethod
    def from_fused_params(cls, fused_params: Mapping[str, Any]) -> "OptimizerConfig":
        """Builds the config from TorchRec ``fused_params`` (``optimizer``, ``learning_rate``, ...),
        with FBGEMM's TBE defaults for what is not given."""
        d = cls()
        get = fused_params.get
        cfg = cls(
            optim=OptimType.parse(get("optimizer", OptimType.EXACT_SGD)),
            learning_rate=float(get("learning_rate", d.learning_rate)),
            eps=float(get("eps", d.eps)),
            beta1=float(get("beta1", d.beta1)),
            beta2=float(get("beta2", d.beta2)),
            weight_decay=float(get("weight_decay", d.weight_decay)),
            weight_decay_mode=WeightDecayMode.parse(get("weight_decay_mode", d.weight_decay_mode)),
            gradient_clipping=bool(get("gradient_clipping", d.gradient_clipping)),
            max_gradient=float(get("max_gradient", d.max_gradient)),
            max_norm=float(get("max_norm", d.max_norm)),
            stochastic_rounding=bool(get("stochastic_rounding", d.stochastic_rounding)),
        )
        if cfg.weight_decay and cfg.decay_rule == "none":
            warnings.warn(
                f"fused param weight_decay={cfg.weight_decay} is ignored by {cfg.optim.name}"
                + (f" with weight_decay_mode={cfg.weight_decay_mode.name}" if cfg.optim is OptimType.EXACT_ROWWISE_ADAGRAD
                   else "") + ", as FBGEMM's kernels ignore it (see docs/optimizers.md)",
                stacklevel=2,
            )
        return cfg

    @property
    def decay_rule(self) -> str:
        """What FBGEMM does with ``weight_decay`` for this optimizer: ``none``, ``l2``,
        ``decoupled`` (row-wise Adagrad) or ``adam`` (``lr * wd * w`` inside Adam's step)."""
        if not self.weight_decay:
            return "none"
        if self.optim is OptimType.ADAM:
            return "adam"
        if self.optim is OptimType.EXACT_ROWWISE_ADAGRAD:
            return {WeightDecayMode.NONE: "none", WeightDecayMode.L2: "l2",
                    WeightDecayMode.DECOUPLE: "decoupled"}[self.weight_decay_mode]
        return "none"

    @property
    def renorms(self) -> bool:
        """Row-wise Adagrad's ``max_norm`` (FBGEMM applies it in its CUDA kernel only)."""
        return self.optim is OptimType.EXACT_ROWWISE_ADAGRAD and self.max_norm > 0

    def state_shapes(self, dim: int) -> Dict[str, Tuple[int, ...]]:
        """Per-row shapes of the optimizer state tensors (FBGEMM's ``momentum*`` names)."""
        if self.optim is OptimType.EXACT_SGD:
            return {}
        if self.optim is OptimType.EXACT_ADAGRAD:
            return {"momentum1": (dim,)}
        if self.optim is OptimType.EXACT_ROWWISE_ADAGRAD:
            return {"momentum1": ()}
        return {"momentum1": (dim,), "momentum2": (dim,)}


def clip_output_gradient(cfg: OptimizerConfig, grad: torch.Tensor) -> torch.Tensor:
    """FBGEMM's ``gradient_clipping``: the gradient of the pooled output, clamped element-wise
    to ``[-max_gradient, max_gradient]`` before it is summed per row (CPU and CUDA alike; the
    sample-weight gradient is computed from the clamped one too)."""
    if not cfg.gradient_clipping:
        return grad
    return grad.clamp(-cfg.max_gradient, cfg.max_gradient)


def _row_change(
    cfg: OptimizerConfig,
    grad: torch.Tensor,
    state: Dict[str, torch.Tensor],
    step: int,
    weight: Optional[torch.Tensor],
    scratch_grad: bool = False,
) -> Tuple[Optional[torch.Tensor], torch.Tensor]:
    """``(scale, change)`` with the new rows ``scale * w + change`` (``scale`` None: 1), all in
    FP32; ``state`` rows are updated in place. ``weight`` (FP32) is read only when the rule
    reads it (``cfg.decay_rule``). The sign is folded into the learning rate (negation is
    exact), so a rule without ``scale`` is one ``index_add_`` on the caller's fast path.
    ``scratch_grad``: ``grad`` may be overwritten (it becomes ``change``). Temporaries are
    reused in place: the same values as the out-of-place forms, with fewer bytes moved."""
    neg_lr = -cfg.learning_rate
    if cfg.optim is OptimType.EXACT_SGD:
        return None, grad.mul_(neg_lr) if scratch_grad else grad * neg_lr
    if cfg.optim is OptimType.EXACT_ADAGRAD:
        m = state["momentum1"]
        m.add_(grad.square())
        denom = m.sqrt().add_(cfg.eps)
        change = grad.mul_(neg_lr) if scratch_grad else neg_lr * grad
        return None, change.div_(denom)
    if cfg.optim is OptimType.EXACT_ROWWISE_ADAGRAD:
        rule = cfg.decay_rule
        decayed = grad + cfg.weight_decay * weight if rule == "l2" else grad
        m = state["momentum1"]
        m.add_(decayed.square().mean(dim=1))  # (square is x * x, reading x once)
        multiplier = cfg.learning_rate / (m.sqrt() + cfg.eps)
        # FBGEMM: correction * w - multiplier * g
        change = grad.mul_((-multiplier).unsqueeze(1)) if scratch_grad else (-multiplier).unsqueeze(1) * grad
        if rule == "l2":
            return (1.0 - multiplier * cfg.weight_decay).unsqueeze(1), change
        if rule == "decoupled":
            # FBGEMM holds the learning rate in an FP32 tensor and forms this in double.
            lr32 = float(torch.tensor(cfg.learning_rate, dtype=torch.float32))
            return torch.full_like(multiplier, 1.0 - lr32 * cfg.weight_decay).unsqueeze(1), change
        return None, change
    m1, m2 = state["momentum1"], state["momentum2"]
    m1.mul_(cfg.beta1).add_(grad, alpha=1.0 - cfg.beta1)
    m2.mul_(cfg.beta2).addcmul_(grad, grad, value=1.0 - cfg.beta2)
    # m1_hat / (sqrt(m2_hat) + eps), each step in place on its own temporary.
    denom = (m2 / (1.0 - cfg.beta2**step)).sqrt_().add_(cfg.eps)
    update = (m1 / (1.0 - cfg.beta1**step)).div_(denom)
    if cfg.decay_rule == "adam":
        update.add_(cfg.weight_decay * weight)
    return None, update.mul_(neg_lr)


@torch.no_grad()
def apply_row_update(
    cfg: OptimizerConfig,
    weight: torch.Tensor,
    grad: torch.Tensor,
    state: Dict[str, torch.Tensor],
    step: int,
) -> None:
    """Updates ``weight`` and ``state`` (gathered rows, updated in place) with ``grad``.

    Args:
        weight: ``[n, dim]`` rows to update.
        grad: ``[n, dim]`` gradient per row, already summed over the batch.
        state: optimizer state rows, first dimension ``n``.
        step: 1-based value of the table's step counter (Adam's bias correction).
    """
    update_rows(cfg, weight, state, torch.arange(weight.shape[0], device=weight.device), grad, step)


@torch.no_grad()
def update_rows(
    cfg: OptimizerConfig,
    weight: torch.Tensor,
    state: Dict[str, torch.Tensor],
    index: torch.Tensor,
    grad: torch.Tensor,
    step: int,
    stochastic_rows: Optional[torch.Tensor] = None,
    target: Optional[torch.Tensor] = None,
    scratch_grad: bool = False,
) -> None:
    """Updates rows ``index`` (unique) of the tables ``weight``/``state`` in place with ``grad``.

    ``target`` (default ``index``): where the new rows are written. A caller that must drop
    an update without reading a flag on the host points it at scratch rows (the device
    table's trash slots) instead of copying and selecting every row it touches.

    The update is computed in FP32 and each new row rounded once into ``weight``'s dtype
    (see :func:`round_rows`; ``stochastic_rows``: the ids of the updated rows, to round FP16
    stochastically). An FP32 table whose rule reads no weight takes the change with one
    ``index_add_`` (the rows are gathered only when needed). ``scratch_grad``: ``grad`` is
    the caller's scratch and may be overwritten.
    """
    scratch = scratch_grad or grad.dtype != torch.float32
    g = grad if grad.dtype == torch.float32 else grad.float()
    gathered = {k: v.index_select(0, index) for k, v in state.items()}
    reads_weight = cfg.decay_rule != "none"
    if weight.dtype == torch.float32 and not reads_weight and not cfg.renorms:
        _, change = _row_change(cfg, g, gathered, step, None, scratch)
        # (where ``target`` differs from ``index`` it points at scratch rows: adding the
        # change there instead is as good as writing the new rows there)
        weight.index_add_(0, index if target is None else target, change)
    else:
        rows = weight.index_select(0, index).float()
        scale, change = _row_change(cfg, g, gathered, step, rows if reads_weight else None, scratch)
        new = (rows if scale is None else scale * rows) + change
        stored = round_rows(new, weight.dtype, stochastic_rows, cfg.rounding_seed, step)
        if cfg.renorms:
            stored = _renorm(cfg, stored, weight.dtype, stochastic_rows, step)
        weight.index_copy_(0, index if target is None else target, stored)
    for k, v in gathered.items():
        state[k].index_copy_(0, index if target is None else target, v)


def _renorm(cfg: OptimizerConfig, stored: torch.Tensor, dtype: torch.dtype,
            stochastic_rows: Optional[torch.Tensor], step: int) -> torch.Tensor:
    """FBGEMM's row-wise Adagrad ``max_norm`` (CUDA): rows whose stored values' norm exceeds
    ``max_norm`` are scaled to it and stored again (a second rounding, as there)."""
    values = stored.float()
    norm = torch.linalg.vector_norm(values, dim=1, keepdim=True)
    scaled = values * torch.where(norm > cfg.max_norm, cfg.max_norm / norm, torch.ones_like(norm))
    # The second store draws fresh noise: FBGEMM's generator has moved on by then.
    again = round_rows(scaled, dtype, stochastic_rows, cfg.rounding_seed ^ 0x5BD1E995, step)
    return torch.where(norm > cfg.max_norm, again, stored)
