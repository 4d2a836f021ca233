"""A savepoint of a complete checkpoint (``CheckpointCoordinator.trigger_savepoint(of=...)``,
dstl_ray.checkpoint.savepoint_parts): what a job whose backends live elsewhere (the Spark
operator) takes. It holds exactly that checkpoint's state (materialized part and changelog on
top), not the backends' later changes; it names only files in its own directory; it restores
at another parallelism and by another job; the checkpoint's files are only read; a part that
cannot read its checkpoint fails the savepoint and leaves nothing behind; as a live backend's
savepoint it saves no expired TTL entry; its id is the checkpoint's; a failed attempt's queued
parts never run; a job that lost its lease takes no directory."""

from __future__ import annotations

import concurrent.futures
import threading
import time
from dataclasses import replace

import pytest

import dstl_ray as d
from dstl_ray.checkpoint.reader import read_state, read_states
from dstl_ray.checkpoint.savepoint import start_savepoint
from dstl_ray.checkpoint.savepoint_parts import checkpoint_ranges
from dstl_ray.errors import CheckpointDeclinedError, ConfigError
from dstl_ray.storage.registry import get_storage

from ..ckpt_util import MAXP, client, dump_all, new_base


def _job(base, table, tmp_path, parallelism=2):  # noqa: D103
    coord = d.CheckpointCoordinator("job", base, max_parallelism=MAXP, retained=3)
    bs = coord.restore(client("job", base), "op", parallelism, materialization_interval=None,
                       state_backend=table, local_dir=str(tmp_path / "local"))
    return coord, bs


def _fill(bs, lo, hi, tag):
    for b in bs:
        v, m = b.value_state("v"), b.map_state("m")
        for i in range(lo, hi):
            k = f"k{i}"
            if b.key_group_range.start <= d.assign_key_group(k, MAXP) <= b.key_group_range.end:
                v.update(k, f"{tag}{i}")
                m.put(k, i % 5, [tag, i])


def _checkpointed(tmp_path, keys):
    """A heap job of parallelism 2 with ``keys`` keys and a checkpoint of them."""
    base = new_base(tmp_path)
    coord, bs = _job(base, "heap", tmp_path)
    _fill(bs, 0, keys, "a")
    return base, coord, coord.trigger_checkpoint().result()


def _dump(bs):
    return {name: entries for name, entries in dump_all(bs).items() if entries}


def _files(base):
    return {u: get_storage(u).read_file(u) for u in get_storage(base).list_files(base)}


@pytest.mark.parametrize("table", ["heap", "rocksdb"])
def test_a_savepoint_of_a_checkpoint_holds_that_checkpoints_state(tmp_path, table):
    base = new_base(tmp_path)
    coord, bs = _job(base, table, tmp_path)
    _fill(bs, 0, 300, "a")
    for b in bs:
        b.materialize(force=True).result(timeout=60)
    _fill(bs, 150, 400, "b")  # changelog on top of the materialized part
    cc = coord.trigger_checkpoint().result()
    want = read_states(cc.metadata_url, "op")
    assert want == _dump(bs) and len(want["v"]) == 400
    _fill(bs, 0, 50, "later")  # the backends move on; the savepoint is of the checkpoint
    coord.trigger_checkpoint().result()
    before = _files(f"{base}/job")
    sp = coord.trigger_savepoint(of=cc, table=table).result(timeout=60)
    assert sp.is_savepoint and "/savepoint-" in sp.metadata_url
    sp_dir = sp.metadata_url.rsplit("/", 1)[0]
    assert all(u.startswith(sp_dir + "/") for u in sp.files.values()), sp.files
    assert read_states(sp.metadata_url, "op") == want
    after = _files(f"{base}/job")
    assert {u: b for u, b in after.items() if u in before} == before  # only read
    coord.shutdown()
    # another job restores it at another parallelism
    other = d.CheckpointCoordinator("other", base, max_parallelism=MAXP)
    bs3 = other.restore(client("other", base), "op", 3, checkpoint=sp.metadata_url,
                        materialization_interval=None)
    assert _dump(bs3) == want
    other.shutdown()


def test_a_part_that_cannot_read_its_checkpoint_fails_the_savepoint_leaving_nothing(tmp_path):
    base, coord, cc = _checkpointed(tmp_path, 100)
    gone = sorted(u for u in cc.files.values() if "/savepoint-" not in u)[0]
    get_storage(gone).delete(gone)
    with pytest.raises(CheckpointDeclinedError, match="savepoint"):
        coord.trigger_savepoint(of=cc).result(timeout=60)
    storage = get_storage(base)
    assert not [u for u in storage.list_files(f"{base}/job") if "/savepoint-" in u]
    coord.shutdown()


def test_expired_entries_are_not_saved_and_the_savepoint_is_the_checkpoints_id(tmp_path):
    base = new_base(tmp_path)
    coord, (b,) = _job(base, "heap", tmp_path, parallelism=1)
    b.value_state("t", ttl=10).update("k", 1)
    b.value_state("plain").update("k", 1)
    cc = coord.trigger_checkpoint().result()
    later = [replace(r, clock=lambda: 10.0 ** 9 * 4) for r in
             checkpoint_ranges(cc, get_storage(base), coord.savepoints._pool)]
    sp = start_savepoint("job", cc.checkpoint_id, f"{base}/job", later, MAXP,
                         get_storage(base)).result(timeout=60)
    assert read_state(sp.metadata_url, "t", now_ms=0) == {}  # purged, not merely hidden
    assert read_state(sp.metadata_url, "plain", now_ms=0) == {"k": 1}
    # through the coordinator: the checkpoint's id, and the counter is not taken
    n = coord._next_id
    sp2 = coord.trigger_savepoint(of=cc).result(timeout=60)
    assert sp2.checkpoint_id == cc.checkpoint_id and coord._next_id == n
    assert read_state(sp2.metadata_url, "t", now_ms=0) == {"k": 1}  # not expired now
    coord.shutdown()


def test_another_max_parallelism_is_refused(tmp_path):
    base, coord, cc = _checkpointed(tmp_path, 10)
    coord.shutdown()
    other = d.CheckpointCoordinator("other", base, max_parallelism=MAXP * 2)
    with pytest.raises(ConfigError, match="max parallelism"):
        other.trigger_savepoint(of=cc)
    other.shutdown()


class _SlowPart:
    """A part that takes ``delay_s`` on a shared one-thread pool (as checkpoint ranges)."""

    queued = True

    def __init__(self, pool, delay_s, ran):
        self.pool, self.delay_s, self.ran = pool, delay_s, ran

    def savepoint(self, target_dir):
        def write():
            self.ran.append(target_dir)
            time.sleep(self.delay_s)
            raise AssertionError("never completes in time")
        return self.pool.submit(write)


def test_a_failed_attempts_queued_parts_never_run_and_a_closed_job_takes_no_directory(
        tmp_path):
    base = new_base(tmp_path)
    storage = get_storage(base)
    ran: list[str] = []
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        parts = [_SlowPart(pool, 0.4, ran) for _ in range(5)]
        with pytest.raises(CheckpointDeclinedError, match="not done after"):
            start_savepoint("job", 1, f"{base}/job", parts, MAXP, storage,
                            timeout_s=0.2).result(timeout=30)
        pool.shutdown(wait=True)
    assert len(ran) == 1  # the late part ran; the four queued behind it were cancelled
    deadline = time.monotonic() + 10
    while storage.list_files(f"{base}/job") and time.monotonic() < deadline:
        time.sleep(0.05)  # the directory goes once the late part is done
    assert storage.list_files(f"{base}/job") == []

    def fenced():
        raise d.DstlError("fenced")

    with pytest.raises(CheckpointDeclinedError, match="fenced"):
        start_savepoint("job", 2, f"{base}/job", [], MAXP, storage,
                        guard=fenced).result(timeout=30)
    assert storage.list_files(f"{base}/job") == []  # not even a marker


def test_a_checkpoint_subsumed_while_its_savepoint_reads_it_keeps_its_files_until_done(
        tmp_path):
    """The files of the checkpoint read are pinned in the job's registry: a checkpoint that
    subsumes it meanwhile (retained=1) deletes them only once the savepoint is done, and
    then does (nothing leaks)."""
    base = new_base(tmp_path)
    coord = d.CheckpointCoordinator("job", base, max_parallelism=MAXP, retained=1)
    bs = coord.restore(client("job", base), "op", 2, materialization_interval=None)
    _fill(bs, 0, 200, "a")
    for b in bs:
        b.materialize(force=True).result(timeout=60)
    cc = coord.trigger_checkpoint().result()
    want = read_states(cc.metadata_url, "op")
    gate = threading.Event()
    coord.savepoints._pool.submit(gate.wait, 60)  # the savepoint's parts queue behind this
    pending = coord.trigger_savepoint(of=cc)
    try:
        for b in bs:  # new bases: the old ones are named by cc alone
            _fill([b], 0, 200, "b")
            b.materialize(force=True).result(timeout=60)
        coord.trigger_checkpoint().result()  # subsumes cc
        coord.registry.flush(30)
        storage = get_storage(base)
        assert all(storage.exists(u) for u in cc.files.values())  # pinned while read
    finally:
        gate.set()
    sp = pending.result(timeout=60)
    assert read_states(sp.metadata_url, "op") == want
    coord.registry.flush(30)
    assert not [u for u in cc.files.values() if storage.exists(u)]  # then gone
    coord.shutdown()
