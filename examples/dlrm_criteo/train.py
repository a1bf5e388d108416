"""Train DLRM or DCNv2 on Criteo with proactive cold-row fetching.

    # 2 local CPU ranks on generated Criteo-format data (generated on first use)
    python examples/dlrm_criteo/train.py --nproc 2 experiment=debug_2rank

    # any config group or field from conf/ can be overridden
    python examples/dlrm_criteo/train.py --nproc 2 model=dcnv2_terabyte model.embedding_dim=16 \
        'model.dense_arch_layer_sizes=[64,16]' prefetch=auto sharding=row_wise train.max_steps=200

    # one process per rank under torchrun (or torchx: see README.md)
    torchrun --nproc_per_node 8 examples/dlrm_criteo/train.py experiment=kaggle_proactive \
        data.root=/data/criteo_kaggle

    # continue from the latest complete checkpoint of the same run directory
    python examples/dlrm_criteo/train.py --nproc 2 experiment=debug_2rank train.resume=true

What a rank does is ``torchrec_proactive.app.train.build_run``: data (generate +
preprocess on rank 0), ``DLRMTrain`` with meta-device tables, the proactive sharder and
plan, ``DistributedModelParallel``, the fused + dense optimizer and
``ProactiveTrainPipeline``; then the loop in ``torchrec_proactive/app/loop.py`` (AUROC and
log loss on the held-out split, samples/s, stall, hit rate, checkpoints).
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Optional, Sequence


def parse_args(argv: Optional[Sequence[str]]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--nproc", type=int, default=1, help="local ranks to spawn (ignored under torchrun)")
    p.add_argument("--config-dir", default=None,
                   help="a config directory added after the packaged configs (e.g. one experiment file)")
    p.add_argument("overrides", nargs="*", default=[],
                   help="Hydra overrides, e.g. experiment=debug_2rank prefetch=auto")
    return p.parse_args(argv)


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Trains; prints the run's result as the last line on stdout (the JSON of
    ``torchrec_proactive.app.result.TrainResult``, the same line as ``torchrec-proactive train``)."""
    args = parse_args(argv)
    from torchrec_proactive.app.entry import train_for_script

    # composes first (bad overrides fail before any rank starts), refuses a run directory
    # that holds another run unless train.resume=true, then launches the ranks
    return train_for_script(os.path.basename(sys.argv[0]), args.overrides, nproc=args.nproc,
                            config_dir=args.config_dir)


if __name__ == "__main__":
    sys.exit(main())
