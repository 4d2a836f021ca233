"""Helpers for checkpoint lifecycle tests: a job on DirectTransport, an oracle, file views."""

from __future__ import annotations

import concurrent.futures
import copy
import os
import uuid

import pytest

import dstl_ray as d
from dstl_ray.state.local_recovery import ROOT
from dstl_ray.storage.deleter import flush_deletes
from dstl_ray.storage.registry import get_storage

MAXP = 16


def new_base(tmp_path=None) -> str:
    return f"file://{tmp_path}/dfs" if tmp_path is not None else \
        f"memory://ckpt-{uuid.uuid4().hex[:10]}"


class FailingTransport(d.DirectTransport):
    """Every persist request fails (a job whose checkpoints all decline)."""

    def send(self, request):
        f = concurrent.futures.Future()
        f.set_exception(d.StorageError("injected: DFS unavailable"))
        return f


def workdirs(local) -> list[str]:
    """The rocksdb tables' working directories under ``local`` (the local recovery copies,
    which outlive the tables on purpose, left out)."""
    return sorted(n for n in os.listdir(local) if not n.startswith(ROOT))


def client(job: str, base: str, transport=None) -> d.StateChangelogClient:
    return d.StateChangelogClient(job, transport=transport or d.DirectTransport(job, base))


def owner(backends, key):
    kg = d.assign_key_group(key, MAXP)
    return next(b for b in backends if kg in b.key_group_range)


class Oracle:
    """What the state must be: {state: {key: value}} like backend.dump()."""

    def __init__(self) -> None:
        self.state: dict[str, dict] = {"v": {}, "l": {}, "m": {}}

    def copy(self) -> dict[str, dict]:
        return copy.deepcopy(self.state)

    def put(self, bs, k, v):
        owner(bs, k).value_state("v").update(k, v)
        self.state["v"][k] = v

    def delete(self, bs, k):
        owner(bs, k).value_state("v").clear(k)
        self.state["v"].pop(k, None)

    def list_add(self, bs, k, v):
        owner(bs, k).list_state("l").add(k, v)
        self.state["l"].setdefault(k, []).append(v)

    def map_put(self, bs, k, uk, v):
        owner(bs, k).map_state("m").put(k, uk, v)
        self.state["m"].setdefault(k, {})[uk] = v

    def map_remove(self, bs, k, uk):
        owner(bs, k).map_state("m").remove(k, uk)
        m = self.state["m"].get(k)
        if m is not None:
            m.pop(uk, None)
            if not m:
                del self.state["m"][k]


def dump_all(backends) -> dict[str, dict]:
    out: dict[str, dict] = {"v": {}, "l": {}, "m": {}}
    for b in backends:
        for name, dd in b.dump().items():
            out[name].update(dd)
    return out


def files(base: str, job: str = "job") -> set[str]:
    """Files of ``job`` once the deletes decided so far ran (they run in the background)."""
    assert flush_deletes(30)
    root = f"{base.rstrip('/')}/{job}"
    return set(get_storage(root).list_files(root))


def referenced(coord: d.CheckpointCoordinator) -> set[str]:
    """Metadata files + state files of every retained checkpoint (inside this job's dir)."""
    out = set()
    for c in coord.completed_checkpoints():
        out.add(c.metadata_url)
        out.update(u for u in c.files.values() if u.startswith(coord.job_path + "/"))
    if coord.lease.incarnation is not None:  # the job's lease (released: its record)
        out.add(coord.lease.url)
    return out


def as_decoded(v: object) -> object:
    """``v`` as the TaggedSerializer gives it back: tuples as lists (dict keys stay)."""
    if isinstance(v, (list, tuple)):
        return [as_decoded(x) for x in v]
    if isinstance(v, dict):
        return {k: as_decoded(x) for k, x in v.items()}
    return v


# the state table a test module's backends run on: a module that imports ``state_backend``
# runs each of its tests on heap and on rocksdb, with ``TABLE`` as the backends' options
TABLE: dict[str, str] = {}


@pytest.fixture(autouse=True, params=["heap", "rocksdb"])
def state_backend(request, tmp_path):
    TABLE.update(state_backend=request.param, local_dir=str(tmp_path / "local"))
    (tmp_path / "local").mkdir()
    yield request.param
    TABLE.clear()
