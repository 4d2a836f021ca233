"""``file://`` writes create no temporary name (dstl_ray.storage.unnamed): a new file's data
is fsynced as an unnamed inode, then linked under its name, then the directory is fsynced.

Why it matters: every checkpoint writes a changelog file and a ``_metadata`` file; a named
temp file per write is a second directory entry per file (the vs_flink experiment's file
watcher counted ~1 extra file per checkpoint), and a writer killed mid-write left it behind
until the next recovery's orphan cleanup."""

from __future__ import annotations

import errno
import os
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest

from dstl_ray.errors import StorageError
from dstl_ray.storage import unnamed
from dstl_ray.storage.local import LocalStorage

ROOT = Path(__file__).resolve().parents[3]


@pytest.fixture
def needs_unnamed(tmp_path: Path) -> None:
    fd = unnamed.open_unnamed(str(tmp_path))
    if fd is None:
        pytest.skip("no O_TMPFILE on this system or file system")
    os.close(fd)


@pytest.fixture
def fsync_listings(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> list[list[str]]:
    """What the directory ``tmp_path/d`` (made first: a new directory's parent is fsynced
    too) held at each fsync of the test's thread (the moments a temp file of a temp +
    fsync + rename write exists; a thread an earlier test of this worker process left
    running may fsync meanwhile: a run of make test once recorded two such entries)."""
    (tmp_path / "d").mkdir()
    seen: list[list[str]] = []
    real = os.fsync
    mine = threading.get_ident()

    def fsync(fd: int) -> None:
        if threading.get_ident() == mine:
            d = tmp_path / "d"
            seen.append(sorted(os.listdir(d)) if d.exists() else [])
        real(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    return seen


@pytest.mark.usefixtures("needs_unnamed")
def test_a_new_file_never_has_a_temp_name(tmp_path: Path,
                                          fsync_listings: list[list[str]]) -> None:
    LocalStorage().write_file(f"file://{tmp_path}/d/_metadata", b"x" * 10_000)
    # data fsync: no name at all yet; directory fsync: the final name only
    assert fsync_listings == [[], ["_metadata"]]
    assert (tmp_path / "d" / "_metadata").read_bytes() == b"x" * 10_000


@pytest.mark.usefixtures("needs_unnamed")
def test_create_file_never_has_a_temp_name(tmp_path: Path,
                                           fsync_listings: list[list[str]]) -> None:
    st = LocalStorage()
    assert st.create_file(f"file://{tmp_path}/d/_lease", b"mine")
    # the new name is durable too (the directory is fsynced after the link)
    assert fsync_listings == [[], ["_lease"]]
    assert not st.create_file(f"file://{tmp_path}/d/_lease", b"theirs")
    assert (tmp_path / "d" / "_lease").read_bytes() == b"mine"
    assert os.listdir(tmp_path / "d") == ["_lease"]


@pytest.mark.usefixtures("needs_unnamed")
def test_a_streamed_copy_never_has_a_temp_name(tmp_path: Path,
                                               fsync_listings: list[list[str]]) -> None:
    """write_from (an SST of a materialization, streamed in chunks) writes as write_file
    does; a source that cannot be read leaves no file and no temp file."""
    src = tmp_path / "src.sst"
    src.write_bytes(os.urandom(3 << 20))
    st = LocalStorage()
    st.write_from(f"file://{tmp_path}/d/a.sst", str(src))
    assert fsync_listings == [[], ["a.sst"]]
    assert (tmp_path / "d" / "a.sst").read_bytes() == src.read_bytes()
    with pytest.raises(StorageError, match="missing.sst"):
        st.write_from(f"file://{tmp_path}/d/b.sst", str(tmp_path / "missing.sst"))
    assert os.listdir(tmp_path / "d") == ["a.sst"]


@pytest.mark.usefixtures("needs_unnamed")
def test_replacing_a_file_leaves_one_name(tmp_path: Path) -> None:
    st = LocalStorage()
    url = f"file://{tmp_path}/d/_lease"
    st.write_file(url, b"first, longer")
    st.write_file(url, b"second")
    assert os.listdir(tmp_path / "d") == ["_lease"]
    assert (tmp_path / "d" / "_lease").read_bytes() == b"second"


@pytest.mark.usefixtures("needs_unnamed")
def test_a_writer_killed_mid_write_leaves_nothing(tmp_path: Path) -> None:
    """SIGKILL while the data is being made durable: no file, no temp file left."""
    script = textwrap.dedent(f"""
        import os, signal
        from dstl_ray.storage.local import LocalStorage
        os.fsync = lambda fd: os.kill(os.getpid(), signal.SIGKILL)
        LocalStorage().write_file("file://{tmp_path}/d/f.dstl", b"x" * 1000)
    """)
    proc = subprocess.run([sys.executable, "-c", script], env={**os.environ,
                          "PYTHONPATH": str(ROOT)}, capture_output=True, timeout=60)
    assert proc.returncode == -9, proc.stderr.decode()[-2000:]
    assert os.listdir(tmp_path / "d") == []


def test_a_refused_way_of_linking_is_dropped(monkeypatch: pytest.MonkeyPatch,
                                             tmp_path: Path, needs_unnamed: None) -> None:
    calls = []

    def refuses(fd: int, name: str) -> None:
        calls.append(name)
        raise OSError(errno.EXDEV, "hardened /proc", name)

    monkeypatch.setattr(unnamed, "_ways", [refuses, *unnamed._ways])
    st = LocalStorage()
    st.write_file(f"file://{tmp_path}/d/a", b"a")
    st.write_file(f"file://{tmp_path}/d/b", b"b")
    assert len(calls) == 1  # tried once, then dropped
    assert sorted(os.listdir(tmp_path / "d")) == ["a", "b"]


def test_no_way_of_linking_falls_back_to_a_named_temp(monkeypatch: pytest.MonkeyPatch,
                                                      tmp_path: Path) -> None:
    monkeypatch.setattr(unnamed, "_ways", [])
    st = LocalStorage()
    st.write_file(f"file://{tmp_path}/d/a", b"a")
    assert st.create_file(f"file://{tmp_path}/d/b", b"b")
    assert not st.create_file(f"file://{tmp_path}/d/b", b"c")
    assert sorted(os.listdir(tmp_path / "d")) == ["a", "b"]
    assert (tmp_path / "d" / "b").read_bytes() == b"b"


def test_a_vanished_directory_is_an_error_not_a_missing_capability(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path, needs_unnamed: None) -> None:
    ways = list(unnamed._ways)
    fd = unnamed.open_unnamed(str(tmp_path))
    assert fd is not None
    try:
        with pytest.raises(FileNotFoundError):
            unnamed.link_unnamed(fd, str(tmp_path / "gone" / "x"))
    finally:
        os.close(fd)
    assert unnamed._ways == ways  # nothing dropped
