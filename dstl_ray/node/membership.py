"""The root's membership watcher (docs/architecture.md "Tree": the tree is static between
membership changes): every ``membership_interval_s`` it brings the tree in line with Ray's
alive nodes. What that takes (placing actors) is ``topology.membership.reconcile``, handed in
by whoever places the tree: this package never imports ``topology``."""

from __future__ import annotations

import asyncio
import logging
from typing import Protocol

from ..config import ChangelogConfig
from .peers import Place

log = logging.getLogger(__name__)


class Reconcile(Protocol):
    """``topology.membership.reconcile``: the (new) node order, after attaching nodes that
    joined Ray as leaves and re-attaching the children of nodes that left."""

    def __call__(self, base_path: str, config: ChangelogConfig,
                 order: list[str] | None) -> list[str]: ...


class MembershipWatcher:
    """Root only: the tree's node order, and the task that keeps the tree up to date."""

    def __init__(self, place: Place, base_path: str, config: ChangelogConfig,
                 reconcile: Reconcile | None) -> None:
        self.place = place
        self.base_path = base_path
        self.config = config
        self.reconcile = reconcile
        self.order: list[str] | None = None  # root only: the tree's node order
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        """Start (once) on the root, when the tree gave a way to reconcile."""
        if (self.place.parent is None and self._task is None and self.reconcile is not None
                and self.config.membership_interval_s > 0):
            self._task = asyncio.get_running_loop().create_task(self._watch())

    async def _watch(self) -> None:
        """Root only: attach nodes that joined Ray as leaves; re-attach the children of
        nodes that left."""
        assert self.reconcile is not None
        while self.place.parent is None:
            await asyncio.sleep(self.config.membership_interval_s)
            try:
                self.order = await asyncio.to_thread(
                    self.reconcile, self.base_path, self.config, self.order)
            except Exception as e:  # noqa: BLE001 - try again next round
                log.warning("%s: membership check failed: %s", self.place.name, e)

    def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
