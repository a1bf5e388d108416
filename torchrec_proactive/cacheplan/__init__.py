"""Cache sizes chosen from the data: measured miss-ratio curves (``curve``), the profile of a
run's data set (``profile``) and TorchRec's planner with proactive costs (``planner``)."""
