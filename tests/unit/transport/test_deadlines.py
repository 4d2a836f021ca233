"""The persist deadlines of a writer's calls (dstl_ray.transport.deadlines): an entry leaves
the table once, answered in time or expired, so an answer after its deadline is late."""

from __future__ import annotations

from dstl_ray.transport.deadlines import Deadlines


def test_an_entry_is_answered_or_expired_never_both():
    table: Deadlines[str] = Deadlines()
    a, b = table.add(10.0, "a"), table.add(20.0, "b")
    assert a != b and len(table) == 2 and table.nearest() == 10.0
    assert table.take_expired(9.9) == []
    assert table.take_expired(10.0) == ["a"]
    assert table.pop(a) is None  # its answer is late
    assert table.nearest() == 20.0
    assert table.pop(b) == "b" and table.take_expired(30.0) == []
    assert table.nearest() is None and len(table) == 0


def test_take_all_empties_the_table():
    table: Deadlines[int] = Deadlines()
    n = table.add(5.0, 1)
    table.add(1.0, 2)
    assert sorted(table.take_all()) == [1, 2]
    assert table.pop(n) is None and table.nearest() is None
