"""A savepoint belongs to the user (docs/architecture.md "Checkpoint lifecycle"): once
written, no later run of the job writes into it or deletes any of its files, whatever the
checkpoint counter says: runs restored from a checkpoint or from a savepoint, in CLAIM or
NO_CLAIM mode, after a cancel with DELETE_ON_CANCELLATION, after a crash (orphan cleanup).
A failed savepoint removes only what it wrote.

The lives below run one job on real ``file://`` storage. Each takes a savepoint right after
its restart (the checkpoint counter then starts again from the retained checkpoints, or
from 1 once they were deleted) and one before it stops; at the end every savepoint ever
taken still holds exactly its bytes and reads back the state it was taken with."""

from __future__ import annotations

import copy
import hashlib

import pytest

import dstl_ray as d
from dstl_ray.storage.registry import get_storage
from dstl_ray.testing.faults import FaultyStorage

from ..ckpt_util import (
    MAXP,
    TABLE,
    Oracle,
    client,
    dump_all,
    files,
    state_backend,  # noqa: F401 - autouse: every test on heap and rocksdb
)

JOB = "job"


class Savepoints:
    """Every savepoint taken: its result, the state it must hold, its files' digests."""

    def __init__(self) -> None:
        self.taken: list[tuple[d.CompletedCheckpoint, dict, dict[str, str]]] = []

    def take(self, coord: d.CheckpointCoordinator, oracle: Oracle) -> d.CompletedCheckpoint:
        sp = coord.trigger_savepoint().result(timeout=60)
        assert sp.is_savepoint
        self.taken.append((sp, oracle.copy(), _digests(_dir(sp))))
        return sp

    def check(self, base: str, scratch: str) -> None:
        """Every savepoint has exactly its files, unchanged, and restores its state."""
        for i, (sp, want, digests) in enumerate(self.taken):
            assert _digests(_dir(sp)) == digests, f"savepoint {i} ({_dir(sp)}) was changed"
            job = f"check-{i}"
            coord = d.CheckpointCoordinator(job, scratch, max_parallelism=MAXP)
            bs = coord.restore(client(job, scratch), "op", 2, checkpoint=sp.metadata_url,
                               materialization_interval=None, **TABLE)
            assert dump_all(bs) == want, f"savepoint {i} ({_dir(sp)}) reads back wrong"
            coord.shutdown()
        dirs = [_dir(sp) for sp, _, _ in self.taken]
        assert len(set(dirs)) == len(dirs), "two savepoints share a directory"


def _dir(cc: d.CompletedCheckpoint) -> str:
    return cc.metadata_url.rsplit("/", 1)[0]


def _digests(directory: str) -> dict[str, str]:
    st = get_storage(directory)
    return {u: hashlib.sha256(st.read_file(u)).hexdigest() for u in st.list_files(directory)}


def _savepoint_files(base: str) -> set[str]:
    return {u for u in files(base, JOB) if "/savepoint-" in u}


def _life(base: str, parallelism: int, **restore) -> tuple[d.CheckpointCoordinator, list]:
    retention = restore.pop("retention", d.CheckpointRetention.RETAIN_ON_CANCELLATION)
    coord = d.CheckpointCoordinator(JOB, base, max_parallelism=MAXP, retained=2,
                                    retention=retention)
    bs = coord.restore(client(JOB, base), "op", parallelism, materialization_interval=None,
                       **restore, **TABLE)
    return coord, bs


def _work(coord, bs, oracle: Oracle, tag: str) -> None:
    """Changes, a checkpoint, a materialization, more changes, a checkpoint."""
    for i in range(30):
        oracle.put(bs, f"k{i}", f"{tag}{i}")
        oracle.list_add(bs, f"k{i % 7}", f"{tag}{i}")
        oracle.map_put(bs, f"k{i % 5}", i % 3, [tag, i])
    oracle.delete(bs, "k3")
    coord.trigger_checkpoint().result(timeout=60)
    for b in bs:
        f = b.materialize()
        if f is not None:
            f.result(timeout=60)
    oracle.put(bs, f"late-{tag}", tag)
    coord.trigger_checkpoint().result(timeout=60)


def test_no_later_life_writes_into_or_deletes_a_savepoint(tmp_path):
    base, scratch = f"file://{tmp_path}/dfs", f"file://{tmp_path}/scratch"
    oracle, sps = Oracle(), Savepoints()

    # life 1: a new job
    coord, bs = _life(base, 2)
    _work(coord, bs, oracle, "a")
    first = sps.take(coord, oracle)
    first_state = oracle.copy()
    _work(coord, bs, oracle, "b")
    sps.take(coord, oracle)
    coord.shutdown()

    # life 2: from the latest checkpoint, at another parallelism
    coord, bs = _life(base, 3)
    assert dump_all(bs) == oracle.state
    sps.take(coord, oracle)
    _work(coord, bs, oracle, "c")
    sps.take(coord, oracle)
    coord.shutdown()

    # life 3: from the first savepoint, NO_CLAIM; cancelled with DELETE_ON_CANCELLATION
    coord, bs = _life(base, 1, checkpoint=first.metadata_url, mode=d.RestoreMode.NO_CLAIM,
                      retention=d.CheckpointRetention.DELETE_ON_CANCELLATION)
    oracle.state = first_state
    assert dump_all(bs) == oracle.state
    sps.take(coord, oracle)
    _work(coord, bs, oracle, "d")
    last = sps.take(coord, oracle)
    coord.shutdown(cancel=True)
    assert not [u for u in files(base, JOB) if "/chk-" in u]  # the checkpoints are gone

    # life 4: no checkpoint left, the counter starts at 1 again: from the last savepoint in
    # CLAIM mode (a savepoint is never claimed); the driver crashes at the end
    coord, bs = _life(base, 2, checkpoint=last.metadata_url, mode=d.RestoreMode.CLAIM)
    assert dump_all(bs) == oracle.state
    sps.take(coord, oracle)
    _work(coord, bs, oracle, "e")
    sps.take(coord, oracle)
    coord.abandon()

    # life 5: after the crash (orphan cleanup runs) from the latest checkpoint; its first
    # savepoint fails in one backend's part and leaves every earlier savepoint as it was
    coord, bs = _life(base, 2)
    assert dump_all(bs) == oracle.state
    before = {u: hashlib.sha256(get_storage(u).read_file(u)).hexdigest()
              for u in _savepoint_files(base)}
    bs[1]._storage = FaultyStorage(bs[1]._storage, '{"script": ["torn"], "match": "savepoint"}')
    with pytest.raises(d.CheckpointDeclinedError, match="torn"):
        coord.trigger_savepoint().result(timeout=60)
    after = {u: hashlib.sha256(get_storage(u).read_file(u)).hexdigest()
             for u in _savepoint_files(base)}
    assert after == before  # nothing of the failed attempt stays, nothing else is gone
    sps.take(coord, oracle)
    _work(coord, bs, oracle, "f")
    sps.take(coord, oracle)
    coord.shutdown(cancel=True)  # RETAIN_ON_CANCELLATION

    # and once more from a savepoint of life 2, in CLAIM mode: nothing of it is claimed
    coord, bs = _life(base, 2, checkpoint=sps.taken[3][0].metadata_url)
    oracle.state = copy.deepcopy(sps.taken[3][1])
    assert dump_all(bs) == oracle.state
    _work(coord, bs, oracle, "g")
    sps.take(coord, oracle)
    coord.shutdown()

    assert len(sps.taken) == 11
    sps.check(base, scratch)
    # every savepoint's directory holds its files and nothing else
    assert _savepoint_files(base) == {u for _, _, dg in sps.taken for u in dg}


def test_a_savepoint_never_takes_a_directory_in_use(tmp_path, monkeypatch):
    """A name whose directory holds anything, or whose marker exists already, is skipped:
    no two savepoints ever share a directory, however the random names fall."""
    import uuid

    from dstl_ray.checkpoint import savepoint

    job_path = f"file://{tmp_path}/dfs/{JOB}"
    st = get_storage(job_path)
    names = iter(["a" * 32, "b" * 32, "c" * 32])
    monkeypatch.setattr(savepoint.uuid, "uuid4", lambda: uuid.UUID(next(names)))
    st.write_file(f"{job_path}/savepoint-{'a' * 16}/part.dstm", b"someone's")
    assert st.create_file(f"{job_path}/savepoint-{'b' * 16}/_savepoint", b"{}")
    target = savepoint.new_savepoint_dir(job_path, JOB, 4, st)
    assert target == f"{job_path}/savepoint-{'c' * 16}"
    assert st.list_files(target) == [f"{target}/_savepoint"]
    assert st.read_file(f"{job_path}/savepoint-{'a' * 16}/part.dstm") == b"someone's"
    assert st.read_file(f"{job_path}/savepoint-{'b' * 16}/_savepoint") == b"{}"
