"""Fault injection is wired from outside the runtime (docs/architecture.md "Test support"): a
process gets it by importing dstl_ray.testing, or by option ``plugins`` naming it (node
actors); ``fault_spec`` set where nothing handles it is an error, never a run without faults."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from dstl_ray.config import ChangelogConfig
from dstl_ray.errors import ConfigError

ROOT = Path(__file__).resolve().parents[3]
SPEC = '{"script": ["5xx"], "seed": 1}'


def test_a_fresh_process_gets_faults_only_through_plugins():
    """A node actor's process is such a fresh process: it never imported dstl_ray.testing."""
    code = f"""
import sys
import dstl_ray
from dstl_ray.config import ChangelogConfig
from dstl_ray.errors import ConfigError
from dstl_ray.storage.registry import storage_for
try:
    storage_for("memory://w", ChangelogConfig(fault_spec={SPEC!r}))
    print("unwrapped")
except ConfigError as e:
    print("refused", "plugins" in str(e) and "fault_spec" in str(e))
print("loaded", "dstl_ray.testing" in sys.modules)
st = storage_for("memory://w", ChangelogConfig(fault_spec={SPEC!r}, plugins="dstl_ray.testing"))
print(type(st).__name__)
try:
    st.write_file("memory://w/x.dstl", b"x")
except Exception as e:
    print(type(e).__name__)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=ROOT, check=True).stdout.split("\n")
    assert out[:4] == ["refused True", "loaded False", "FaultyStorage", "InjectedFault"]


def test_bad_plugins_fail_naming_the_option():
    with pytest.raises(ConfigError, match="option plugins"):
        ChangelogConfig(plugins="dstl_ray.testing; rm -rf")
    from dstl_ray.storage.registry import storage_for

    with pytest.raises(ConfigError, match="option plugins: cannot import"):
        storage_for("memory://w", ChangelogConfig(plugins="no_such_module_of_dstl"))


def test_a_wrapper_registers_only_for_an_option_that_wraps():
    from dstl_ray.storage.registry import register_storage_wrapper

    with pytest.raises(ValueError, match="turns on no storage wrapper"):
        register_storage_wrapper("compression", lambda st, value: st)


def test_an_unreachable_store_is_a_storage_error_never_false():
    """exists and list_files of an S3 store nobody answers raise StorageError (a lease's
    fencing check asks exists: a raw client error killed the lease's renewer thread, and
    False would have read as "no newer epoch")."""
    from dstl_ray.errors import StorageError
    from dstl_ray.storage.registry import get_storage, s3_options
    from dstl_ray.testing.s3server import free_port

    cfg = ChangelogConfig(s3_endpoint_url=f"http://127.0.0.1:{free_port()}",
                          s3_access_key_id="k", s3_secret_access_key="s")
    st = get_storage("s3://nobody-answers/x", s3_options(cfg))
    with pytest.raises(StorageError, match="cannot check"):
        st.exists("s3://nobody-answers/x/_epochs/job/2.epoch")
    with pytest.raises(StorageError, match="cannot list"):
        st.list_files("s3://nobody-answers/x/_epochs/job/")
