"""The file accounting of experiments.large_state_spark (pure logic on real files): what counts
as written into Spark's state directory between two listings."""

from __future__ import annotations

from experiments.large_state_spark import listing, written


def test_listing_leaves_out_checksums_and_in_flight_files(tmp_path):
    part = tmp_path / "0" / "1"
    part.mkdir(parents=True)
    (part / "1.changelog").write_bytes(b"x" * 10)
    (part / ".1.changelog.crc").write_bytes(b"c" * 3)
    (part / ".2.zip.1f2e.tmp").write_bytes(b"t" * 7)
    assert listing(tmp_path) == {"0/1/1.changelog": 10}


def test_written_counts_new_and_grown_files_by_kind(tmp_path):
    part = tmp_path / "0" / "0"
    (part / "SSTs").mkdir(parents=True)
    (part / "1.changelog").write_bytes(b"x" * 10)
    (part / "log").write_bytes(b"l" * 4)
    before = listing(tmp_path)
    (part / "2.changelog").write_bytes(b"y" * 20)
    (part / "2.zip").write_bytes(b"z" * 5)
    (part / "SSTs" / "000008-ab.sst").write_bytes(b"s" * 100)
    (part / "log").write_bytes(b"l" * 6)  # grew by 2: counted, not a new file
    w = written(before, listing(tmp_path))
    assert w == {"bytes": 127, "files": 3,
                 "by_kind": {"changelog": 20, "snapshot_zip": 5, "snapshot_sst": 100,
                             "other": 2}}
    assert written(listing(tmp_path), listing(tmp_path)) == {"bytes": 0, "files": 0,
                                                             "by_kind": {}}
