"""The test run's warning filters (pyproject.toml) turn a deprecated call made from one of
the project's modules into an error, and only those. Python attributes a warning to the
module of the frame ``stacklevel`` names: a library's deprecation (``stacklevel=2``, as
Ray's ``Deprecated``, pandas and pyarrow warn) is attributed to its caller, so a call from
a dstl_ray module fails its test, while the same call from anywhere else only warns."""

from __future__ import annotations

import types
import warnings

import pytest

LIBRARY = """
import warnings

def old_api(category):
    warnings.warn("old_api is deprecated", category, stacklevel=2)
"""
CALLER = """
def use(library, category):
    library.old_api(category)
"""
CATEGORIES = [DeprecationWarning, PendingDeprecationWarning, FutureWarning]


def _module(name: str, source: str) -> types.ModuleType:
    """A module named ``name`` (not imported: only its frames' ``__name__`` matters)."""
    module = types.ModuleType(name)
    exec(compile(source, f"<{name}>", "exec"), module.__dict__)
    return module


@pytest.mark.parametrize("category", CATEGORIES, ids=lambda c: c.__name__)
@pytest.mark.parametrize("caller", ["dstl_ray.node.dead_writer_check", "dstl_ray",
                                    "topology.discovery", "spark_glue.vectorized",
                                    "experiments.chaos"])
def test_a_deprecated_call_from_our_module_fails(caller: str, category: type[Warning]):
    library = _module("some_library", LIBRARY)
    with pytest.raises(category, match="old_api is deprecated"):
        _module(caller, CALLER).use(library, category)


@pytest.mark.parametrize("caller", ["some_app", "dstl_rayish.x", "ray.runtime_context"])
def test_a_deprecated_call_from_elsewhere_only_warns(caller: str):
    library = _module("some_library", LIBRARY)
    with warnings.catch_warnings(record=True) as seen:
        _module(caller, CALLER).use(library, DeprecationWarning)
    assert [str(w.message) for w in seen] == ["old_api is deprecated"]
