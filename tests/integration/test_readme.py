"""The README's Python blocks before Spark enters ("Using it") run as written on the
session's Ray cluster, with ``/data`` in this test's temporary directory
(tests/unit/docs_util.py); the Spark blocks run in tests/spark/test_readme.py."""

from __future__ import annotations

import pytest

import dstl_ray
from dstl_ray.errors import NodeUnavailableError
from tests.unit.docs_util import readme_runs, runnable


def test_readme_blocks_without_spark_run(ray_cluster, tmp_path, monkeypatch):
    monkeypatch.delenv("DSTL_NAMESPACE", raising=False)  # the README's default namespace
    plain, _spark = readme_runs()
    assert plain, "the README has no Python block before Spark"
    names: dict = {}
    try:
        for block in plain:
            exec(compile(runnable(block, tmp_path), block.where, "exec"), names)
    finally:
        try:  # a block that failed half-way leaves its detached tree behind
            dstl_ray.attach(dstl_ray.ChangelogConfig()).shutdown()
        except NodeUnavailableError:
            pass
    # what the block's comments promise
    assert list(names["handle"].get_state_changes(17)) == [b"state change"]
    assert dstl_ray.StateChangelogHandle.from_json(names["text"]) == names["handle"]
    assert (tmp_path / "data" / "dstl" / "my-job").is_dir()
    # the checkpoint hub's block: four subtasks in the checkpoint, "a" "b" "c" counted once
    snaps = names["done"].metadata.snapshots
    assert sorted(s.key_group_range.start for s in snaps) == [0, 32, 64, 96]
    assert (tmp_path / "data" / "counts" / "counts" / "chk-1" / "_metadata").is_file()
    with pytest.raises(NodeUnavailableError):
        dstl_ray.attach(dstl_ray.ChangelogConfig())  # tree.shutdown() took it down
