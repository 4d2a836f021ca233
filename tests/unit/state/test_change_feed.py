"""The change feed between two checkpoints (dstl_ray.checkpoint.change_feed; Spark's
readChangeFeed): every change of a state after checkpoint A up to checkpoint B, per key in the
order made, decoded (TTL stamps stripped); key-group ranges split it; a log started by a
restore after A counts from its beginning; a window a materialization truncated is read as
a diff of the two states (issue 30 item 7: any window of retained checkpoints); a reversed
window, savepoints and other jobs are errors that say why."""

from __future__ import annotations

import pytest

import dstl_ray as d
from dstl_ray.checkpoint.change_feed import CHANGELOG, DIFF, read_change_feed, window_mode
from dstl_ray.errors import StateError

from ..ckpt_util import MAXP, client, new_base


def _job(base, parallelism=2, restore=None, mat=None):
    coord = d.CheckpointCoordinator("job", base, max_parallelism=MAXP, retained=5)
    bs = coord.restore(client("job", base), "op", parallelism, materialization_interval=mat)
    return coord, bs


def _restart(base, coord, b):
    """The job fails and starts again: its backends restore the latest checkpoint, each
    with a new log (the old one stays in their snapshots until a materialization)."""
    coord.abandon()
    b.close()
    return _job(base, parallelism=1)


def _owner(bs, k):
    return next(b for b in bs if b.key_group_range.start <= d.assign_key_group(k, MAXP)
                <= b.key_group_range.end)


def _per_key(changes):
    out: dict = {}
    for c in changes:
        out.setdefault(c.key, []).append((c.op, c.user_key, c.value))
    return out


def test_the_feed_holds_every_change_after_a_up_to_b_in_order(tmp_path):
    base = new_base(tmp_path)
    coord, bs = _job(base)
    for i in range(50):
        b = _owner(bs, f"k{i}")
        b.value_state("v").update(f"k{i}", "before")
        b.map_state("m").put(f"k{i}", "x", 0)
    a = coord.trigger_checkpoint().result()
    want: dict = {}
    for i in range(0, 50, 2):
        k, b = f"k{i}", _owner(bs, f"k{i}")
        b.value_state("v").update(k, i)
        b.value_state("v").update(k, i + 1)
        want.setdefault(k, []).extend([("value_set", None, i), ("value_set", None, i + 1)])
        if i % 4 == 0:
            b.value_state("v").clear(k)
            want[k].append(("value_clear", None, None))
        b.map_state("m").put(k, "y", [i])  # another state: not in v's feed
    b_ = coord.trigger_checkpoint().result()
    got = list(read_change_feed(a.metadata_url, b_.metadata_url, "v"))
    assert _per_key(got) == want
    assert all(c.sqn > 0 and len(c.log) == 32 for c in got)
    m = _per_key(read_change_feed(a.metadata_url, b_.metadata_url, "m"))
    assert m == {f"k{i}": [("map_put", "y", [i])] for i in range(0, 50, 2)}
    parts = [list(read_change_feed(a.metadata_url, b_.metadata_url, "v", parts=3, index=i))
             for i in range(3)]
    assert sorted(map(repr, sum(parts, []))) == sorted(map(repr, got))
    assert not set.intersection(*({c.key for c in p} for p in parts))
    with pytest.raises(StateError, match="from an earlier checkpoint to a later one"):
        list(read_change_feed(b_.metadata_url, a.metadata_url, "v"))
    coord.shutdown()


def test_list_and_ttl_changes_are_decoded(tmp_path):
    base = new_base(tmp_path)
    coord, (b,) = _job(base, parallelism=1)
    a = coord.trigger_checkpoint().result()
    lst, t = b.list_state("l"), b.value_state("t", ttl=60)
    lst.add("k", 1)
    lst.update("k", [2, 3])
    lst.clear("k")
    t.update("k", {"x": 1})
    c = coord.trigger_checkpoint().result()
    assert [(x.op, x.value) for x in read_change_feed(a.metadata_url, c.metadata_url, "l")] \
        == [("list_add", 1), ("list_set", [2, 3]), ("list_clear", None)]
    assert [(x.op, x.value) for x in read_change_feed(a.metadata_url, c.metadata_url, "t")] \
        == [("value_set", {"x": 1})]
    coord.shutdown()


def test_a_window_a_materialization_truncated_is_read_as_a_diff(tmp_path):
    """Regression (issue 30 item 7): a window with a materialization in it failed with
    "log ... was truncated ... no longer held", whatever its length."""
    base = new_base(tmp_path)
    coord, (b,) = _job(base, parallelism=1)
    v, lst, m = b.value_state("v"), b.list_state("l"), b.map_state("m")
    for k in ("k", "same", "gone"):
        v.update(k, 1)
    lst.update("k", [1])
    lst.update("gone", [1])
    m.put("k", "x", 1)
    m.put("k", "drop", 1)
    m.put("gone", "x", 1)
    a = coord.trigger_checkpoint().result()
    v.update("k", 2)
    b.materialize().result(timeout=60)  # truncates the log after A's position
    v.update("k", 3)
    v.clear("gone")
    v.update("new", 7)
    lst.add("k", 2)
    lst.clear("gone")
    m.put("k", "x", 2)
    m.remove("k", "drop")
    m.put("k", "add", 3)
    m.clear("gone")
    c = coord.trigger_checkpoint().result()
    assert window_mode(a.metadata_url, c.metadata_url, "v") == DIFF
    got = list(read_change_feed(a.metadata_url, c.metadata_url, "v"))
    assert _per_key(got) == {"k": [("value_set", None, 3)],  # net: 2 is not seen
                             "new": [("value_set", None, 7)],
                             "gone": [("value_clear", None, None)]}
    assert all((x.log, x.order, x.sqn) == ("", 0, 0) for x in got)
    assert _per_key(read_change_feed(a.metadata_url, c.metadata_url, "l")) == {
        "k": [("list_set", None, [1, 2])], "gone": [("list_clear", None, None)]}
    m_feed = _per_key(read_change_feed(a.metadata_url, c.metadata_url, "m"))
    assert sorted(m_feed["k"], key=repr) == sorted(
        [("map_put", "x", 2), ("map_put", "add", 3), ("map_remove", "drop", None)], key=repr)
    assert m_feed["gone"] == [("map_clear", None, None)]
    parts = [list(read_change_feed(a.metadata_url, c.metadata_url, "v", parts=3, index=i))
             for i in range(3)]
    assert sorted(map(repr, sum(parts, []))) == sorted(map(repr, got))
    # from the materialization on, the changelog holds the window again
    v.update("k", 4)
    e = coord.trigger_checkpoint().result()
    assert window_mode(c.metadata_url, e.metadata_url, "v") == CHANGELOG
    assert [x.value for x in read_change_feed(c.metadata_url, e.metadata_url, "v")] == [4]
    coord.shutdown()


def test_a_log_begun_by_a_restore_after_a_counts_from_its_beginning(tmp_path):
    base = new_base(tmp_path)
    coord, (b,) = _job(base, parallelism=1)
    b.value_state("v").update("k", 1)
    a = coord.trigger_checkpoint().result()
    b.value_state("v").update("k", "lost")  # never in a checkpoint: the job fails here
    coord2, (b2,) = _restart(base, coord, b)  # restores A: a new log
    b2.value_state("v").update("k", 2)
    c = coord2.trigger_checkpoint().result()
    assert [(x.op, x.value) for x in read_change_feed(a.metadata_url, c.metadata_url, "v")] \
        == [("value_set", 2)]
    coord2.shutdown()


def test_a_log_empty_at_a_and_truncated_since_is_not_read_from_its_truncation(tmp_path):
    """A snapshot leaves an empty log out: a subtask quiet at A, then changed and
    materialized before B, must not give a feed that starts at the materialization (the
    changes before it are gone): the window is read as a diff."""
    base = new_base(tmp_path)
    coord, (b,) = _job(base, parallelism=1)
    v = b.value_state("v")
    v.update("k", 1)
    b.materialize().result(timeout=60)
    a = coord.trigger_checkpoint().result()  # nothing since the materialization
    v.update("k", 2)  # only in the log until the next materialization ...
    b.materialize().result(timeout=60)
    v.update("k", 3)
    c = coord.trigger_checkpoint().result()
    assert window_mode(a.metadata_url, c.metadata_url, "v") == DIFF
    assert [(x.op, x.value) for x in read_change_feed(a.metadata_url, c.metadata_url, "v")] \
        == [("value_set", 3)]
    coord.shutdown()


def test_changes_across_a_restore_sort_by_order_then_sqn(tmp_path):
    base = new_base(tmp_path)
    coord, (b,) = _job(base, parallelism=1)
    a = coord.trigger_checkpoint().result()
    for i in range(5):
        b.value_state("v").update("k", i)
    coord.trigger_checkpoint().result()
    coord2, (b2,) = _restart(base, coord, b)  # the old log stays in its snapshots
    for i in range(5, 7):
        b2.value_state("v").update("k", i)
    c = coord2.trigger_checkpoint().result()
    got = list(read_change_feed(a.metadata_url, c.metadata_url, "v"))
    assert len({x.log for x in got}) == 2
    assert [x.value for x in sorted(got, key=lambda x: (x.order, x.sqn))] == list(range(7))
    coord2.shutdown()


def test_savepoints_other_jobs_and_unknown_states_are_refused(tmp_path):
    base = new_base(tmp_path)
    coord, (b,) = _job(base, parallelism=1)
    b.value_state("v").update("k", 1)
    a = coord.trigger_checkpoint().result()
    sp = coord.trigger_savepoint().result()
    b.value_state("v").update("k", 2)
    c = coord.trigger_checkpoint().result()
    with pytest.raises(StateError, match="is a savepoint"):
        list(read_change_feed(sp.metadata_url, c.metadata_url, "v"))
    with pytest.raises(StateError, match=r"no state 'nope'.*\['v'\]"):
        list(read_change_feed(a.metadata_url, c.metadata_url, "nope"))
    other = d.CheckpointCoordinator("other", base, max_parallelism=MAXP, retained=5)
    (o,) = other.restore(client("other", base), "op", 1, materialization_interval=None)
    o.value_state("v").update("k", 9)
    for _ in range(3):
        oc = other.trigger_checkpoint().result()
    with pytest.raises(StateError, match="within one job"):
        list(read_change_feed(a.metadata_url, oc.metadata_url, "v"))
    other.shutdown()
    coord.shutdown()
