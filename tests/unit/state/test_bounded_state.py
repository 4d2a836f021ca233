"""Nothing grows without bound over a long run (a backend without a registry, as in a Spark
task, and the shared state registry); experiments/soak.py measures it over 10,000
checkpoints on a real tree."""

from __future__ import annotations

import dstl_ray as d
from dstl_ray.state.registry import SharedStateRegistry
from dstl_ray.transport.direct import DirectTransport

from ..ckpt_util import MAXP


def test_a_backend_without_registry_forgets_files_it_can_no_longer_name(tmp_path):
    base = f"file://{tmp_path}/dfs"
    client = d.StateChangelogClient("job", transport=DirectTransport("job", base))
    b = d.ChangelogKeyedStateBackend(client, "op", d.KeyGroupRange(0, MAXP - 1), MAXP,
                                     materialization_interval=None)
    state = b.value_state("v")
    for cid in range(1, 121):
        state.update(cid % 7, cid)
        if cid % 10 == 0:
            b.materialize().result(timeout=30)
        b.snapshot(cid).result(timeout=30)
        assert len(b._files.segment_files) <= 10, cid  # at most the files since materializing
    b.close()


def test_registry_tables_stay_bounded_over_many_checkpoints():
    deleted: list[str] = []
    reg = SharedStateRegistry(delete=deleted.append)
    reg.set_claims("node", ["memory://b/job/segments/x"])
    for cid in range(1, 3001):
        reg.checkpoint_started(cid)
        reg.register(cid, {f"f{cid}": f"memory://b/job/dstl/f{cid}",
                           f"m{cid // 50}": f"memory://b/job/segments/x/m{cid // 50}"})
        reg.checkpoint_finished(cid)
        if cid > 2:
            reg.release(cid - 2)
    reg.flush()  # deletes run on the background deleter
    assert len(deleted) == 2998 and reg.deleted_count == 2998
    sizes = reg.size()
    assert sizes["deleted"] <= 1000 and sizes["urls"] <= 4 and sizes["checkpoints"] == 2, sizes


def test_a_forgotten_file_of_a_directory_nobody_claims_any_more_is_deleted():
    """A claimed file nothing references is forgotten (its owner deletes it); if the owner
    died first, the directory is listed once unclaimed and the file goes after all."""
    deleted: list[str] = []
    on_disk = {"memory://b/job/shared/s1/a.dstm", "memory://b/job/shared/s1/b.dstm"}
    reg = SharedStateRegistry(delete=deleted.append,
                              list_files=lambda p: sorted(u for u in on_disk
                                                          if u.startswith(p + "/")))
    reg.set_claims("checkpoint", ["memory://b/job/shared/s1"])
    reg.checkpoint_started(1)
    reg.register(1, {"a.dstm": "memory://b/job/shared/s1/a.dstm"})
    reg.checkpoint_finished(1)
    reg.release(1)  # unreferenced, claimed: forgotten, not deleted
    reg.flush()
    assert deleted == [] and reg.size()["urls"] == 0
    reg.set_claims("checkpoint", ["memory://b/job/shared/s2"])  # rescaled: s1 is nobody's
    reg.flush()
    assert sorted(deleted) == sorted(on_disk)
