"""A subsumed checkpoint leaves no ``chk-n`` directory behind on file:// (Flink disposes of a
discarded checkpoint's exclusive directory too): one empty directory per checkpoint piled up
forever, and every listing of the job walked them all."""

from __future__ import annotations

import os

import dstl_ray as d
from dstl_ray.storage.deleter import flush_deletes
from dstl_ray.storage.local import LocalStorage

from ..ckpt_util import MAXP, client

JOB = "dirs"


def _chk_dirs(tmp_path) -> list[str]:
    """The ``chk-n`` directories once the subsumed checkpoints' discards ran (they run in
    the background: dstl_ray.checkpoint.cleaner)."""
    assert flush_deletes(30)
    return sorted(n for n in os.listdir(tmp_path / "dfs" / JOB) if n.startswith("chk-"))


def test_subsumed_and_dropped_checkpoints_leave_no_directory(tmp_path):
    base = f"file://{tmp_path}/dfs"
    coord = d.CheckpointCoordinator(JOB, base, max_parallelism=MAXP, retained=2)
    b = d.ChangelogKeyedStateBackend(client(JOB, base), "op", d.KeyGroupRange(0, MAXP - 1),
                                     MAXP, materialization_interval=None)
    for n in range(1, 6):
        b.value_state("v").update("k", n)
        coord.complete_checkpoint(n, [b.snapshot().result(timeout=30)])
    assert _chk_dirs(tmp_path) == ["chk-4", "chk-5"]
    assert coord.drop_checkpoints_from(5) == [5]
    assert _chk_dirs(tmp_path) == ["chk-4"]
    b.close()
    coord.shutdown(cancel=True)  # RETAIN_ON_CANCELLATION: the newest stays
    assert _chk_dirs(tmp_path) == ["chk-4"]


def test_delete_dir_keeps_a_directory_that_is_not_empty(tmp_path):
    st = LocalStorage()
    st.write_file(f"file://{tmp_path}/chk-1/_metadata", b"m")
    st.delete_dir(f"file://{tmp_path}/chk-1")  # someone wrote into it: it stays
    assert os.listdir(tmp_path / "chk-1") == ["_metadata"]
    st.delete(f"file://{tmp_path}/chk-1/_metadata")
    st.delete_dir(f"file://{tmp_path}/chk-1")
    st.delete_dir(f"file://{tmp_path}/chk-1")  # gone already: no error
    assert not (tmp_path / "chk-1").exists()


def test_a_directory_that_cannot_be_removed_fails_nothing(tmp_path, monkeypatch):
    """Removing the directory is best effort: its failure neither fails a subsumption nor
    keeps the metadata."""
    from dstl_ray.checkpoint.metadata import delete_metadata
    from dstl_ray.errors import StorageError

    def refuse(self, path):
        raise StorageError(f"cannot remove directory {path}: Device or resource busy")

    monkeypatch.setattr(LocalStorage, "delete_dir", refuse)
    chk = tmp_path / "job" / "chk-1"
    chk.mkdir(parents=True)
    (chk / "_metadata").write_text("{}")
    delete_metadata(f"file://{chk}/_metadata")
    assert os.listdir(chk) == []
