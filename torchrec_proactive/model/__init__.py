"""The step model the product plans with, and the hardware profiles and workloads it projects to.

:mod:`.step_model` (a training step's stages, reactive or proactive, and the schedule of the
copies behind it) is what :mod:`torchrec_proactive.cacheplan.planner` charges a cached
shard's fetch with; :mod:`.hardware` holds published system figures with their sources.
The scaling study (:mod:`torchrec_proactive.bench.scaling_study`) validates this model on
measured runs and projects it; the bench imports the model, never the reverse.
Nothing here measures time.
"""
