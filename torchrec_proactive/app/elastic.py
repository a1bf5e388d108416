"""What a torchelastic agent (torchrun, so torchx and Slurm jobs) reports when a rank fails.

The agent prints a failure summary naming the first rank that failed and, as its root
cause, what that rank wrote to its error file (``TORCHELASTIC_ERROR_FILE``, set by the
agent); torchx shows the same as the app's structured error message. Without an error
file the summary says ``error_file: <N/A>`` and the real message is buried in the logs.

torch is imported only under an agent (the CLI reports config mistakes before torch loads).
"""

from __future__ import annotations

import json
import os
import time
from typing import Callable, TypeVar

_F = TypeVar("_F", bound=Callable[..., int])

ERROR_FILE_ENV = "TORCHELASTIC_ERROR_FILE"


def under_agent() -> bool:
    """True when a torchelastic agent started this process and collects its error file."""
    return bool(os.environ.get(ERROR_FILE_ENV))


def recorded(main: _F) -> _F:
    """``main`` wrapped with torchelastic's ``record`` under an agent (an exception that
    escapes it becomes the root cause the agent reports); ``main`` itself otherwise."""
    if not under_agent():
        return main
    from torch.distributed.elastic.multiprocessing.errors import record

    return record(main)  # type: ignore[return-value]


def record_user_error(message: str) -> None:
    """Writes ``message`` (one line, no traceback) as this process's root cause, in the
    error file format torchelastic's ``ErrorHandler`` reads (``message.message``, with
    ``extraInfo.py_callstack`` the text its summary shows). A no-op without an agent.

    For the mistakes the CLI reports as one line and exit code 2 (which ``record`` does not
    see: they are not exceptions once the CLI has handled them)."""
    path = os.environ.get(ERROR_FILE_ENV)
    if not path:
        return
    data = {"message": {"message": message,
                        "extraInfo": {"py_callstack": message, "timestamp": str(int(time.time()))}}}
    try:
        with open(path, "w") as fh:
            json.dump(data, fh)
    except OSError:
        pass  # the message is on stderr anyway; the agent then reports the exit code only
