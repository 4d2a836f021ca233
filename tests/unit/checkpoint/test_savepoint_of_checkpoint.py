"""A savepoint of a complete checkpoint (``CheckpointCoordinator.trigger_savepoint(of=...)``,
dstl_ray.checkpoint.savepoint_parts): what a job whose backends live elsewhere (the Spark
operator) takes. It holds exactly that checkpoint's state (materialized part and changelog on
top), not the backends' later changes; it names only files in its own directory; it restores
at another parallelism and by another job; the checkpoint's files are only read; a part that
cannot read its checkpoint fails the savepoint and leaves nothing behind."""

from __future__ import annotations

import pytest

import dstl_ray as d
from dstl_ray.checkpoint.reader import read_states
from dstl_ray.errors import CheckpointDeclinedError
from dstl_ray.storage.registry import get_storage

from ..ckpt_util import MAXP, client, dump_all, new_base


def _job(base, table, tmp_path, parallelism=2):
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
    base = new_base(tmp_path)
    coord, bs = _job(base, "heap", tmp_path)
    _fill(bs, 0, 100, "a")
    cc = coord.trigger_checkpoint().result()
    gone = sorted(u for u in cc.files.values() if "/savepoint-" not in u)[0]
    get_storage(gone).delete(gone)
    with pytest.raises(CheckpointDeclinedError, match="savepoint"):
        coord.trigger_savepoint(of=cc).result(timeout=60)
    storage = get_storage(base)
    assert not [u for u in storage.list_files(f"{base}/job") if "/savepoint-" in u]
    coord.shutdown()
