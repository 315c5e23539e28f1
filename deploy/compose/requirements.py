"""Print the project's runtime requirements, one a line, for the image builds.

    python deploy/compose/requirements.py [--without torch ...] [--pyproject PATH]

Both Dockerfiles install dependencies from this list (a cached layer that changes only with
``pyproject.toml``) and the project itself with ``--no-deps`` afterwards, so the images never
drift from the package's dependency list. The control image leaves torch out; the engine
image installs torch first from the PyTorch index its build argument names (CPU or CUDA
wheels), then this list without torch so pip never swaps that wheel for PyPI's.
"""

from __future__ import annotations

import argparse
import re
import sys
import tomllib
from pathlib import Path

__all__ = ["main", "requirement_name", "requirements"]

DEFAULT_PYPROJECT = Path(__file__).resolve().parents[2] / "pyproject.toml"


def requirement_name(spec: str) -> str:
    """The normalised distribution name of a PEP 508 requirement (``"Torch>=2.4"`` -> ``"torch"``)."""
    name = re.split(r"[<>=!~;\[\s(@]", spec.strip(), maxsplit=1)[0]
    return re.sub(r"[-_.]+", "-", name).lower()


def requirements(pyproject: Path = DEFAULT_PYPROJECT, without: tuple[str, ...] = ()) -> list[str]:
    """``[project].dependencies`` of ``pyproject`` minus the distributions named in ``without``.

    Raises:
        FileNotFoundError: ``pyproject`` does not exist.
        KeyError: it has no ``[project].dependencies`` list.
        tomllib.TOMLDecodeError: it is not valid TOML.
    """
    with open(pyproject, "rb") as f:
        deps = tomllib.load(f)["project"]["dependencies"]
    drop = {requirement_name(name) for name in without}
    return [spec for spec in deps if requirement_name(spec) not in drop]


def main(argv: list[str] | None = None) -> int:
    """Print the requirements; returns 0, or 2 when ``--without`` names no dependency."""
    p = argparse.ArgumentParser(prog="requirements.py", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--without", action="append", default=[], help="leave this distribution out (repeatable)")
    p.add_argument("--pyproject", type=Path, default=DEFAULT_PYPROJECT, help="pyproject.toml to read")
    ns = p.parse_args(argv)
    everything = {requirement_name(spec) for spec in requirements(ns.pyproject)}
    unknown = [name for name in ns.without if requirement_name(name) not in everything]
    if unknown:
        # A typo here would silently install what the image must not contain.
        print(f"requirements.py: not a dependency of {ns.pyproject}: {', '.join(unknown)}", file=sys.stderr)
        return 2
    print("\n".join(requirements(ns.pyproject, tuple(ns.without))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
