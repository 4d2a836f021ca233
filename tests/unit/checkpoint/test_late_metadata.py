"""A late ``_metadata`` write of a driver taken over (checkpoint/metadata_write.py): driver A
passed its lease check and its write of ``chk-2/_metadata`` is held up (its host partitioned
with the request in flight); driver B takes the job over, resumes from checkpoint 1 and
completes checkpoint 2 itself. Whichever lands first, ``chk-2/_metadata`` ends up B's, and
every retained checkpoint reads back."""

from __future__ import annotations

import threading

import pytest

import dstl_ray as d
from dstl_ray.checkpoint.restore import load_retained
from dstl_ray.errors import CheckpointDeclinedError
from dstl_ray.storage.registry import get_storage

TTL_S = 0.6


def _driver(base: str, job: str):
    coord = d.CheckpointCoordinator(job, base, max_parallelism=8, retained=2,
                                    lease_ttl_s=TTL_S)
    client = d.StateChangelogClient(job, transport=d.DirectTransport(job, base))
    backend = coord.restore(client, "op", 1, materialization_interval=None)[0]
    return coord, backend


def _stall_metadata(coord) -> tuple[threading.Event, threading.Event]:
    """Hold ``coord``'s next metadata create after its lease check: (reached, go)."""
    reached, go = threading.Event(), threading.Event()
    create = coord.metadata._create

    def held(url: str, data: bytes) -> bool:
        reached.set()
        assert go.wait(30)
        return create(url, data)

    coord.metadata._create = held
    return reached, go


@pytest.mark.parametrize("late_lands", ["after", "before"])
def test_a_late_metadata_write_of_a_driver_taken_over_never_replaces_the_new_ones(
        tmp_path, late_lands):
    base, job = f"file://{tmp_path}/dfs", "late-meta"
    a, ab = _driver(base, job)
    ab.value_state("v").update("k", 1)
    a.trigger_checkpoint().result(timeout=30)
    ab.value_state("v").update("k", 2)
    reached, go = _stall_metadata(a)
    late = a.trigger_checkpoint()  # checkpoint 2 of A: checked, then held up
    assert reached.wait(30)
    a.lease.abandon()  # A goes silent (partitioned): B takes over after a TTL
    b, bb = _driver(base, job)
    assert bb.dump()["v"] == {"k": 1}  # resumed from checkpoint 1
    bb.value_state("v").update("k", 20)
    if late_lands == "before":  # A's write lands first; B finds it in the way
        go.set()
        late.result(timeout=30)
    b.trigger_checkpoint().result(timeout=30)  # B's checkpoint 2
    if late_lands == "after":  # A's write lands after B's: refused
        go.set()
        with pytest.raises(CheckpointDeclinedError):
            late.result(timeout=30)
    assert b.metadata.replaced == (1 if late_lands == "before" else 0)
    storage = get_storage(base)
    retained, broken = load_retained(f"{base}/{job}", storage)
    assert not broken and [c.checkpoint_id for c in retained] == [1, 2]
    newest = retained[-1]
    assert newest.metadata.epoch == b.lease.incarnation.epoch > a.lease.incarnation.epoch
    assert all(storage.exists(u) for c in retained for u in c.files.values())
    b.shutdown()
    # a new driver restores what B checkpointed
    c, cb = _driver(base, job)
    assert cb.dump()["v"] == {"k": 20}
    c.shutdown()


def _checkpoint_1_then_in_the_way(tmp_path, job: str, content: bytes):
    """A driver that completed checkpoint 1, and ``content`` at ``chk-2/_metadata``."""
    base = f"file://{tmp_path}/dfs"
    a, ab = _driver(base, job)
    ab.value_state("v").update("k", 1)
    a.trigger_checkpoint().result(timeout=30)
    url = f"{base}/{job}/chk-2/_metadata"
    get_storage(url).write_file(url, content)
    return a, url


def test_a_file_of_a_newer_incarnation_declines_the_checkpoint(tmp_path):
    a, url = _checkpoint_1_then_in_the_way(tmp_path, "newer", b'{"epoch": 99}')
    with pytest.raises(CheckpointDeclinedError, match="epoch 99, newer"):
        a.trigger_checkpoint().result(timeout=30)
    assert get_storage(url).read_file(url) == b'{"epoch": 99}'  # not deleted
    a.lease.abandon()


def test_a_second_completion_of_an_id_in_progress_is_refused_and_the_first_stays(tmp_path):
    base, job = f"file://{tmp_path}/dfs", "twice"
    a, ab = _driver(base, job)
    ab.value_state("v").update("k", 1)
    snap = ab.snapshot().result(timeout=30)
    reached, go = _stall_metadata(a)
    first = threading.Thread(target=a.complete_checkpoint, args=(5, [snap]))
    first.start()
    assert reached.wait(30)  # the first completion of 5 is writing its metadata
    with pytest.raises(CheckpointDeclinedError, match="in progress"):
        a.complete_checkpoint(5, [ab.snapshot().result(timeout=30)])
    go.set()
    first.join(30)
    assert [c.checkpoint_id for c in a.completed_checkpoints()] == [5]
    assert get_storage(base).exists(f"{base}/{job}/chk-5/_metadata")
    a.shutdown()


def test_a_create_that_failed_but_landed_counts_as_done(tmp_path):
    from dstl_ray.errors import StorageError

    base, job = f"file://{tmp_path}/dfs", "landed"
    a, ab = _driver(base, job)
    create = a.metadata._create

    def lands_then_times_out(url: str, data: bytes) -> bool:
        create(url, data)
        raise StorageError(f"cannot create {url}: timed out")

    a.metadata._create = lands_then_times_out
    ab.value_state("v").update("k", 7)
    a.trigger_checkpoint().result(timeout=30)  # not declined
    a.metadata._create = create
    a.shutdown()
    c, cb = _driver(base, job)
    assert cb.dump()["v"] == {"k": 7}
    c.shutdown()


def test_a_driver_taken_over_after_deleting_a_late_write_creates_nothing(tmp_path):
    # an older incarnation's late write in the way
    a, url = _checkpoint_1_then_in_the_way(tmp_path, "fenced-retry", b'{"epoch": 0}')
    delete = a.storage.delete

    def deleted_then_taken_over(u: str) -> None:
        delete(u)
        a.lease._fence("taken over (test)")

    a.metadata.storage = type("S", (), {"delete": staticmethod(deleted_then_taken_over),
                                        "exists": a.storage.exists,
                                        "read_file": a.storage.read_file})()
    with pytest.raises(CheckpointDeclinedError):
        a.trigger_checkpoint().result(timeout=30)
    assert not get_storage(url).exists(url)  # deleted, and nothing created after the fence
