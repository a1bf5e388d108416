"""Errors the user can fix, and how entry points report them.

A :class:`UserError` is a mistake in the command line, the config, the data or the run
directory. Entry points (the CLI, the example script) print its message as one line on
stderr and exit with :data:`EXIT_USAGE` (2, as argparse does for bad arguments), without
a traceback: the message names the config key, the value and the limit, which is all a
user needs. Anything else is a bug or an environment failure and keeps its traceback.
"""

from __future__ import annotations

from typing import Optional

EXIT_USAGE = 2


class UserError(Exception):
    """A mistake the user can fix; its message is one line naming key, value and limit.

    ``user_error`` is what :func:`torchrec_proactive.launch.run_ranks` looks for (it does
    not import the application layer), so a rank's user error reaches the parent as such.
    """

    user_error = True


class ConfigError(UserError, ValueError):
    """A config value, key, group option or override that is wrong (raised at composition,
    or when a value turns out not to work, e.g. a cache too small for the depth)."""


class CheckpointError(UserError, ValueError):
    """A checkpoint that cannot be loaded: damaged, tampered with, or not one this program
    wrote. The message names the checkpoint and what to do (another one is usually intact)."""


class PeerFailure(RuntimeError):
    """This rank stopped because rank ``origin_rank`` failed (e.g. while preparing data for
    everyone); :func:`~torchrec_proactive.launch.run_ranks` reports the origin's error instead."""

    def __init__(self, message: str, origin_rank: int, user_message: Optional[str] = None) -> None:
        super().__init__(message)
        self.origin_rank = origin_rank
        # Set when the origin's error was a user error: this rank reports it as one too, so
        # the message is the same whichever rank is heard from first.
        self.user_error = user_message is not None
        self.user_message = user_message

    def __str__(self) -> str:
        return self.user_message if self.user_message is not None else super().__str__()
