"""The lane server fixture the lane tests share (lane_util.served)."""

from .lane_util import served  # noqa: F401 - registered as a fixture here
