"""One spelling per file (``normalize_url``): the form its storage lists it under, so the
keys made of URLs (the shared state registry's, orphan cleanup's, a restore's "is this the
job's own directory") never tell one file apart from itself."""

from __future__ import annotations

import os

import pytest

from dstl_ray.storage.base import join, normalize_url
from dstl_ray.storage.registry import get_storage


@pytest.mark.parametrize(("spelled", "canonical"), [
    ("/a/b/f", "file:///a/b/f"),
    ("file:///a//b/./f", "file:///a/b/f"),
    ("file:////a/b/f", "file:///a/b/f"),
    ("file://a/../a/b/f/", "file:///a/b/f"),  # a relative local path after "file://"
    ("file:/a/b/f", "file:///a/b/f"),  # RFC 8089's short form
    ("memory:///m/f", "memory://m/f"),
    ("memory://m/f/", "memory://m/f"),
    ("s3://bk//x/f", "s3://bk/x/f"),
    ("s3://bk/x/f/", "s3://bk/x/f"),
])
def test_spellings_of_one_file(spelled, canonical):
    if spelled.startswith("file://a"):
        canonical = "file://" + os.path.abspath("a/b/f")
    assert normalize_url(spelled) == canonical
    assert normalize_url(canonical) == canonical


def test_the_normal_form_is_what_listings_return(tmp_path):
    for base in (f"file:///{tmp_path}//dfs", "memory:///spell-m//dfs"):
        url = join(normalize_url(base), "job", "f")
        st = get_storage(url)
        st.write_file(url, b"x")
        assert st.list_files(normalize_url(base)) == [url]


def test_a_kept_spelling_never_depends_on_the_working_directory(tmp_path, monkeypatch):
    """``normalize_url`` keeps its answers for URLs that name one file wherever the process
    is; a bare path or a relative ``file://`` URL is worked out again after a ``chdir``."""
    from dstl_ray.storage import base

    for d in ("one", "two"):
        (tmp_path / d).mkdir()
    monkeypatch.chdir(tmp_path / "one")
    first = [normalize_url(u) for u in ("rel/f", "file://rel/f")]
    assert "file:///x/f" == normalize_url("file:///x//f") == normalize_url("file:///x//f")
    monkeypatch.chdir(tmp_path / "two")
    again = [normalize_url(u) for u in ("rel/f", "file://rel/f")]
    assert first == [f"file://{tmp_path}/one/rel/f"] * 2
    assert again == [f"file://{tmp_path}/two/rel/f"] * 2
    assert "file:///x//f" in base._NORMALIZED and "rel/f" not in base._NORMALIZED
    # bounded: a full memo starts over
    monkeypatch.setattr(base, "_NORMALIZED_MAX", 2)
    base._NORMALIZED.clear()
    for i in range(5):
        assert normalize_url(f"s3://bk//{i}") == f"s3://bk/{i}"
        assert len(base._NORMALIZED) <= 2
