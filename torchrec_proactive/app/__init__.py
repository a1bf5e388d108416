"""The application layer: DLRM/DCNv2 on Criteo with the proactive sharder and pipeline.

Small factories (data, model, sharding, optimizer, checkpoints, metrics) assembled by
:func:`torchrec_proactive.app.train.run_training`; :mod:`.entry` launches ranks for the CLI,
the example script and torchx. Depends on the core package, never the reverse.
"""
