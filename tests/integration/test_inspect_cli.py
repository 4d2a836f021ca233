"""`dstl-ray inspect`: a readable summary of a good file, a clear error for a corrupt one."""

from __future__ import annotations

from dstl_ray import DirectTransport, KeyGroupRange, StateChangelogClient
from dstl_ray.cli.main import main
from dstl_ray.storage.base import join


def _write(tmp_path, compression="none"):
    from dstl_ray import ChangelogConfig

    t = DirectTransport("job", f"file://{tmp_path}", ChangelogConfig(compression=compression))
    w = StateChangelogClient("job", transport=t).create_writer("op", KeyGroupRange(0, 3))
    for kg in range(4):
        for i in range(5):
            w.append(kg, b"v" * (i + 1))
    h = w.persist_durably(0).result(timeout=10)
    return h, join(h.job_path, h.segments[0].path)[len("file://"):]


def test_inspect_summarizes(tmp_path, capsys):
    h, path = _write(tmp_path, "zstd")
    assert main(["inspect", path]) == 0
    out = capsys.readouterr().out
    assert "compression zstd" in out and "all CRC32C ok" in out and h.log_id in out
    assert "0..3 (4)" in out and " 20 " in out  # key groups and number of changes


def test_inspect_corrupt_file_names_file_and_offset(tmp_path, capsys):
    _, path = _write(tmp_path)
    from pathlib import Path

    data = bytearray(Path(path).read_bytes())
    data[100] ^= 0x40
    Path(path).write_bytes(bytes(data))
    assert main(["inspect", path]) == 2
    err = capsys.readouterr().err
    assert path in err and "offset" in err and "CRC32C" in err
