"""``dstl_ray.deploy``: one node actor per Ray node, arranged as the aggregation tree."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .config import ChangelogConfig
from .errors import NodeUnavailableError
from .storage.base import normalize_url
from .transport.ray import ensure_ray


@dataclass
class ChangelogTree:
    """The deployed tree: node actors by name, with status and shutdown."""

    base_path: str
    config: ChangelogConfig
    nodes: dict[str, Any]  # actor name -> handle
    root: str

    def refresh(self) -> None:
        """Pick up node actors created since (nodes that joined the Ray cluster)."""
        import ray

        from .transport.discovery import list_node_actors

        for name in list_node_actors(self.config.namespace):
            if name not in self.nodes:
                try:
                    self.nodes[name] = ray.get_actor(name, namespace=self.config.namespace)
                except ValueError:
                    pass

    def status(self) -> list[dict[str, Any]]:
        """Per node: level, parent, buffered bytes, files flushed, bytes forwarded, requests."""
        import ray

        self.refresh()
        out = []
        for name, h in self.nodes.items():
            try:
                out.append(ray.get(h.status.remote(), timeout=30))
            except Exception as e:  # noqa: BLE001 - show dead nodes as such
                out.append({"name": name, "error": f"{type(e).__name__}: {e}"})
        return sorted(out, key=lambda s: (s.get("level", 99), s["name"]))

    def node(self, name: str) -> Any:
        return self.nodes[name]

    def shutdown(self) -> None:
        """Kill every node actor of the tree."""
        import ray

        self.refresh()
        # the root first: its membership watcher must not re-create nodes being stopped
        for _, h in sorted(self.nodes.items(), key=lambda kv: kv[0] != self.root):
            try:
                ray.get(h.shutdown.remote(), timeout=10)
            except Exception:  # noqa: BLE001 - killing it anyway
                pass
            try:
                ray.kill(h, no_restart=True)
            except Exception:  # noqa: BLE001
                pass
        self.nodes.clear()


def deploy(base_path: str, config: ChangelogConfig | None = None, *,
           address: str | None = None, detached: bool = True) -> ChangelogTree:
    """Place one ``ChangelogNode`` per alive Ray node (head at the root) and return the tree.

    Connects to Ray (``address``, ``RAY_ADDRESS`` or a local cluster) if needed.
    """
    from topology.membership import reconcile
    from topology.placement import node_actor_name, place_tree

    from .merging.pool import FileMergingOptions

    config = config or ChangelogConfig.from_env()
    base = normalize_url(base_path)
    FileMergingOptions.from_config(config).check_storage(base)  # refused before any actor
    ensure_ray(config.namespace, address)
    placed = place_tree(base, config, detached=detached, reconcile=reconcile)
    if not placed:
        raise NodeUnavailableError("the Ray cluster has no alive nodes")
    nodes = {}
    root = ""
    for pos, actor in placed.values():
        name = node_actor_name(pos.node)
        nodes[name] = actor
        if pos.parent is None:
            root = name
    return ChangelogTree(base, config, nodes, root)


def attach(config: ChangelogConfig | None = None, *, address: str | None = None
           ) -> ChangelogTree:
    """The tree deployed earlier (e.g. by ``dstl-ray up``) in ``config.namespace``."""
    import ray

    from .transport.discovery import list_node_actors

    config = config or ChangelogConfig.from_env()
    ensure_ray(config.namespace, address)
    names = list_node_actors(config.namespace)
    if not names:
        raise NodeUnavailableError(f"no dstl-ray tree in namespace {config.namespace!r}")
    nodes = {n: ray.get_actor(n, namespace=config.namespace) for n in names}
    infos = {n: ray.get(h.info.remote(), timeout=30) for n, h in nodes.items()}
    root = next((n for n, i in infos.items() if i["parent"] is None), names[0])
    base = infos[root]["base_path"]
    return ChangelogTree(base, ChangelogConfig.from_dict(infos[root]["config"]), nodes, root)
