"""Row-sparse optimizers applied to cached rows in backward ("fused" optimizers).

They reproduce the update rules of FBGEMM's ``EmbOptimType`` variants for rows that
received a gradient in the step (rows without a gradient are not touched, as in FBGEMM):

* ``EXACT_SGD``:             w -= lr * g
* ``EXACT_ADAGRAD``:         m += g*g;            w -= lr * g / (sqrt(m) + eps)
* ``EXACT_ROWWISE_ADAGRAD``: m += mean(g*g, row); w -= lr * g / (sqrt(m) + eps)   (m is one float per row)
* ``ADAM``:                  m1 = b1*m1 + (1-b1)*g; m2 = b2*m2 + (1-b2)*g*g;
                             w -= lr * (m1/(1-b1^t) / (sqrt(m2/(1-b2^t)) + eps) + wd * w)

``g`` is the gradient of the row summed over every occurrence in the batch (all features
sharing the table), exactly as FBGEMM aggregates before it updates. With ``weight_decay``
and the L2 mode of FBGEMM, the Adagrad variants and SGD use ``g + wd * w``.

Optimizer state lives next to its row: it moves between host and device with the row,
so every state tensor has the row as its first dimension.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass
from typing import Any, Dict, Mapping, Optional, Tuple

import torch


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


@dataclass(frozen=True)
class OptimizerConfig:
    """Hyper-parameters of a fused row optimizer (FBGEMM's names and defaults)."""

    optim: OptimType = OptimType.EXACT_SGD
    learning_rate: float = 0.01
    eps: float = 1.0e-8
    beta1: float = 0.9
    beta2: float = 0.999
    weight_decay: float = 0.0

    def __post_init__(self) -> None:
        if not (self.learning_rate >= 0 and math.isfinite(self.learning_rate)):
            raise ValueError(f"learning_rate must be finite and >= 0, got {self.learning_rate}")
        if self.eps <= 0:
            raise ValueError(f"eps must be > 0, got {self.eps}")
        for name in ("beta1", "beta2"):
            v = getattr(self, name)
            if not 0.0 <= v < 1.0:
                raise ValueError(f"{name} must be in [0, 1), got {v}")

    @classmethod
    def from_fused_params(cls, fused_params: Mapping[str, Any]) -> "OptimizerConfig":
        """Builds the config from TorchRec ``fused_params`` (``optimizer``, ``learning_rate``, ...)."""
        return cls(
            optim=OptimType.parse(fused_params.get("optimizer", OptimType.EXACT_SGD)),
            learning_rate=float(fused_params.get("learning_rate", 0.01)),
            eps=float(fused_params.get("eps", 1.0e-8)),
            beta1=float(fused_params.get("beta1", 0.9)),
            beta2=float(fused_params.get("beta2", 0.999)),
            weight_decay=float(fused_params.get("weight_decay", 0.0)),
        )

    def state_shapes(self, dim: int) -> Dict[str, Tuple[int, ...]]:
        """Per-row shapes of the optimizer state tensors (FBGEMM's ``momentum*`` names)."""
        if self.optim is OptimType.EXACT_SGD:
            return {}
        if self.optim is OptimType.EXACT_ADAGRAD:
            return {"momentum1": (dim,)}
        if self.optim is OptimType.EXACT_ROWWISE_ADAGRAD:
            return {"momentum1": ()}
        return {"momentum1": (dim,), "momentum2": (dim,)}


def _row_change(
    cfg: OptimizerConfig,
    grad: torch.Tensor,
    state: Dict[str, torch.Tensor],
    step: int,
    weight: Optional[torch.Tensor],
) -> torch.Tensor:
    """The change to add to the rows (``state`` rows are updated in place). ``weight`` is read
    only with weight decay. The sign is folded into the learning rate (negation is exact), so
    callers add the change: one ``index_add_`` on its fast path, without ``alpha``."""
    neg_lr = -cfg.learning_rate
    if cfg.optim is not OptimType.ADAM and cfg.weight_decay:
        grad = grad + cfg.weight_decay * weight
    if cfg.optim is OptimType.EXACT_SGD:
        return grad * neg_lr
    if cfg.optim is OptimType.EXACT_ADAGRAD:
        m = state["momentum1"]
        m.add_(grad * grad)
        return neg_lr * grad / (m.sqrt() + cfg.eps)
    if cfg.optim is OptimType.EXACT_ROWWISE_ADAGRAD:
        m = state["momentum1"]
        m.add_((grad * grad).mean(dim=1))
        return (neg_lr / (m.sqrt() + cfg.eps)).unsqueeze(1) * grad
    m1, m2 = state["momentum1"], state["momentum2"]
    m1.mul_(cfg.beta1).add_(grad, alpha=1.0 - cfg.beta1)
    m2.mul_(cfg.beta2).addcmul_(grad, grad, value=1.0 - cfg.beta2)
    m1_hat = m1 / (1.0 - cfg.beta1**step)
    m2_hat = m2 / (1.0 - cfg.beta2**step)
    update = m1_hat / (m2_hat.sqrt() + cfg.eps)
    if cfg.weight_decay:
        update = update + cfg.weight_decay * weight
    return neg_lr * update


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
        step: 1-based count of optimizer steps taken on this table (Adam's bias correction).
    """
    weight.add_(_row_change(cfg, grad, state, step, weight))


@torch.no_grad()
def update_rows(
    cfg: OptimizerConfig,
    weight: torch.Tensor,
    state: Dict[str, torch.Tensor],
    index: torch.Tensor,
    grad: torch.Tensor,
    step: int,
) -> None:
    """Updates rows ``index`` (unique) of the tables ``weight``/``state`` in place with ``grad``:
    the rule of :func:`apply_row_update`, with the weight change added by one ``index_add_``
    (the rows are gathered only when weight decay reads them)."""
    gathered = {k: v.index_select(0, index) for k, v in state.items()}
    rows = weight.index_select(0, index) if cfg.weight_decay else None
    weight.index_add_(0, index, _row_change(cfg, grad, gathered, step, rows))
    for k, v in gathered.items():
        state[k].index_copy_(0, index, v)
