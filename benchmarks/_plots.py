"""matplotlib for the benchmarks' plots, when it is installed (``pip install -e '.[bench]'``)."""

from __future__ import annotations

import sys
from types import ModuleType


def pyplot() -> ModuleType | None:
    """``matplotlib.pyplot`` on the Agg backend, or ``None`` (and a line on stderr saying how to
    install it): a benchmark without matplotlib still writes its JSON and tables."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed (pip install -e '.[bench]'): no plot", file=sys.stderr)
        return None
    return plt
