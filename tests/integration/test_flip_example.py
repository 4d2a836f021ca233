"""FLIP-158 "Example", step by step (CP1..CP3, T0..T4), on a real Ray tree over file://.

Numbering: a changeset is labelled by the sqn ``last_appended_sqn`` returns when it is closed,
so (Ti:Tj] holds the changes appended between the two calls. ``persist_durably(after)`` ships
sqn > after; ``truncate(before)`` drops sqn <= before.
"""

from __future__ import annotations

import os

from dstl_ray import KeyGroupRange, StateChangelogClient


def _files(root):
    return {os.path.join(d, f) for d, _, fs in os.walk(root) for f in fs if f.endswith(".dstl")}


def test_flip158_example(tree_factory, namespace, tmp_path):
    tree_factory(base=f"file://{tmp_path}/dfs")
    client = StateChangelogClient("flip-example", namespace=namespace)
    list_state = client.create_writer("list-op", KeyGroupRange(0, 0))
    kg = 0

    # On startup the state is empty: sqn = T0, lastMaterializedSqn = T0
    t0 = list_state.last_appended_sqn()
    last_materialized = t0
    assert t0 == 0

    list_state.append(kg, b"a")  # list.add(a)
    cp1 = list_state.persist_durably(after=last_materialized)  # CP1 -> sqn = T1
    t1 = list_state.last_appended_sqn()
    assert t1 == 1

    list_state.append(kg, b"b")  # list.add(b)
    t2 = list_state.last_appended_sqn()  # materialization triggered: T2, state (T0:T2] = a,b
    assert t2 == 2
    materialized = [b"a", b"b"]

    list_state.append(kg, b"c")  # list.add(c)
    cp2 = list_state.persist_durably(after=last_materialized)  # CP2 -> T3
    t3 = list_state.last_appended_sqn()
    assert t3 == 3

    h1 = cp1.result(timeout=30)  # CP1 future: (T0:T1] = a, one file on DFS
    assert list(h1.get_state_changes(kg)) == [b"a"]
    assert len(h1.file_paths()) == 1
    f1 = h1.file_paths()[0]

    h2 = cp2.result(timeout=30)  # CP2 future: combined handle, two files
    assert list(h2.get_state_changes(kg)) == [b"a", b"b", b"c"]
    assert len(h2.file_paths()) == 2 and f1 in h2.file_paths()
    f2 = next(p for p in h2.file_paths() if p != f1)

    # JM finalizes CP1, then CP2; CP1 is subsumed (max retained 1) but nothing is removed:
    retained = {"cp2": set(h2.file_paths())}
    assert f1 in set().union(*retained.values())

    # materialization completes: lastMaterializedSqn = T2, truncate(before = T2)
    last_materialized = t2
    list_state.truncate(before=t2)
    assert list_state.retained_sqns() == [t3]

    list_state.append(kg, b"d")  # list.add(d)
    h3 = list_state.persist_durably(after=last_materialized).result(timeout=30)  # CP3 -> T4
    t4 = list_state.last_appended_sqn()
    assert t4 == 4
    # the handle specifies the range (T2:T4]: (T1:T3] = b,c is reused with b filtered out
    assert (h3.sqn_from, h3.sqn_to) == (t2, t4)
    assert list(h3.get_state_changes(kg)) == [b"c", b"d"]
    assert f2 in h3.file_paths() and f1 not in h3.file_paths()
    # recovery = materialized (a, b) + changelog (c, d)
    assert materialized + list(h3.get_state_changes(kg)) == [b"a", b"b", b"c", b"d"]

    # JM finalizes CP3, CP2 is subsumed: the file holding (T0:T1] = a is no longer referenced
    retained = {"cp3": set(h3.file_paths())}
    unreferenced = (set(h1.file_paths()) | set(h2.file_paths())) - set().union(
        *retained.values())
    assert unreferenced == {f1}
    on_disk = {"file://" + p for p in _files(tmp_path / "dfs")}
    assert on_disk == {f1, f2} | set(h3.file_paths())
    list_state.close()
