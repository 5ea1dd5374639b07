"""The installed version of Meridian, and the ``--version`` flag every daemon takes."""

from __future__ import annotations

import argparse
from importlib import metadata

DISTRIBUTION = "meridian"


def version() -> str:
    """The version of the installed ``meridian`` distribution (``pyproject.toml``)."""
    try:
        return metadata.version(DISTRIBUTION)
    except metadata.PackageNotFoundError:  # run from a source tree that was never installed
        return "0+unknown"


def add_flag(parser: argparse.ArgumentParser) -> None:
    """``--version``: print ``<prog> <version>`` and exit 0."""
    parser.add_argument(
        "--version",
        action="version",
        version=f"{parser.prog} {version()}",
        help="print the version",
    )
