"""The public surface: ``dstl_ray.__all__`` lists exactly the public names of the package
(the user API), each resolves, and the test helpers live in ``dstl_ray.testing``, not there
(after httpx's tests/test_exported_members.py)."""

from __future__ import annotations

import types

import pytest

import dstl_ray
import dstl_ray.testing

TEST_HELPERS = ("FaultSpec", "FaultyStorage", "InjectedFault", "LatencyDistribution",
                "LoopbackS3", "local_cluster", "start_local_cluster", "stop_local_cluster")
EXPORTED_MODULES = {"tracing"}  # the submodules that are API themselves


def _public_names(module: types.ModuleType) -> set[str]:
    """Names a user sees in ``module``: not private, and not a submodule that Python bound as
    a side effect of importing it (those are implementation, unless exported on purpose)."""
    names = set()
    for name, value in vars(module).items():
        if name.startswith("_"):
            continue
        if (isinstance(value, types.ModuleType)
                and value.__name__.startswith(f"{module.__name__}.")
                and name not in EXPORTED_MODULES):
            continue
        names.add(name)
    return names


def test_all_is_exactly_the_public_names():
    assert dstl_ray.__all__ == sorted(dstl_ray.__all__), "keep __all__ sorted"
    assert len(set(dstl_ray.__all__)) == len(dstl_ray.__all__), "a name listed twice"
    assert set(dstl_ray.__all__) == _public_names(dstl_ray)


@pytest.mark.parametrize("name", dstl_ray.__all__)
def test_every_exported_name_resolves(name: str):
    value = getattr(dstl_ray, name)
    assert value is not None
    if not isinstance(value, types.ModuleType):
        assert getattr(value, "__module__", "").startswith("dstl_ray."), name


def test_test_helpers_are_not_in_the_user_api():
    assert not set(TEST_HELPERS) & set(dstl_ray.__all__)
    for name in TEST_HELPERS:
        assert not hasattr(dstl_ray, name), name


def test_test_helpers_are_reachable_from_dstl_ray_testing():
    assert set(TEST_HELPERS) <= set(dstl_ray.testing.__all__)
    assert set(dstl_ray.testing.__all__) == _public_names(dstl_ray.testing)
    for name in dstl_ray.testing.__all__:
        assert getattr(dstl_ray.testing, name) is not None, name
    from dstl_ray.testing.faults import FaultyStorage
    from dstl_ray.testing.s3server import LoopbackS3
    from dstl_ray.testing.storage_suite import StorageSuite

    assert dstl_ray.testing.FaultyStorage is FaultyStorage
    assert dstl_ray.testing.LoopbackS3 is LoopbackS3
    assert isinstance(StorageSuite, type)


def test_importing_the_test_helpers_does_not_import_pytest_or_moto():
    """Node actors import dstl_ray.testing (option plugins) for fault injection: that must
    not drag in the test tools."""
    import subprocess
    import sys

    code = ("import sys, dstl_ray, dstl_ray.testing; "
            "print(sorted(m for m in ('pytest', 'moto', 'boto3') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout.strip()
    assert out == "[]"


def test_every_error_class_is_exported():
    """Every error a user can catch is importable from dstl_ray, as DstlError is."""
    import inspect

    import dstl_ray.errors

    errors = {name for name, value in vars(dstl_ray.errors).items()
              if inspect.isclass(value) and issubclass(value, dstl_ray.DstlError)}
    assert not sorted(errors - set(dstl_ray.__all__))
