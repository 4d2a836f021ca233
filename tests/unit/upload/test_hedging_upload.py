"""Retry policy, request hedging and fault injection of the Uploader, on ``memory://``."""

from __future__ import annotations

import logging
import random
import time
import uuid

import pytest

from dstl_ray import ChangelogConfig, ConfigError, HedgePolicy, StorageError, Uploader
from dstl_ray.storage.registry import get_storage, s3_options, storage_for
from dstl_ray.testing.faults import (
    FLIP158_QUANTILES_MS,
    FaultSpec,
    FaultyStorage,
    LatencyDistribution,
)
from dstl_ray.upload.uploader import attempt_path


def _base() -> str:
    return f"memory://hedge-{uuid.uuid4().hex[:8]}"


def _uploader(spec: dict, **cfg) -> tuple[Uploader, FaultyStorage, str]:
    import json

    base = _base()
    st = FaultyStorage(get_storage(base), json.dumps(spec))
    opts = {"upload_timeout_s": 0.5, "max_attempts": 3, "retry_delay_s": 0.01, **cfg}
    return Uploader(st, ChangelogConfig(**opts)), st, base


def _wait_until(cond, timeout=5.0):
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.02)


def test_flip158_distribution_matches_the_table():
    d = LatencyDistribution.flip158()
    for q, ms in FLIP158_QUANTILES_MS:
        assert d.quantile_ms(q) == pytest.approx(ms)
    rng = random.Random(7)
    xs = sorted(d.sample_s(rng) * 1000 for _ in range(100_000))
    for q, ms in [(0.5, 459), (0.9, 740), (0.95, 833), (0.99, 1039)]:
        assert xs[int(q * len(xs))] == pytest.approx(ms, rel=0.03)
    assert LatencyDistribution.flip158(0.1).quantile_ms(0.999) == pytest.approx(320.2)


def test_hedge_policy_fixed_then_quantile_of_a_sliding_window():
    assert HedgePolicy().delay() is None and not HedgePolicy().enabled
    assert HedgePolicy(delay_s=0.2).delay() == 0.2
    p = HedgePolicy(delay_s=0.5, quantile=0.9, window=100, min_samples=10)
    for i in range(9):
        p.record(i / 1000)
    assert p.delay() == 0.5  # too few samples: the fixed delay
    for i in range(9, 100):
        p.record(i / 1000)
    assert p.delay() == pytest.approx(0.090)
    for _ in range(100):  # the window slides: old latencies are forgotten
        p.record(1.0)
    assert p.delay() == 1.0
    assert HedgePolicy(quantile=0.9, min_samples=5).delay() is None


def test_5xx_and_reset_are_retried_under_new_names():
    up, st, base = _uploader({"script": ["5xx", "reset"]})
    path = f"{base}/f.dstl"
    won = up.write(path, b"data")
    assert won == attempt_path(path, 3) == f"{base}/f-a3.dstl"
    assert st.read_file(won) == b"data"
    s = up.stats
    assert (s.uploads, s.attempts, s.retries, s.errors, s.failures) == (1, 3, 2, 2, 0)
    assert st.injected["5xx"] == 1 and st.injected["reset"] == 1


def test_timeout_is_retried_and_the_late_attempt_is_deleted():
    up, st, base = _uploader({"script": ["slow:0.6"]}, upload_timeout_s=0.2)
    won = up.write(f"{base}/t.dstl", b"x")
    assert won.endswith("t-a2.dstl") and up.stats.timeouts == 1
    # the timed-out attempt lands at 0.6 s; its object is deleted, never the winner's
    _wait_until(lambda: up.stats.losers_deleted == 1)
    assert st.list_files(base) == [won]


def test_torn_upload_leaves_nothing_behind():
    up, st, base = _uploader({"script": ["torn"]})
    won = up.write(f"{base}/torn.dstl", b"0123456789")
    _wait_until(lambda: st.list_files(base) == [won])
    assert st.read_file(won) == b"0123456789"


def test_every_attempt_fails_names_file_and_cause(caplog):
    up, st, base = _uploader({"script": ["5xx", "5xx", "5xx"]})
    path = f"{base}/gone.dstl"
    with caplog.at_level(logging.WARNING), pytest.raises(StorageError) as e:
        up.write(path, b"x")
    assert path in str(e.value) and "503" in str(e.value) and "3 attempt" in str(e.value)
    assert up.stats.failures == 1 and up.stats.attempts == 3
    assert up.write(path, b"y") == path  # the fault cleared
    assert st.read_file(path) == b"y"


def test_hedge_wins_and_the_slow_first_attempt_is_deleted_when_it_lands():
    up, st, base = _uploader({"script": ["slow:0.5"]}, hedge_delay_s=0.05,
                             upload_timeout_s=2.0)
    t0 = time.monotonic()
    won = up.write(f"{base}/h.dstl", b"hedged")
    assert time.monotonic() - t0 < 0.4  # did not wait for the straggler
    assert won.endswith("h-a2.dstl")
    s = up.stats
    assert (s.attempts, s.hedged, s.hedge_wins, s.retries) == (2, 1, 1, 0)
    _wait_until(lambda: up.stats.losers_deleted == 1)
    assert st.list_files(base) == [won] and st.read_file(won) == b"hedged"


def test_hedge_loses_when_the_first_attempt_finishes_first():
    up, st, base = _uploader({"script": ["slow:0.15", "slow:1.0"]}, hedge_delay_s=0.05,
                             upload_timeout_s=2.0)
    won = up.write(f"{base}/p.dstl", b"p")
    assert won == f"{base}/p.dstl"
    assert up.stats.hedged == 1 and up.stats.hedge_wins == 0
    _wait_until(lambda: up.stats.losers_deleted == 1)
    assert st.list_files(base) == [won]


def test_quantile_hedging_from_recent_latencies():
    up, st, base = _uploader({"latency": {"fixed_s": 0.01}}, hedge_quantile=0.5,
                             hedge_min_samples=5)
    for i in range(5):
        up.write(f"{base}/w{i}.dstl", b"w")
    assert up.stats.hedged == 0
    assert 0.005 < up.policy.delay() < 0.2


@pytest.mark.parametrize("spec,msg", [
    ('{"latency": {"dist": "pareto"}}', "latency.dist"),
    ('{"error_rate": 2}', "error_rate must be a number in"),
    ('{"script": ["boom"]}', "script entry 'boom'"),
    ('{"bogus": 1}', "unknown key"),
    ("[1]", "JSON object"),
])
def test_bad_fault_spec_fails_at_start(spec, msg):
    with pytest.raises(ConfigError, match=msg):
        ChangelogConfig(fault_spec=spec)
    with pytest.raises(ConfigError, match="storage_options"):
        ChangelogConfig(storage_options="not json")


def test_rates_inject_faults_and_storage_for_wraps():
    spec = FaultSpec.parse('{"error_rate": 0.5, "seed": 3}')
    st = FaultyStorage(get_storage(_base()), spec)
    ok = fails = 0
    for i in range(200):
        try:
            st.write_file(f"memory://r/{i}", b"")
            ok += 1
        except Exception:  # noqa: BLE001
            fails += 1
    assert 60 < fails < 140 and ok + fails == 200
    cfg = ChangelogConfig(fault_spec='{"script": ["5xx"]}')
    assert isinstance(storage_for(_base(), cfg), FaultyStorage)
    assert not isinstance(storage_for(_base(), ChangelogConfig()), FaultyStorage)


def test_secrets_never_shown(monkeypatch):
    cfg = ChangelogConfig(s3_access_key_id="AKIDSHOWN", s3_secret_access_key="TOPSECRET",
                          s3_endpoint_url="http://127.0.0.1:9",
                          storage_options='{"token": "TOK123", "client_kwargs": {}}')
    for text in (repr(cfg), str(cfg), str(cfg.to_dict())):
        assert "TOPSECRET" not in text and "AKIDSHOWN" not in text and "TOK123" not in text
    assert "http://127.0.0.1:9" in repr(cfg)
    assert cfg.to_dict(secrets=True)["s3_secret_access_key"] == "TOPSECRET"
    assert ChangelogConfig.from_dict(cfg.to_dict()).s3_secret_access_key == ""
    opts = s3_options(cfg)
    assert opts["secret"] == "TOPSECRET" and opts["token"] == "TOK123"
    assert opts["config_kwargs"]["retries"]["total_max_attempts"] == 1
    st = get_storage("s3://bucket/x", opts)
    assert "TOPSECRET" not in repr(st) and "AKIDSHOWN" not in repr(st)
    # the standard AWS variables when the config has none
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", "http://127.0.0.1:8")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "envkey")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "envsecret")
    env_opts = s3_options()
    assert (env_opts["endpoint_url"], env_opts["key"], env_opts["secret"]) == (
        "http://127.0.0.1:8", "envkey", "envsecret")
    assert s3_options(cfg)["endpoint_url"] == "http://127.0.0.1:9"  # config first
