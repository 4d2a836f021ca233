"""Writers placed on a chosen Ray node, for cluster tests and experiments.

``NodeWriters`` is a Ray actor pinned to one node; it attaches a ``StateChangelogClient`` to
that node's nearest node actor (or, in ``direct`` mode, writes its own files) and drives
``n`` writers through checkpoints, remembering what it appended so restores can be checked.
"""

from __future__ import annotations

import os
import random
import time
from typing import Any

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy


class NodeWriters:
    def __init__(self, job_id: str, namespace: str, writer_indices: list[int], parallelism: int,
                 max_parallelism: int = 128, seed: int = 0, direct_base: str | None = None
                 ) -> None:
        from dstl_ray import DirectTransport, StateChangelogClient, key_group_range_for_subtask

        transport = DirectTransport(job_id, direct_base) if direct_base else None
        self.client = StateChangelogClient(job_id, namespace=namespace, transport=transport)
        self.writers = [self.client.create_writer(
            f"op-{i}", key_group_range_for_subtask(max_parallelism, parallelism, i))
            for i in writer_indices]
        self.expected: list[dict[int, list[bytes]]] = [{} for _ in self.writers]
        self.rng = random.Random(seed)
        self.cp = 0

    def where(self) -> dict[str, str]:
        t = self.client.transport
        return {"node_id": ray.get_runtime_context().get_node_id(),
                "node_actor": getattr(t, "node_name", ""),
                "chosen_by": getattr(t, "chosen_by", "direct")}

    def append(self, changes: int, payload: int) -> int:
        """Append ``changes`` changes of ``payload`` bytes to every writer."""
        self.cp += 1
        for i, w in enumerate(self.writers):
            kgr = w.key_group_range
            for j in range(changes):
                kg = self.rng.randint(kgr.start, kgr.end)
                v = f"{self.cp}:{i}:{j}:".encode() + os.urandom(max(0, payload - 12))
                w.append(kg, v)
                self.expected[i].setdefault(kg, []).append(v)
        return self.cp

    def persist(self, timeout: float = 120.0) -> dict[str, Any]:
        """persist_durably(after=0) on every writer; handles as JSON, or the error."""
        t0 = time.perf_counter()
        futures = [w.persist_durably(0) for w in self.writers]
        try:
            handles = [f.result(timeout=timeout).to_json() for f in futures]
        except Exception as e:  # noqa: BLE001 - reported to the driver
            return {"ok": False, "error": f"{type(e).__name__}: {e}",
                    "latency_ms": (time.perf_counter() - t0) * 1000}
        return {"ok": True, "handles": handles, "latency_ms": (time.perf_counter() - t0) * 1000}

    def checkpoint(self, changes: int, payload: int) -> dict[str, Any]:
        self.append(changes, payload)
        return self.persist()

    def expected_changes(self) -> list[dict[int, list[bytes]]]:
        return self.expected

    def spans(self) -> list[dict[str, Any]]:
        from dstl_ray.observability import tracing

        return tracing.finished_spans()

    def close(self) -> None:
        self.client.close()


RemoteNodeWriters = ray.remote(num_cpus=0)(NodeWriters)


def place_writers(job_id: str, namespace: str, node_ids: list[str], per_node: int,
                  seed: int = 0, direct_base: str | None = None) -> list[Any]:
    """One ``NodeWriters`` actor per node, ``per_node`` writers each (subtasks numbered
    node-major over ``len(node_ids) * per_node``)."""
    total = len(node_ids) * per_node
    actors = []
    for n, nid in enumerate(node_ids):
        idx = list(range(n * per_node, (n + 1) * per_node))
        actors.append(RemoteNodeWriters.options(
            scheduling_strategy=NodeAffinitySchedulingStrategy(node_id=nid, soft=False),
        ).remote(job_id, namespace, idx, total, seed=seed + n, direct_base=direct_base))
    ray.get([a.where.remote() for a in actors])  # every writer registered before we go on
    return actors


def verify(actors: list[Any], handles_per_actor: list[list[str]]) -> int:
    """Restore every writer from its handle and compare; returns the number of changes
    checked, raises AssertionError on any difference."""
    from dstl_ray import StateChangelogHandle

    checked = 0
    for actor, handles in zip(actors, handles_per_actor, strict=True):
        expected = ray.get(actor.expected_changes.remote())
        for exp, text in zip(expected, handles, strict=True):
            got = {kg: v for kg, v in StateChangelogHandle.from_json(text).read_all().items()
                   if v}
            assert got == exp, "restored changes differ from what was appended"
            checked += sum(len(v) for v in exp.values())
    return checked
