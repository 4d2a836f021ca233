"""The file kinds of ``make compare`` (experiments.vs_flink and its Flink peer): every file
created per checkpoint is told apart by name, temp files of either system included, so the
files-per-checkpoint figure can be explained (issue: "nobody has said what the rest is")."""

from __future__ import annotations

from experiments.peers import flink_keyed_count as flink
from experiments.vs_flink import file_kind, files_by_kind


def test_dstl_ray_file_kinds() -> None:
    job = "/w/dstl-1/vsflink"
    assert file_kind(f"{job}/chk-7/_metadata") == "metadata"
    assert file_kind(f"{job}/chk-7/_metadata.tmp-0af3") == "temp:metadata"
    assert file_kind("/w/dstl-1/vsflink/1-ab/node0/3f.dstl") == "changelog"
    assert file_kind("/w/dstl-1/vsflink/1-ab/node0/3f-a2.dstl") == "changelog"
    assert file_kind("/w/dstl-1/vsflink/1-ab/node0/3f.dstl.tmp-9e") == "temp:changelog"
    assert file_kind(f"{job}/mat/5c.dstm") == "materialization"
    assert file_kind(f"{job}/mat/5c.dstm.tmp-11") == "temp:materialization"
    assert file_kind(f"{job}/_lease") == "lease"
    assert file_kind(f"{job}/_lease.tmp-11") == "temp:lease"
    assert file_kind("/w/dstl-1/_epochs/vsflink.epoch") == "lease"  # the lease's epoch counter
    assert file_kind(f"{job}/segments/x/y") == "other"
    assert files_by_kind({"a/_metadata", "b/_metadata", "c.dstl", "c.dstl.tmp-1"}, 2) == {
        "changelog": 0.5, "metadata": 1.0, "temp:changelog": 0.5}


def test_flink_file_kinds() -> None:
    assert flink.file_kind("cp/j1/chk-3/_metadata") == "metadata"
    assert flink.file_kind("cp/j1/chk-3/._metadata.inprogress.5e2c") == "temp:metadata"
    assert flink.file_kind("dstl/0a1b2c") == "changelog"
    assert flink.file_kind("cp/j1/shared/9f") == "shared"
    assert flink.file_kind("cp/j1/taskowned/9f") == "taskowned"
    assert flink.file_kind("cp/j1/chk-3/5d1e") == "exclusive"
    assert flink.file_kind("other.txt") == "other"
