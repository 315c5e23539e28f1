"""Children that do not outlive their parent, for programs we cannot teach to watch it.

Our own services watch the pid in ``dualpath.runtime.PARENT_ENV`` and stop when it is gone.
A foreign binary (``nats-server``) cannot, so a ``dualpath up`` or a test run killed with
SIGKILL would leave its server running. On Linux the kernel can do the watching:
``prctl(PR_SET_PDEATHSIG, SIGTERM)`` in the child, between fork and exec, makes the kernel
send SIGTERM when the parent goes.

The kernel ties that signal to the *thread* that forked, not the process: a child forked by
a short-lived worker thread would be stopped when that thread ends. So the hook is only
given when the caller is the main thread (which lives as long as the process); elsewhere,
and on other systems, ``die_with_parent()`` returns None and the child is started without it.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import threading
from collections.abc import Callable

__all__ = ["die_with_parent"]

_PR_SET_PDEATHSIG = 1


def die_with_parent(sig: int = signal.SIGTERM) -> Callable[[], None] | None:
    """A ``preexec_fn`` for ``subprocess.Popen`` that has the kernel send ``sig`` to the child
    when this process dies; None where that cannot be done safely (module docstring)."""
    if not sys.platform.startswith("linux") or threading.current_thread() is not threading.main_thread():
        return None
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        prctl = libc.prctl
    except (OSError, AttributeError):
        return None
    parent = os.getpid()

    def _hook() -> None:  # runs in the child between fork and exec: no locks, no allocation-heavy work
        prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0)
        if os.getppid() != parent:  # the parent died before the hook ran: nobody will signal us
            os._exit(1)

    return _hook
