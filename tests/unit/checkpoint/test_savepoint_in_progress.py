"""A savepoint in progress, and a driver's second restore (docs/architecture.md "Checkpoint
lifecycle"). A savepoint's marker names the incarnation writing it, so orphan cleanup
spares it while that run holds the job and removes it once a later run took the job over;
its ``_metadata`` is written only while the lease holds, its marker is its own and every
part file is there, and never over an existing one. The wait for its parts is bounded.
Ages are never judged by a clock. Only the restore that starts a run cleans orphans."""

from __future__ import annotations

import concurrent.futures
import threading

import pytest

import dstl_ray as d
from dstl_ray.checkpoint import savepoint
from dstl_ray.checkpoint.recovery import cleanup_orphans, savepoint_marker
from dstl_ray.storage.registry import get_storage
from dstl_ray.transport.sender import Incarnation

from ..ckpt_util import MAXP, Oracle, client, dump_all, files, referenced

JOB = "job"


def _start(base: str, **options) -> tuple[d.CheckpointCoordinator, list, Oracle]:
    oracle = Oracle()
    coord = d.CheckpointCoordinator(JOB, base, max_parallelism=MAXP, **options)
    bs = coord.restore(client(JOB, base), "op", 2, materialization_interval=None)
    for i in range(20):
        oracle.put(bs, f"k{i}", i)
    coord.trigger_checkpoint().result(timeout=60)
    return coord, bs, oracle


def _hold_part(backend) -> threading.Event:
    """``backend``'s savepoint part writes its file at once but reports done only once the
    returned event is set (a slow part: the marker and the part files are on storage)."""
    gate = threading.Event()
    orig = backend.savepoint

    def slow(target):
        f = orig(target)
        out: concurrent.futures.Future = concurrent.futures.Future()

        def later() -> None:
            gate.wait(60)
            try:
                out.set_result(f.result())
            except BaseException as e:  # noqa: BLE001
                out.set_exception(e)

        threading.Thread(target=later, daemon=True).start()
        return out

    backend.savepoint = slow
    return gate


def _savepoint_dirs(base: str) -> dict[str, set[str]]:
    out: dict[str, set[str]] = {}
    for u in files(base, JOB):
        if "/savepoint-" in u:
            directory, name = u.rsplit("/", 1)
            out.setdefault(directory, set()).add(name)
    return out


def _wait_for_files(base: str, n: int) -> None:
    for _ in range(200):
        if sum(len(v) for v in _savepoint_dirs(base).values()) >= n:
            return
        threading.Event().wait(0.05)
    raise AssertionError(f"the savepoint's files did not appear: {_savepoint_dirs(base)}")


def test_a_second_restore_of_the_driver_spares_its_savepoint_in_progress(tmp_path):
    """The driver restores a second operator while its savepoint runs: the cleanup of that
    restore is of the same incarnation and spares the savepoint (it deleted it, and the
    savepoint then completed naming no file)."""
    base = f"file://{tmp_path}/dfs"
    coord, bs, oracle = _start(base)
    gate = _hold_part(bs[1])
    future = coord.trigger_savepoint()
    _wait_for_files(base, 3)  # marker + both parts
    coord.restore(client(JOB, base), "op2", 1, materialization_interval=None)
    gate.set()
    sp = future.result(timeout=60)
    assert all(get_storage(u).exists(u) for u in sp.files.values())
    coord.shutdown()
    check = d.CheckpointCoordinator("check", f"file://{tmp_path}/other", max_parallelism=MAXP)
    restored = check.restore(client("check", f"file://{tmp_path}/other"), "op", 1,
                             checkpoint=sp.metadata_url, materialization_interval=None)
    assert dump_all(restored) == oracle.state
    check.shutdown()


def test_a_driver_that_lost_the_job_never_completes_its_savepoint(tmp_path):
    """Driver A loses the job (a pause, a partition: here it abandons its lease) while its
    savepoint runs; driver B takes the job over, and B's orphan cleanup removes A's
    savepoint in progress (its marker names an older incarnation). When A's parts are done,
    A must not write ``_metadata``: its lease check fails. (It wrote it unchecked: the
    savepoint "succeeded" naming files that no longer existed.)"""
    base = f"file://{tmp_path}/dfs"
    a, bs, _ = _start(base)
    gate = _hold_part(bs[1])
    future = a.trigger_savepoint()
    _wait_for_files(base, 3)
    a.abandon()
    b = d.CheckpointCoordinator(JOB, base, max_parallelism=MAXP)
    b.restore(client(JOB, base), "op", 2, materialization_interval=None)
    assert _savepoint_dirs(base) == {}  # an older incarnation's savepoint in progress
    gate.set()
    with pytest.raises(d.CheckpointDeclinedError, match="lease"):
        future.result(timeout=60)
    assert not any("_metadata" in names for names in _savepoint_dirs(base).values())
    assert files(base, JOB) == referenced(b)
    b.shutdown()


def test_a_savepoint_whose_part_file_is_gone_fails(tmp_path):
    """A part file deleted before the metadata is written (by anyone): the savepoint fails
    naming it and removes what is left of its own directory, instead of completing into a
    savepoint that cannot be restored."""
    base = f"file://{tmp_path}/dfs"
    coord, bs, _ = _start(base)
    gate = _hold_part(bs[1])
    future = coord.trigger_savepoint()
    _wait_for_files(base, 3)
    [(directory, names)] = _savepoint_dirs(base).items()
    part = f"{directory}/{sorted(n for n in names if n != '_savepoint')[0]}"
    get_storage(part).delete(part)
    gate.set()
    with pytest.raises(d.CheckpointDeclinedError, match="gone") as ei:
        future.result(timeout=60)
    assert part in str(ei.value)
    assert _savepoint_dirs(base) == {}
    coord.shutdown()


def test_the_wait_for_parts_is_bounded(tmp_path, monkeypatch):
    """A part that does not finish: the savepoint fails once the parts' time is up (the
    wait for the parts was unbounded after a failure), and its files go once the late
    part is done."""
    monkeypatch.setattr(savepoint, "SAVEPOINT_PART_TIMEOUT_S", 0.5)
    base = f"file://{tmp_path}/dfs"
    coord, bs, _ = _start(base)
    gate = _hold_part(bs[1])
    future = coord.trigger_savepoint()
    with pytest.raises(d.CheckpointDeclinedError, match="not done after"):
        future.result(timeout=10)
    assert _savepoint_dirs(base)  # the late part still runs: nothing deleted under it
    gate.set()
    for _ in range(200):
        if not _savepoint_dirs(base):
            break
        threading.Event().wait(0.05)
    assert _savepoint_dirs(base) == {}
    coord.shutdown()


def test_metadata_is_never_written_over_an_existing_one(tmp_path):
    """The ``_metadata`` write creates the file only where absent: one that appeared in the
    directory meanwhile is not overwritten, and nothing of the directory is deleted."""
    base = f"file://{tmp_path}/dfs"
    coord, bs, _ = _start(base)
    gate = _hold_part(bs[1])
    future = coord.trigger_savepoint()
    _wait_for_files(base, 3)
    [(directory, names)] = _savepoint_dirs(base).items()
    st = get_storage(directory)
    st.write_file(f"{directory}/_metadata", b"someone's")
    gate.set()
    with pytest.raises(d.CheckpointDeclinedError, match="exists already"):
        future.result(timeout=60)
    assert st.read_file(f"{directory}/_metadata") == b"someone's"
    assert _savepoint_dirs(base)[directory] == names | {"_metadata"}
    coord.shutdown()


def test_orphan_cleanup_judges_savepoints_in_progress_by_incarnation(tmp_path):
    """Complete savepoints stay; one in progress stays while its marker names the current
    incarnation or a newer one, and goes when it names an older one, none, or there is no
    marker. Without an incarnation (a caller outside the lease), every marked one stays.
    The job path may be spelled in any form (a spelling other than the listing's moved
    every relative path by some characters: complete savepoints were deleted)."""
    root = f"file://{tmp_path}/dfs/{JOB}"
    st = get_storage(root)
    current = Incarnation(5, "cur")
    dirs = {"complete": None, "same": "5-cur", "newer": "6-other", "older": "4-old",
            "unnamed": "", "unmarked": False}
    for name, inc in dirs.items():
        sp = f"{root}/savepoint-{name}"
        st.write_file(f"{sp}/part.dstm", b"p")
        if inc is None:
            st.write_file(f"{sp}/_metadata", b"m")
        elif inc is not False:
            st.write_file(f"{sp}/_savepoint", savepoint_marker(JOB, 1, inc))
    st.write_file(f"{root}/mat/orphan.dstm", b"o")
    listing = st.list_files(root)

    kept = cleanup_orphans(str(tmp_path / "dfs" / JOB), set(), st, candidates=listing)
    assert {u.split("/")[-2] for u in kept} == {"mat", "savepoint-unmarked"}

    def left() -> set[str]:
        return {u.split("/")[-2] for u in st.list_files(root)}

    assert left() == {f"savepoint-{n}" for n in dirs if n != "unmarked"}
    deleted = cleanup_orphans(f"file:///{tmp_path}//dfs/{JOB}/", set(), st,
                              incarnation=current)
    assert {u.split("/")[-2] for u in deleted} == {"savepoint-older", "savepoint-unnamed"}
    assert left() == {"savepoint-complete", "savepoint-same", "savepoint-newer"}


def test_a_second_restore_of_the_driver_deletes_none_of_its_live_files(tmp_path):
    """A driver restores a second operator after the first one materialized: the first
    one's new state files are named by no checkpoint yet, but they are this run's own and
    live. The second restore's orphan cleanup deleted them, and the next checkpoint named
    deleted files. Only the restore that starts the run cleans orphans."""
    base = f"file://{tmp_path}/dfs"
    coord, bs, oracle = _start(base)
    for i in range(20):
        oracle.put(bs, f"k{i}", i + 100)
    for b in bs:
        b.materialize(force=True).result(timeout=60)
    coord.restore(client(JOB, base), "op2", 1, materialization_interval=None)
    cc = coord.trigger_checkpoint().result(timeout=60)
    assert [u for u in cc.files.values() if not get_storage(u).exists(u)] == []
    coord.shutdown()
    again = d.CheckpointCoordinator(JOB, base, max_parallelism=MAXP)
    restored = again.restore(client(JOB, base), "op", 2, materialization_interval=None)
    assert dump_all(restored) == oracle.state
    again.shutdown()
