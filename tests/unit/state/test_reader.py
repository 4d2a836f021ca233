"""The state reader (dstl_ray.checkpoint.reader; Flink's State Processor API): the state of a
checkpoint or savepoint read without running the job equals what the job's backends hold,
whichever table wrote it (heap, or rocksdb with a materialized handle plus changelog); key-group
ranges split it without overlap; expired TTL entries are left out; a job directory means its
latest checkpoint; bad sources, operators and states are errors naming what exists."""

from __future__ import annotations

import pytest

import dstl_ray as d
from dstl_ray.checkpoint.reader import operator_states, read_range, read_state, resolve_checkpoint
from dstl_ray.errors import RestoreError, StateError
from dstl_ray.state.records import StateKind

from ..ckpt_util import MAXP, client, new_base

N = 600


def _job(base, table, tmp_path, job="job", parallelism=2):
    coord = d.CheckpointCoordinator(job, base, max_parallelism=MAXP, retained=3)
    bs = coord.restore(client(job, base), "op", parallelism, materialization_interval=None,
                       state_backend=table, local_dir=str(tmp_path / "local"))
    return coord, bs


def _owned(b, k):
    return b.key_group_range.start <= d.assign_key_group(k, MAXP) <= b.key_group_range.end


def _fill(bs, lo, hi, tag):
    for b in bs:
        v, lst, m = b.value_state("v"), b.list_state("l"), b.map_state("m")
        for i in range(lo, hi):
            k = f"k{i}"
            if _owned(b, k):
                v.update(k, f"{tag}{i}")
                lst.add(k, i)
                m.put(k, i % 7, [tag, i])


def _merged(bs):
    out: dict = {}
    for b in bs:
        for name, entries in b.dump().items():
            out.setdefault(name, {}).update(entries)
    return out


@pytest.mark.parametrize("table", ["heap", "rocksdb"])
def test_the_read_state_equals_the_backends_state(tmp_path, table):
    base = new_base(tmp_path)
    coord, bs = _job(base, table, tmp_path)
    _fill(bs, 0, N, "a")
    for b in bs:
        b.materialize(force=True).result(timeout=60)  # materialized part ...
    _fill(bs, N // 2, N + 100, "b")  # ... and changelog on top (overwrites and new keys)
    cc = coord.trigger_checkpoint().result()
    want = _merged(bs)
    assert len(want["v"]) == N + 100
    for name in ("v", "l", "m"):
        assert read_state(cc.metadata_url, name) == want[name], name
        parts = [dict(read_range(cc.metadata_url, "op", name, 5, i)) for i in range(5)]
        assert sum(len(p) for p in parts) == len(want[name])  # disjoint ...
        assert {k: v for p in parts for k, v in p.items()} == want[name]  # ... and complete
    # a job directory is its latest checkpoint; a savepoint reads the same
    _fill(bs, 0, 10, "c")
    cc2 = coord.trigger_checkpoint().result()
    assert resolve_checkpoint(f"{base}/job") == cc2.metadata_url
    assert read_state(f"{base}/job", "v")["k3"] == "c3"
    sp = coord.trigger_savepoint().result()
    assert read_state(sp.metadata_url.rsplit("/", 1)[0], "m") == _merged(bs)["m"]
    assert operator_states(sp, "op")["l"].kind is StateKind.LIST
    coord.shutdown()


def test_expired_ttl_entries_are_left_out(tmp_path):
    base = new_base(tmp_path)
    coord, (b,) = _job(base, "heap", tmp_path, parallelism=1)
    t = b.value_state("t", ttl=10)
    b.value_state("plain").update("k", 1)
    t.update("k", 1)
    cc = coord.trigger_checkpoint().result()
    # judged at a time (ms since the epoch) long before, and long after, the write
    assert read_state(cc.metadata_url, "t", now_ms=0) == {"k": 1}
    assert read_state(cc.metadata_url, "t", now_ms=10**15) == {}
    assert read_state(cc.metadata_url, "plain", now_ms=10**15) == {"k": 1}
    assert operator_states(cc, "op")["t"].ttl_ms == 10_000
    coord.shutdown()


def test_bad_sources_operators_and_states_are_named(tmp_path):
    base = new_base(tmp_path)
    with pytest.raises(RestoreError, match="no complete checkpoint under"):
        resolve_checkpoint(f"{base}/nothing-here")
    coord, bs = _job(base, "heap", tmp_path)
    _fill(bs, 0, 20, "a")
    cc = coord.trigger_checkpoint().result()
    with pytest.raises(StateError, match=r"no operator 'other' \(it has 'op'\)"):
        read_state(cc.metadata_url, "v", operator_id="other")
    with pytest.raises(StateError, match=r"no state 'nope'.*\['l', 'm', 'v'\]"):
        read_state(cc.metadata_url, "nope")
    coord.shutdown()
