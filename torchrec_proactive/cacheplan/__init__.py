"""Cache sizes chosen from the data: measured miss-ratio curves (``curve``), the profile of a
run's data set (``profile``), TorchRec's planner with proactive costs for the device caches
(``planner``), and the host caches of tables on disk under one DRAM budget (``host_plan``)."""

from .curve import MissRatioCurve
from .host_plan import HostBudgetError, HostCachePlan, plan_host_caches
from .planner import CacheBudgetError, plan_cache_sizes
from .profile import profile_batches

__all__ = ["MissRatioCurve", "CacheBudgetError", "plan_cache_sizes", "profile_batches", "HostBudgetError",
           "HostCachePlan", "plan_host_caches"]
