"""Linear warm-up of the dense learning rate, as TorchRec's reference DLRM trainer does
(``--lr_warmup_steps`` of ``dlrm_main.py``).

Adaptive dense optimizers (Adagrad, Adam) move every weight by about the learning rate on
their first step, whatever the gradient's size; on wide MLPs that alone can throw the
logits far off (a loss in the thousands at step 2). Ramping the rate up over the first
steps lets the optimizer's statistics build up first.

The rate is a function of the step number only (no state), so a resumed run continues
the same schedule and the prefetch depth never changes it.
"""

from __future__ import annotations

from typing import Any, List


class DenseWarmup:
    """Sets the dense optimizer's learning rate for each step: training step ``s``
    (1-based) uses ``lr * min(1, s / steps)``; ``steps=0`` leaves the rate alone.

    The fused embedding optimizers are not touched (their rate lives in the kernels)."""

    def __init__(self, optimizer: Any, lr: float, steps: int) -> None:
        self.optimizer, self.lr, self.steps = optimizer, lr, steps

    def factor(self, step: int) -> float:
        return 1.0 if self.steps <= 0 else min(1.0, step / self.steps)

    def before_step(self, step: int) -> None:
        """Call before training step ``step`` (1-based) runs."""
        if self.steps <= 0:
            return
        # looked up every time: loading a checkpoint replaces the param group dicts
        for group in dense_param_groups(self.optimizer):
            group["lr"] = self.lr * self.factor(step)


def dense_param_groups(optimizer: Any) -> List[dict]:
    """The param groups of the dense (non-fused) part of a TorchRec ``CombinedOptimizer``:
    those of every wrapped ``torch.optim`` optimizer (``KeyedOptimizerWrapper``)."""
    from torchrec.optim.keyed import CombinedOptimizer, KeyedOptimizerWrapper

    parts = [opt for _, opt in optimizer.optimizers] if isinstance(optimizer, CombinedOptimizer) else [optimizer]
    return [g for opt in parts if isinstance(opt, KeyedOptimizerWrapper) for g in opt.param_groups]
