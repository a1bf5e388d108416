"""Train the sequence recommender (``model=sequence``) with the app, proactive tables and all.

    # 2 local CPU ranks on generated Criteo-format data, with a synthetic user history
    python examples/sequence_recommender/train.py --nproc 2 experiment=ci_tiny

    # any config group or field can be overridden, the history's too
    python examples/sequence_recommender/train.py --nproc 2 experiment=debug_2rank sharding=row_wise \
        model.history_length=16 model.history_rows=50000 model.history_zipf_alpha=1.2

    # one process per rank under torchrun
    torchrun --nproc_per_node 2 examples/sequence_recommender/train.py experiment=debug_2rank

The same as ``torchrec-proactive train ... model=sequence``: this script puts ``model=sequence``
before your overrides (a ``model=`` of yours wins) and runs ``torchrec_proactive.app``'s
``train``. See README.md next to it for the model and the history's distribution.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import List, Optional, Sequence


def overrides_with_model(overrides: Sequence[str]) -> List[str]:
    """``model=sequence`` first, so an explicit ``model=...`` given later wins (Hydra keeps
    the last value of a key)."""
    return ["model=sequence", *overrides]


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Trains; prints the run's result as the last line on stdout (``TrainResult``'s JSON,
    the same line as ``torchrec-proactive train``)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nproc", type=int, default=1, help="local ranks to spawn (ignored under torchrun)")
    p.add_argument("overrides", nargs="*", default=[], help="Hydra overrides, e.g. experiment=ci_tiny")
    args = p.parse_args(argv)
    from torchrec_proactive.app.entry import train_for_script

    return train_for_script(os.path.basename(sys.argv[0]), overrides_with_model(args.overrides), nproc=args.nproc)


if __name__ == "__main__":
    sys.exit(main())
