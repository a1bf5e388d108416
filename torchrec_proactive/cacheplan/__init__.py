"""Cache sizes chosen from the data: measured miss-ratio curves (``curve``), the profile of a
run's data set (``profile``) and TorchRec's planner with proactive costs (``planner``)."""

from .curve import MissRatioCurve
from .planner import CacheBudgetError, plan_cache_sizes
from .profile import profile_batches

__all__ = ["MissRatioCurve", "CacheBudgetError", "plan_cache_sizes", "profile_batches"]
