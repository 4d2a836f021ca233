"""SharedStateRegistry properties (hypothesis): a file is deleted exactly when no retained or
pending checkpoint and no backend pin references it; never a protected file. Files are
told apart by their full URL: one of the same name at another path (a copy of the job's
directory) is another file."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from dstl_ray import SharedStateRegistry
from dstl_ray.storage.base import normalize_url
from dstl_ray.storage.deleter import Deleter

NAMES = [f"f{i}" for i in range(6)]
ops = st.lists(st.one_of(
    st.tuples(st.just("start"), st.sampled_from(NAMES).map(lambda _: 0)),
    st.tuples(st.just("register"), st.sets(st.sampled_from(NAMES), max_size=4)),
    st.tuples(st.just("finish"), st.integers(0, 5)),
    st.tuples(st.just("release"), st.integers(0, 5)),
    st.tuples(st.just("pin"), st.tuples(st.sampled_from("ab"),
                                        st.sets(st.sampled_from(NAMES), max_size=3))),
    st.tuples(st.just("consider"), st.sets(st.sampled_from(NAMES), max_size=3)),
), max_size=40)


@settings(max_examples=300, deadline=None)
@given(ops, st.sets(st.sampled_from(NAMES), max_size=2))
def test_registry_deletes_only_unreferenced(script, protected):
    deleted: list[str] = []
    reg = SharedStateRegistry(delete=deleted.append, deleter=Deleter(workers=0))
    reg.protect({f"memory://x/{n}" for n in protected})
    started: list[int] = []
    refs: dict[int, set[str]] = {}
    pending: set[int] = set()
    pins: dict[str, set[str]] = {}
    known: set[str] = set()
    for op, arg in script:
        gone = {u.rsplit("/", 1)[-1] for u in deleted}
        if op in ("register", "pin", "consider"):  # a deleted name never comes back
            arg = (arg[0], arg[1] - gone) if op == "pin" else arg - gone
        if op == "start":
            cid = len(started) + 1
            started.append(cid)
            pending.add(cid)
            reg.checkpoint_started(cid)
        elif op == "register" and pending:
            cid = max(pending)
            reg.register(cid, {n: f"memory://x/{n}" for n in arg})
            refs.setdefault(cid, set()).update(arg)
            known |= arg
        elif op == "finish" and started:
            cid = started[arg % len(started)]
            pending.discard(cid)
            reg.checkpoint_finished(cid)
        elif op == "release" and started:
            cid = started[arg % len(started)]
            pending.discard(cid)
            refs.pop(cid, None)
            reg.release(cid)
        elif op == "pin":
            owner, names = arg
            pins[owner] = set(names)
            known |= set(names)
            reg.set_pins(owner, {n: f"memory://x/{n}" for n in names})
        elif op == "consider":  # a late handle's files its backend never pinned
            known |= arg
            reg.consider({n: f"memory://x/{n}" for n in arg})
        live = set().union(*refs.values(), *pins.values())
        gone = {u.rsplit("/", 1)[-1] for u in deleted}
        assert not gone & live, "deleted a referenced file"
        assert not gone & protected
        assert len(deleted) == len(gone), "deleted twice"
        if not pending:  # with nothing pending, every unreferenced file is gone
            assert gone == known - live - protected


def test_files_of_one_name_at_two_paths_are_two_files():
    """A backup copy of the job's directory holds files of the job's own names: protecting
    the copy's (a NO_CLAIM restore from it) must not keep the job's own forever, and each
    path is counted and deleted on its own (keyed by name, the second URL was never
    deleted and one checkpoint's release dropped the other's count)."""
    deleted: list[str] = []
    reg = SharedStateRegistry(delete=deleted.append, deleter=Deleter(workers=0))
    own, copy = "file:///dfs/job/mat/a.dstm", "file:///backup/job/mat/a.dstm"
    reg.protect({"a.dstm": copy})
    reg.checkpoint_started(1)
    reg.register(1, {"a.dstm": own})
    reg.checkpoint_started(2)
    reg.register(2, {"a.dstm": copy})
    reg.checkpoint_finished(1)
    reg.checkpoint_finished(2)
    assert reg.reference_count(own) == reg.reference_count(copy) == 1
    reg.release(1)
    assert deleted == [own]  # the job's own file goes; the protected copy has the same name
    reg.release(2)
    assert deleted == [own]  # never the protected copy
    reg.checkpoint_started(3)
    reg.register(3, {"b.dstl": "file:///dfs/job/dstl/b.dstl"})
    reg.register(3, {"b.dstl": "file:///dfs//job/./dstl/b.dstl"})  # one file, two spellings
    assert reg.reference_count("file:///dfs/job/dstl/b.dstl") == 1
    reg.checkpoint_finished(3)
    reg.release(3)
    assert deleted == [own, "file:///dfs/job/dstl/b.dstl"]


def test_one_file_is_one_key_however_a_listing_spells_it():
    """A file a retained checkpoint names as ``memory:///m/...`` is the file a listing of a
    released directory finds as ``memory://m/...``: one key, so the listing never makes it a
    candidate (two keys deleted a file a retained checkpoint still named)."""
    from dstl_ray.storage.registry import get_storage

    st_ = get_storage("memory:///m")
    url = "memory:///regkey-m/job/shared/d/f.seg"
    st_.write_file(url, b"x")
    assert st_.list_files("memory:///regkey-m/job/shared/d") == [
        "memory://regkey-m/job/shared/d/f.seg"]
    deleted: list[str] = []
    reg = SharedStateRegistry(delete=deleted.append, list_files=st_.list_files,
                              deleter=Deleter(workers=0))
    reg.set_claims("backend", ["memory:///regkey-m/job/shared/d/"])
    reg.checkpoint_started(1)
    reg.register(1, {"f.seg": url})
    reg.checkpoint_finished(1)
    reg.set_claims("backend", [])  # its subtask rescaled away: listed, back to counting
    assert deleted == []
    assert reg.reference_count("memory://regkey-m/job/shared/d/f.seg") == 1
    reg.release(1)
    assert [normalize_url(u) for u in deleted] == ["memory://regkey-m/job/shared/d/f.seg"]


def test_a_claim_spelled_otherwise_still_claims():
    """A claimed directory spelled ``file:////dfs//job/shared/d`` covers the file
    ``file:///dfs/job/shared/d/f``: its owner deletes it, the registry never does."""
    deleted: list[str] = []
    reg = SharedStateRegistry(delete=deleted.append, deleter=Deleter(workers=0))
    reg.set_claims("backend", ["file:////dfs//job/shared/d"])
    reg.checkpoint_started(1)
    reg.register(1, {"f": "file:///dfs/job/shared/d/f"})
    reg.checkpoint_finished(1)
    reg.release(1)
    assert deleted == []


def test_two_checkpoints_of_one_id_hold_their_references_apart():
    """References are held per metadata URL: the job's own checkpoint 2 and a claimed
    checkpoint 2 of another job; releasing one leaves the other's files counted."""
    deleted: list[str] = []
    reg = SharedStateRegistry(delete=deleted.append, deleter=Deleter(workers=0))
    own, theirs = "file:///dfs/job/chk-2/_metadata", "file:///dfs/other/chk-2/_metadata"
    reg.register(own, {"a": "file:///dfs/job/mat/a", "s": "file:///dfs/shared/s"})
    reg.register(theirs, {"b": "file:///dfs/other/mat/b", "s": "file:///dfs/shared/s"})
    reg.release(own)
    assert deleted == ["file:///dfs/job/mat/a"]
    assert reg.reference_count("file:///dfs/shared/s") == 1
    reg.release("file:///dfs//other/chk-2/_metadata/")  # one checkpoint, any spelling
    assert sorted(deleted) == ["file:///dfs/job/mat/a", "file:///dfs/other/mat/b",
                               "file:///dfs/shared/s"]


def test_considered_file_waits_for_the_checkpoints_pending_then():
    """A late handle's file (never pinned) is considered while checkpoint 2 is pending: 2
    may name it (its snapshot reused the same upload), so it stays until 2 is over, and
    lives while 2 is retained if 2 registers it. A checkpoint started after the file was
    considered (3) does not hold it up: no snapshot started then can name it."""
    late = {"u.dstl": "memory://x/job/dstl/u.dstl"}
    for registered in (True, False):
        deleted: list[str] = []
        reg = SharedStateRegistry(delete=deleted.append, deleter=Deleter(workers=0))
        reg.checkpoint_started(1)
        reg.checkpoint_started(2)
        reg.release(1)  # declined
        reg.consider(late)
        reg.checkpoint_started(3)
        assert deleted == []
        if registered:  # 2 completes naming it
            reg.register(2, late)
            reg.checkpoint_finished(2)
            assert deleted == []
            reg.checkpoint_finished(3)
            assert deleted == []  # retained checkpoint 2 references it
            reg.release(2)  # subsumed
        else:  # 2 is declined before its snapshot came in; 3 is still pending
            reg.release(2)
        assert deleted == ["memory://x/job/dstl/u.dstl"]


def test_considered_file_kept_while_pinned_referenced_or_protected():
    """Considering a file changes nothing while a backend pins it, a checkpoint references
    it or it is protected: it goes when the last use drops, as any other."""
    deleted: list[str] = []
    reg = SharedStateRegistry(delete=deleted.append, deleter=Deleter(workers=0))
    a, b, c = (f"memory://x/job/dstl/{n}.dstl" for n in "abc")
    reg.set_pins("backend", {"a": a})
    reg.register("memory://x/job/chk-1/_metadata", {"b": b})
    reg.protect([c])
    reg.consider({"a": a, "b": b, "c": c})
    assert deleted == []
    reg.unpin_all("backend")
    reg.release("memory://x/job/chk-1/_metadata")
    assert sorted(deleted) == [a, b]  # never the protected one
