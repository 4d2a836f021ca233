"""matplotlib for the few commands that draw (``dstl-ray trace``, ``dstl-ray demo``): an
optional dependency, the ``plot`` extra, so that the runtime on every Ray node stays light.
Nothing in the packages imports matplotlib at module level."""

from __future__ import annotations

from typing import Any

from .errors import MissingDependencyError

INSTALL_HINT = "pip install 'dstl-ray[plot]'"


def pyplot(purpose: str) -> Any:
    """``matplotlib.pyplot`` on the Agg backend (files, no display), or
    :class:`MissingDependencyError` naming ``purpose`` and the extra to install."""
    try:
        import matplotlib
    except ImportError as e:
        raise MissingDependencyError(
            f"{purpose} needs matplotlib, which is not installed: {INSTALL_HINT}") from e
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt
