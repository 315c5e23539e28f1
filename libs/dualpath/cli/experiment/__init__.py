"""``dualpath experiment offline|online``: the paper's experiments on the real services with
emulated cluster hardware (modes basic / dualpath / oracle on the same stack)."""

from __future__ import annotations

import sys

__all__ = ["main"]


def main(argv: list[str] | None = None) -> int:
    argv = list(argv or [])
    if not argv or argv[0] not in ("offline", "online", "isolation", "soak"):
        print("usage: dualpath experiment offline|online|isolation|soak [flags]  (--help after the name lists them)", file=sys.stderr)
        return 2
    if argv[0] == "soak":  # faults under load: kills while agents are served
        from dualpath.cli.experiment.soak import main as run
    elif argv[0] == "isolation":  # model traffic beside KV traffic on the CNICs, with and without classes
        from dualpath.cli.experiment.isolation import main as run
    elif argv[0] == "offline":
        from dualpath.cli.experiment.offline import main as run
    else:
        from dualpath.cli.experiment.online import main as run
    return run(argv[1:])
