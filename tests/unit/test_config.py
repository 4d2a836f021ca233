from __future__ import annotations

import pytest

from dstl_ray import ChangelogConfig, ConfigError, DstlError


def test_defaults_follow_flink():
    c = ChangelogConfig()
    assert c.persist_delay_s == 0.010
    assert c.persist_size_threshold == 10 * 1024 * 1024
    assert c.in_flight_limit == 100 * 1024 * 1024
    assert c.upload_timeout_s == 1.0 and c.max_attempts == 3
    assert c.preemptive_persist_threshold == 5 * 1024 * 1024


@pytest.mark.parametrize("opt,value,msg", [
    ("persist_delay_s", -0.1, r"persist_delay_s must be in \[0, 60\]"),
    ("max_attempts", 0, r"max_attempts must be in \[1, 100\]"),
    ("branching_factor", 0, "branching_factor"),
    ("compression", "lz4", "compression must be one of none, zstd"),
    ("flush_bytes", "big", "flush_bytes must be int"),
    ("max_attempts", True, "max_attempts must be int"),
    ("hedge_quantile", 1.5, "hedge_quantile"),
    ("namespace", "", "namespace"),
])
def test_bad_values_name_the_option(opt, value, msg):
    with pytest.raises(ConfigError, match=msg) as e:
        ChangelogConfig(**{opt: value})
    assert isinstance(e.value, DstlError)


def test_environment_variables():
    c = ChangelogConfig.from_env({"DSTL_PERSIST_DELAY_S": "0.05", "DSTL_BRANCHING_FACTOR": "8",
                                  "DSTL_COMPRESSION": "zstd"})
    assert (c.persist_delay_s, c.branching_factor, c.compression) == (0.05, 8, "zstd")
    with pytest.raises(ConfigError, match="DSTL_MAX_ATTEMPTS"):
        ChangelogConfig.from_env({"DSTL_MAX_ATTEMPTS": "three"})
    with pytest.raises(ConfigError, match="unknown option"):
        ChangelogConfig.from_dict({"persist_dealy_s": 1})


def test_every_option_is_documented():
    for name, env, _default, doc in ChangelogConfig.describe():
        assert env == "DSTL_" + name.upper() and len(doc) > 10


def test_persist_timeout_is_derived_from_the_upload_options_unless_set():
    c = ChangelogConfig()
    assert c.upload_deadline_s == 3 * (1.0 + 0.5)
    assert c.effective_persist_timeout_s == 2 * (4.5 + 30.0)  # a node's forward, then a flush
    assert ChangelogConfig(persist_timeout_s=5).effective_persist_timeout_s == 5.0
    assert ChangelogConfig.from_env(
        {"DSTL_PERSIST_TIMEOUT_S": "12.5"}).effective_persist_timeout_s == 12.5
    with pytest.raises(ConfigError, match="persist_timeout_s"):
        ChangelogConfig(persist_timeout_s=-1)
