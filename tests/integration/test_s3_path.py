"""The DFS path on a real S3 server on loopback (moto), with a real Ray tree: s3:// flushes,
restore from S3, retries of injected faults, hedging without strays, backpressure."""

from __future__ import annotations

import json
import os
import time

import pytest

from dstl_ray import ChangelogConfig, KeyGroupRange, PersistError, StateChangelogClient
from dstl_ray.storage.registry import storage_for
from dstl_ray.testing.s3server import TEST_SECRET, LoopbackS3


@pytest.fixture(scope="module")
def s3():
    server = LoopbackS3().start()
    yield server
    server.stop()


@pytest.fixture
def s3_env(s3, monkeypatch):
    """This (driver) process reads handles back through the standard AWS variables."""
    for k, v in s3.env().items():
        monkeypatch.setenv(k, v)
    return s3


def _writers(tree, namespace, job, n_per_node=1, nodes=None):
    """Writers pinned to several node actors, so batches travel up the tree."""
    clients, writers = [], []
    names = sorted(tree.nodes)[:nodes] if nodes else sorted(tree.nodes)
    for i, name in enumerate(names):
        c = StateChangelogClient(job, namespace=namespace, node=name)
        clients.append(c)
        for j in range(n_per_node):
            writers.append(c.create_writer(f"op{i}-{j}", KeyGroupRange(0, 3)))
    return clients, writers


def _append(writers, expected, tag, size=16):
    for i, w in enumerate(writers):
        for kg in range(4):
            v = f"{tag}-w{i}-kg{kg}-".encode() + os.urandom(size)
            w.append(kg, v)
            expected[i].setdefault(kg, []).append(v)


def _persist_all(writers):
    """persist_durably(after=0) on every writer; the handles once all are durable."""
    return [f.result(timeout=60) for f in [w.persist_durably(0) for w in writers]]


def _assert_restores(handles, expected):
    """Every handle restores exactly what its writer appended."""
    for h, exp in zip(handles, expected, strict=True):
        assert h.read_all() == exp


def _root_status(tree):
    return [s for s in tree.status() if s.get("root")][0]


def test_tree_flushes_to_s3_and_restores(tree_factory, namespace, s3_env):
    s3 = s3_env
    tree = tree_factory(base=s3.url("t-restore"), persist_delay_s=0.05,
                        **s3.config_options())
    clients, writers = _writers(tree, namespace, "jobs3")
    assert len(writers) >= 3
    expected = [{} for _ in writers]
    for cp in range(3):
        _append(writers, expected, f"cp{cp}")
        handles = _persist_all(writers)
    for i, h in enumerate(handles):
        assert h.job_path.startswith("s3://")
        assert h.read_all() == expected[i]  # restore from S3
        for kg in range(4):
            assert list(h.get_state_changes(kg)) == expected[i][kg]
    keys = s3.keys("t-restore/jobs3/")
    assert keys and all(k.endswith(".dstl") for k in keys)
    for h in handles:
        for seg in h.segments:
            assert f"t-restore/jobs3/{seg.path}" in keys
    status = tree.status()
    assert sum(s["files_flushed"] for s in status) == len(keys)
    assert _root_status(tree)["upload"]["attempts"] >= 3
    # the credentials reach the node actors, but never their status or info
    import ray

    info = ray.get(tree.node(tree.root).info.remote())
    assert TEST_SECRET not in json.dumps(status) and TEST_SECRET not in json.dumps(info)
    assert TEST_SECRET not in repr(tree.config)
    for c in clients:
        c.close()


def test_injected_5xx_and_timeouts_are_retried(tree_factory, namespace, s3_env):
    s3 = s3_env
    # the timeout leaves room for a real upload on a busy machine; the hang exceeds it
    spec = json.dumps({"script": ["5xx", "timeout", "reset"], "hang_s": 2.0,
                       "match": ".dstl"})
    tree = tree_factory(base=s3.url("t-retry"), persist_delay_s=0.05, upload_timeout_s=1.0,
                        max_attempts=4, retry_delay_s=0.05, fault_spec=spec, plugins="dstl_ray.testing",
                        **s3.config_options())
    clients, writers = _writers(tree, namespace, "jobr", nodes=3)
    expected = [{} for _ in writers]
    _append(writers, expected, "a")
    handles = _persist_all(writers)
    _assert_restores(handles, expected)
    up = _root_status(tree)["upload"]
    assert up["retries"] == 3 and up["timeouts"] == 1 and up["errors"] == 2
    assert up["failures"] == 0
    # the failed attempts left nothing behind: only the objects the handles name (one,
    # or two when a busy machine split the writers' requests over two batches)
    want = sorted({f"t-retry/jobr/{seg.path}" for h in handles for seg in h.segments})
    deadline = time.monotonic() + 20  # the hung attempt finishes and is cleaned up
    while s3.keys("t-retry/") != want and time.monotonic() < deadline:
        time.sleep(0.2)
    assert s3.keys("t-retry/") == want
    for c in clients:
        c.close()


def test_every_attempt_fails_then_next_checkpoint_succeeds(tree_factory, namespace, s3_env):
    s3 = s3_env
    # every upload fails (one file per batch; a busy machine may split the writers'
    # requests over two batches), until the faults are lifted below
    spec = json.dumps({"error_rate": 1.0, "match": ".dstl"})
    tree = tree_factory(base=s3.url("t-fail"), persist_delay_s=0.05, upload_timeout_s=1.0,
                        max_attempts=3, retry_delay_s=0.05, fault_spec=spec, plugins="dstl_ray.testing",
                        **s3.config_options())
    clients, writers = _writers(tree, namespace, "jobf", nodes=2)
    expected = [{} for _ in writers]
    _append(writers, expected, "lost?")
    futures = [w.persist_durably(0) for w in writers]
    for f in futures:
        with pytest.raises(PersistError) as e:
            f.result(timeout=60)
        msg = str(e.value)
        assert f"s3://{s3.bucket}/t-fail/jobf/dstl/" in msg  # names the file
        assert "503" in msg and "after 3 attempt" in msg  # and the cause
    assert all(w.retained_sqns() for w in writers)  # nothing appended is lost
    assert sum(s["upload"]["failures"] for s in tree.status()) >= 1
    import ray

    ray.get([tree.node(n).set_fault_spec.remote("") for n in tree.nodes], timeout=30)
    _append(writers, expected, "after")  # the DFS is back
    handles = _persist_all(writers)
    _assert_restores(handles, expected)
    for c in clients:
        c.close()


@pytest.mark.quiet  # the hedge must win within 1.4 s: not beside a background run
def test_hedged_request_leaves_no_stray_object(tree_factory, namespace, s3_env):
    s3 = s3_env
    spec = json.dumps({"script": ["slow:1.5"], "match": ".dstl"})
    tree = tree_factory(base=s3.url("t-hedge"), persist_delay_s=0.05, upload_timeout_s=5.0,
                        hedge_delay_s=0.2, fault_spec=spec, plugins="dstl_ray.testing", **s3.config_options())
    clients, writers = _writers(tree, namespace, "jobh", nodes=2)
    expected = [{} for _ in writers]
    _append(writers, expected, "h")
    t0 = time.monotonic()
    handles = _persist_all(writers)
    assert time.monotonic() - t0 < 1.4  # the hedge won; nobody waited for the straggler
    (path,) = {s.path for h in handles for s in h.segments}
    assert path.endswith("-a2.dstl")
    deadline = time.monotonic() + 10
    while True:  # the first attempt lands at ~1.5 s and is deleted then
        up = _root_status(tree)["upload"]
        if up["losers_deleted"] == 1:
            break
        assert time.monotonic() < deadline, up
        time.sleep(0.2)
    assert (up["hedged"], up["hedge_wins"]) == (1, 1)
    assert s3.keys("t-hedge/") == [f"t-hedge/jobh/{path}"]
    _assert_restores(handles, expected)
    for c in clients:
        c.close()


def test_backpressure_bounds_in_flight_bytes(tree_factory, namespace, s3_env):
    s3 = s3_env
    limit = 24 * 1024
    tree = tree_factory(base=s3.url("t-bp"), persist_delay_s=0.01, persist_size_threshold=1,
                        in_flight_limit=limit,
                        fault_spec=json.dumps({"latency": {"fixed_s": 0.15}}),
                        plugins="dstl_ray.testing",
                        **s3.config_options())
    c = StateChangelogClient("jobb", namespace=namespace, node=tree.root)
    writers = [c.create_writer(f"bp{i}", KeyGroupRange(0, 3)) for i in range(4)]
    expected = [{} for _ in writers]
    last = []
    for r in range(4):
        _append(writers, expected, f"r{r}", size=2500)  # ~10 KiB per request
        last = [w.persist_durably(0) for w in writers]
    handles = [f.result(timeout=60) for f in last]
    for i, h in enumerate(handles):
        assert h.read_all() == expected[i]  # all data arrived
    st = _root_status(tree)
    bp = st["backpressure"]
    assert bp["waits"] > 0 and bp["wait_s"] > 0  # requests waited, visibly
    assert 0 < bp["peak_in_flight_bytes"] <= limit  # memory in flight stayed bounded
    assert st["in_flight_bytes"] == 0 and bp["waiting"] == 0
    c.close()


def test_large_flush_is_a_multipart_upload(s3):
    cfg = ChangelogConfig(s3_multipart_threshold=10 * 1024 * 1024, **s3.config_options())
    st = storage_for(s3.url("mp"), cfg)
    data = os.urandom(11 * 1024 * 1024)
    st.write_file(s3.url("mp/big.dstl"), data)
    st.write_file(s3.url("mp/small.dstl"), b"small")
    head = s3.client().head_object(Bucket=s3.bucket, Key="mp/big.dstl")
    assert head["ETag"].strip('"').endswith("-3")  # parts of 5 + 5 + 1 MiB
    assert "-" not in s3.client().head_object(Bucket=s3.bucket, Key="mp/small.dstl")["ETag"]
    assert st.read_range(s3.url("mp/big.dstl"), 7 << 20, 100) == data[7 << 20:(7 << 20) + 100]


def test_objects_written_elsewhere_after_a_listing_are_seen(s3):
    """A driver lists the job directory at restore, then reads checkpoints other processes
    wrote since: a cached listing made those objects look missing (RestoreError on S3; found
    by the chaos run)."""
    cfg = ChangelogConfig(**s3.config_options())
    here = storage_for(s3.url("lc"), cfg)
    here.write_file(s3.url("lc/job/mat/old.dstm"), b"old")
    assert here.list_files(s3.url("lc/job")) == [s3.url("lc/job/mat/old.dstm")]
    s3.client().put_object(Bucket=s3.bucket, Key="lc/job/mat/new.dstm", Body=b"new")
    assert here.exists(s3.url("lc/job/mat/new.dstm"))
    assert here.read_file(s3.url("lc/job/mat/new.dstm")) == b"new"
    assert here.read_range(s3.url("lc/job/mat/new.dstm"), 1, 2) == b"ew"
    assert len(here.list_files(s3.url("lc/job"))) == 2


def test_credentials_stay_out_of_logs_traces_metrics_and_status(tree_factory, namespace,
                                                                  s3_env, tmp_path):
    """The S3 secret reaches the node actors but none of what they show or write: Ray's
    worker logs (with warnings from failed uploads), trace files, metrics, status."""
    import ray

    s3 = s3_env
    spec = json.dumps({"script": ["5xx", "reset"], "match": ".dstl"})
    tree = tree_factory(base=s3.url("t-secret"), persist_delay_s=0.05, max_attempts=3,
                        retry_delay_s=0.05, fault_spec=spec, plugins="dstl_ray.testing",
                        tracing=f"file:{tmp_path}/traces", **s3.config_options())
    clients, writers = _writers(tree, namespace, "jobsec", nodes=2)
    expected = [{} for _ in writers]
    for cp in range(2):
        _append(writers, expected, f"cp{cp}")
        _assert_restores(_persist_all(writers), expected)
    assert _root_status(tree)["upload"]["retries"] >= 2  # warnings were logged
    shown = json.dumps(tree.status()) + json.dumps(
        [ray.get(tree.node(n).spans.remote()) for n in tree.nodes])
    traces = list((tmp_path / "traces").rglob("*"))
    assert any(p.is_file() for p in traces)
    shown += "".join(p.read_text(errors="replace") for p in traces if p.is_file())
    logs = os.path.join(ray._private.worker._global_node.get_session_dir_path(), "logs")
    for dirpath, _, files in os.walk(logs):
        for f in files:
            with open(os.path.join(dirpath, f), errors="replace") as fh:
                assert TEST_SECRET not in fh.read(), f"secret in Ray log {f}"
    assert "dstl" in shown and TEST_SECRET not in shown
    for c in clients:
        c.close()
