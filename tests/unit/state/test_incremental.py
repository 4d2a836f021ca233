"""Incremental materialization of the rocksdb state table (Flink's incremental RocksDB
checkpoints): a second materialization with 1% of keys changed uploads a small fraction and
names the first one's SST files again; a restore opens the SST files as its database and its
first materialization uploads nothing it already has; a missing or corrupt SST fails the
restore with a RestoreError naming the file; heap and rocksdb restore each other's checkpoints
and savepoints; the local working directories go on close and after a failed restore; a
local disk error is a StateError (LocalStateError), not a broken checkpoint. The handle and
bundle formats round-trip and refuse garbage (hypothesis)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import dstl_ray as d
from dstl_ray.errors import FormatError, HandleError
from dstl_ray.format.incremental import (
    RocksDBHandle,
    UploadedFile,
    decode_bundle,
    encode_bundle,
)
from dstl_ray.state.rocksdb import RocksDBStateTable
from dstl_ray.storage.registry import get_storage

from ..ckpt_util import MAXP, client, files, new_base, referenced, workdirs

FULL = d.KeyGroupRange(0, MAXP - 1)
N = 50_000


def _job(base, local, parallelism=1, backend="rocksdb", job="job", **opts):
    coord = d.CheckpointCoordinator(job, base, max_parallelism=MAXP, retained=2)
    bs = coord.restore(client(job, base), "op", parallelism, materialization_interval=None,
                       state_backend=backend, local_dir=str(local), **opts)
    return coord, bs


def _fill(b, n=N, tag="v"):
    s = b.value_state("s")
    for i in range(n):
        s.update(f"key-{i}", f"{tag}-{i}-" + "x" * 80)


_workdirs = workdirs


def test_a_second_materialization_with_1pct_changed_uploads_a_small_fraction(tmp_path):
    base, local = new_base(tmp_path), tmp_path / "local"
    local.mkdir()
    coord, (b,) = _job(base, local)
    _fill(b)
    h1 = b.materialize().result(timeout=60)
    assert isinstance(h1, RocksDBHandle) and h1.ssts
    full = b._files.last_upload_bytes
    assert full >= h1.size * 0.9  # the first uploads everything
    s = b.value_state("s")
    for i in range(0, N, 100):  # 1% of the keys
        s.update(f"key-{i}", "changed")
    h2 = b.materialize().result(timeout=60)
    inc = b._files.last_upload_bytes
    assert inc < full * 0.15, (inc, full)
    shared = {f.path for f in h1.ssts} & {f.path for f in h2.ssts}
    assert shared and all(f.path in shared or f.path not in {g.path for g in h1.ssts}
                          for f in h2.ssts)
    cc = coord.trigger_checkpoint().result()
    assert dict(b.dump()["s"])["key-100"] == "changed"
    coord.shutdown()
    assert not files(base) - referenced(coord) and cc.checkpoint_id == 1


def _runs(table) -> int:
    files = table._db.live_files()
    return sum(f["level"] == 0 for f in files) + len({f["level"] for f in files if f["level"]})


def test_a_bulk_loads_runs_are_merged_before_their_first_upload(tmp_path):
    """Runs not uploaded yet are merged before they go up (once, merged), not uploaded as
    they are and again after universal compaction merges them; a database mostly uploaded
    already is not compacted (only the new run goes up)."""
    base, local = new_base(tmp_path), tmp_path / "local"
    local.mkdir()
    coord, (b,) = _job(base, local)
    s = b.value_state("s")
    for part in range(4):  # four sorted runs, as a bulk load bigger than the memtable
        for i in range(part, N, 4):
            s.update(f"key-{i}", f"v-{i}-" + "x" * 80)
        b._table._db.flush()
    assert _runs(b._table) == 4
    h1 = b.materialize().result(timeout=60)
    assert _runs(b._table) == 1
    assert {f.name for f in h1.ssts} == {f["name"].lstrip("/") for f in b._table._db.live_files()}
    full = b._files.last_upload_bytes
    for i in range(0, N, 100):
        s.update(f"key-{i}", "changed")
    h2 = b.materialize().result(timeout=60)
    assert _runs(b._table) == 2  # the base run, uploaded, and the flushed changes
    assert {f.path for f in h1.ssts} < {f.path for f in h2.ssts}
    assert b._files.last_upload_bytes < full * 0.15
    assert dict(b.dump()["s"])["key-100"] == "changed"
    coord.shutdown()


def test_restore_opens_the_sst_files_and_reuses_them(tmp_path):
    base, local = new_base(tmp_path), tmp_path / "local"
    local.mkdir()
    coord, (b,) = _job(base, local)
    _fill(b)
    b.materialize().result(timeout=60)
    b.value_state("s").update("after", 1)  # in the changelog after the materialization
    cc = coord.trigger_checkpoint().result()
    want = b.dump()
    coord.abandon()  # the driver dies; so does the worker (below, after the restore)
    coord, (r,) = _job(base, local)
    assert r.dump() == want
    b.close()
    restored = {f.path for f in r._files.base[0].ssts}
    r.value_state("s").update("key-1", "new")
    h = r.materialize().result(timeout=60)
    # only the new SST and the bundle went up: the restored ones are named again
    assert restored <= {f.path for f in h.ssts}
    assert r._files.last_upload_bytes < cc.metadata.snapshots[0].components[0].size * 0.1
    coord.trigger_checkpoint().result()
    coord.shutdown()
    assert files(base) == referenced(coord)
    assert _workdirs(local) == []  # closed backends left no working directory


@pytest.mark.parametrize("damage", ["missing", "corrupt", "short"])
def test_a_damaged_sst_fails_the_restore_naming_it(tmp_path, damage):
    base, local = new_base(tmp_path), tmp_path / "local"
    local.mkdir()
    coord, (b,) = _job(base, local)
    _fill(b, 5000)
    h = b.materialize().result(timeout=60)
    cc = coord.trigger_checkpoint().result()
    coord.shutdown()
    victim = f"{base}/job/{h.ssts[0].path}"
    st_ = get_storage(victim)
    data = bytearray(st_.read_file(victim))
    if damage == "missing":
        st_.delete(victim)
    elif damage == "corrupt":
        data[len(data) // 2] ^= 0x01
        st_.write_file(victim, bytes(data))
    else:
        st_.write_file(victim, bytes(data[:-10]))
    elsewhere = tmp_path / "elsewhere"  # another machine: no local copy, every file fetched
    with pytest.raises(d.RestoreError) as ei:
        _job(base, elsewhere)
    assert ei.value.path == victim and victim in str(ei.value)
    assert ei.value.checkpoint == cc.metadata_url
    assert _workdirs(elsewhere) == []  # the failed restore removed its working directory


@pytest.mark.parametrize("src,dst", [("rocksdb", "heap"), ("heap", "rocksdb")])
def test_checkpoints_and_savepoints_move_between_backends(tmp_path, src, dst):
    base, local = new_base(tmp_path), tmp_path / "local"
    local.mkdir()
    coord, bs = _job(base, local, 2, backend=src)
    for b in bs:
        for i in range(2000):
            k = f"k{i}"
            if d.assign_key_group(k, MAXP) in b.key_group_range:
                b.value_state("v").update(k, i)
                b.list_state("l").add(k, [i, "x"])
                b.map_state("m").put(k, i % 3, {"i": i})
        b.materialize().result(timeout=60)
        b.value_state("v").update(next(k for k in (f"z{j}" for j in range(999))
                                       if d.assign_key_group(k, MAXP) in b.key_group_range),
                                  "late")
    want = {n: {k: v for b in bs for k, v in b.dump()[n].items()} for n in ("v", "l", "m")}
    coord.trigger_checkpoint().result()
    sp = coord.trigger_savepoint().result()
    coord.abandon()
    for b in bs:  # its workers die too
        b.close()
    # the checkpoint, at another parallelism, on the other table
    coord, rs = _job(base, local, 3, backend=dst)
    got = {n: {k: v for r in rs for k, v in r.dump()[n].items()} for n in ("v", "l", "m")}
    assert got == want
    coord.shutdown()
    # the savepoint (self-contained .dstm files), restored by another job
    coord = d.CheckpointCoordinator("job2", base, max_parallelism=MAXP)
    rs = coord.restore(client("job2", base), "op", 1, checkpoint=sp.metadata_url,
                       materialization_interval=None, state_backend=dst,
                       local_dir=str(local))
    assert {n: rs[0].dump()[n] for n in ("v", "l", "m")} == want
    coord.shutdown()
    assert _workdirs(local) == []


def test_a_local_disk_error_is_a_state_error_not_a_broken_checkpoint(tmp_path):
    """A file-size limit stands in for a full disk: the restore downloads more than the
    limit allows and fails with LocalStateError (a StateError) naming the directory; the
    checkpoint is not reported as broken."""
    base, local = new_base(tmp_path), tmp_path / "local"
    local.mkdir()
    coord, (b,) = _job(base, local)
    _fill(b, 20_000)
    b.materialize().result(timeout=60)
    coord.trigger_checkpoint().result()
    coord.shutdown()
    local = tmp_path / "elsewhere"  # the restore downloads (no local copy there)
    code = textwrap.dedent(f"""
        import resource, signal, sys
        sys.path.insert(0, {os.getcwd()!r})
        import dstl_ray as d
        from tests.unit.ckpt_util import client
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (64 * 1024, 64 * 1024))
        coord = d.CheckpointCoordinator("job", {base!r}, max_parallelism={MAXP})
        try:
            coord.restore(client("job", {base!r}), "op", 1, materialization_interval=None,
                          state_backend="rocksdb", local_dir={str(local)!r})
        except d.RestoreError as e:
            print("RESTORE-ERROR", e)
        except d.StateError as e:
            print("STATE-ERROR", type(e).__name__, e)
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, cwd=os.getcwd())
    assert "STATE-ERROR LocalStateError" in out.stdout, out.stdout + out.stderr[-2000:]
    assert str(local) in out.stdout
    assert _workdirs(local) == []


def test_a_killed_workers_directory_is_swept_by_the_next_table(tmp_path):
    local = tmp_path / "local"
    local.mkdir()
    code = textwrap.dedent(f"""
        import os
        from dstl_ray.keygroups import KeyGroupRange
        from dstl_ray.state.rocksdb import RocksDBStateTable
        t = RocksDBStateTable(KeyGroupRange(0, 3), {str(local)!r})
        os._exit(9)  # killed: close never runs
    """)
    subprocess.run([sys.executable, "-c", code], timeout=60, cwd=os.getcwd(), check=False)
    assert len(_workdirs(local)) == 1
    t = RocksDBStateTable(FULL, str(local))  # a new worker on the same disk
    assert _workdirs(local) == [os.path.basename(t.path)]
    t.close()
    assert _workdirs(local) == []


def test_a_ttl_purge_lets_writes_in_between_key_groups(tmp_path, monkeypatch):
    """rocksdb: the TTL purge of a materialization holds the backend's lock for one key
    group at a time (state access goes on), and never deletes an entry a write renewed; the
    materialization then takes the sqn with the local checkpoint, so it holds that write."""
    now = [1_700_000_000.0]
    base, local = new_base(tmp_path), tmp_path / "local"
    b = d.ChangelogKeyedStateBackend(client("job", base), "op", FULL, MAXP,
                                     materialization_interval=None, ttl_clock=lambda: now[0],
                                     state_backend="rocksdb", local_dir=str(local))
    vs = b.value_state("t", ttl=10)
    keys = [f"k{i}" for i in range(200)]
    for k in keys:
        vs.update(k, "old")
    now[0] += 20  # every entry expired
    late = next(k for k in keys if d.assign_key_group(k, MAXP) == MAXP - 1)
    paused, go = threading.Event(), threading.Event()
    orig = RocksDBStateTable._purge_key_group

    def slow(self, kg, *a):
        if kg == MAXP // 2 and not paused.is_set():
            paused.set()
            assert go.wait(30)
        return orig(self, kg, *a)

    monkeypatch.setattr(RocksDBStateTable, "_purge_key_group", slow)
    f = b.materialize()
    assert paused.wait(30)
    t0 = time.monotonic()
    vs.update(late, "renewed")  # the lock is free between key groups
    assert time.monotonic() - t0 < 5
    go.set()
    h = f.result(timeout=60)
    assert b.dump()["t"] == {late: "renewed"}
    snap = d.KeyedStateSnapshot("op", FULL, (h,))
    b.close()
    r = d.ChangelogKeyedStateBackend(client("job2", base), "op", FULL, MAXP,
                                     materialization_interval=None, ttl_clock=lambda: now[0],
                                     state_backend="rocksdb", local_dir=str(local),
                                     restore=[d.RestoreSource(snap, base, "job", "t")])
    assert r.dump()["t"] == {late: "renewed"}
    r.close()


# ------------------------------------------------------------------ formats

_names = st.integers(0, 10**6).map(lambda i: f"{i:06d}.sst")


@st.composite
def handles(draw) -> RocksDBHandle:
    names = draw(st.lists(_names, unique=True, max_size=5))
    ssts = tuple(UploadedFile(n, f"mat/{i}.sst", draw(st.integers(0, 2**40)),
                              draw(st.integers(0, 2**32 - 1))) for i, n in enumerate(names))
    start = draw(st.integers(0, 100))
    kgr = d.KeyGroupRange(start, start + draw(st.integers(0, 100)))
    states = tuple((f"s{i}", k) for i, k in enumerate(
        draw(st.lists(st.sampled_from(["value", "list", "map"]), max_size=3))))
    return RocksDBHandle("job", kgr, states, ssts,
                         UploadedFile("bundle", "mat/b.rdbm", 10, 1), draw(st.integers(0, 99)))


@settings(max_examples=100, deadline=None)
@given(handles())
def test_rocksdb_handle_round_trips(h):
    assert RocksDBHandle.from_dict(h.to_dict()) == h


@pytest.mark.parametrize("field,value", [
    ("ssts", [["../x.sst", "mat/a.sst", 1, 1]]),
    ("ssts", [["000001.sst", "../../etc/passwd.sst", 1, 1]]),
    ("ssts", [["000001.sst", "mat/a.sst", 1, 2**32]]),
    ("ssts", [["000001.sst", "mat/a.sst", 1, 1], ["000001.sst", "mat/b.sst", 1, 1]]),
    ("ssts", [["000001.sst", "mat/a.dstm", 1, 1]]),
    ("bundle", ["bundle", "mat/b.sst", 1, 1]),
    ("job", None),
])
def test_forged_rocksdb_handles_are_refused(field, value):
    d_ = RocksDBHandle("job", FULL, (("s", "value"),), (),
                       UploadedFile("bundle", "mat/b.rdbm", 1, 1)).to_dict()
    d_[field] = value
    with pytest.raises(HandleError):
        RocksDBHandle.from_dict(d_)


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["CURRENT", "MANIFEST-000001", "OPTIONS-000007",
                                           "000004.log"]), st.binary(max_size=64)),
                max_size=4))
def test_bundle_round_trips(files_):
    assert decode_bundle(encode_bundle(files_), "x") == files_


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=200))
def test_bundle_garbage_raises_format_error(data):
    try:
        decode_bundle(data, "x")
    except FormatError:
        pass


def test_a_bundle_cannot_smuggle_a_path():
    with pytest.raises(FormatError, match="named"):
        decode_bundle(encode_bundle([("../../CURRENT", b"x")]), "x")


def test_a_compaction_before_upload_blocks_neither_views_nor_state_access(tmp_path):
    """A savepoint takes its view under the backend's lock: waiting there for a full
    compaction would stall every state access. Views and writes go on while it runs; close
    waits for it."""
    t = RocksDBStateTable(FULL, str(tmp_path))
    t.add_state(d.StateKind.VALUE)
    for part in range(4):
        wb_keys = range(part, 400_000, 4)
        for i in wb_keys:
            t.set_value(0, i % MAXP, b"k%09d" % i, b"v" * 100)
        t._db.flush()
    done: list[float] = []
    th = threading.Thread(target=lambda: (t.compact_before_upload(set()),
                                          done.append(time.perf_counter())))
    th.start()
    deadline = time.perf_counter() + 10
    while not t._compacting and not done and time.perf_counter() < deadline:
        time.sleep(0.001)
    assert t._compacting, "the compaction did not start (or ended too fast to test)"
    view = t.view()
    t.set_value(0, 1, b"during", b"x")
    seen = time.perf_counter()
    th.join()
    assert seen < done[0]  # the view and the write did not wait for the compaction
    assert sum(len(view[0][kg]) for kg in view[0]) == 400_000
    t.close()
    assert not os.path.exists(t.path)
