"""Property tests of checkpoint metadata on restore (issue 9, a fuzzed reader).

Valid metadata written by a real job (experiments/fuzz_seeds.py) loads and restores the state
the job wrote. Any flipped byte, truncation or JSON mutation (wrong types, huge or negative
numbers, paths with ``..``, absolute paths, other schemes) either raises dstl-ray's own error or
loads to metadata that is well formed (``to_json``/``from_json`` gives it back), names only
files under the base path, and restores or fails with dstl-ray's error. ``_metadata`` is JSON
without a checksum, so a flipped digit may load as different but well-formed metadata: the
property is "confined and well formed, or refused", not "equal or refused".
"""

from __future__ import annotations

import copy
import json
import math

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

import dstl_ray as d
from dstl_ray.checkpoint.metadata import CheckpointMetadata, split_metadata_url
from dstl_ray.checkpoint.recovery import load_checkpoint, restore_backends
from dstl_ray.errors import DstlError, FormatError, HandleError, RestoreError, StorageError
from dstl_ray.storage.local import LocalStorage
from experiments.fuzz_seeds import (
    EVIL,
    JOB,
    MAXP,
    OPERATOR,
    VALUES,
    BytesStorage,
    build_job,
    json_slots,
    restore_reads,
)

from ..ckpt_util import as_decoded

SEEDS = ("checkpoint", "savepoint", "rescaled")
SETTINGS = settings(max_examples=150, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow])


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    return build_job(f"file://{tmp_path_factory.mktemp('dfs')}")


def seed(job, which: str) -> tuple[str, bytes]:
    url = getattr(job, which)
    return url, LocalStorage().read_file(url)


def outcome(url: str, data: bytes) -> d.CompletedCheckpoint | DstlError:
    """Load ``data`` as the ``_metadata`` at ``url`` and read everything it names; any
    exception but dstl-ray's own fails the test."""
    storage = BytesStorage({url: data}, LocalStorage(fsync=False))
    try:
        cc = load_checkpoint(url, storage)
    except DstlError as e:
        assert isinstance(e, RestoreError) and url in str(e)
        return e
    base, _ = split_metadata_url(url)
    for name, u in cc.files.items():
        assert u.startswith(base + "/") and "/../" not in u and u.endswith("/" + name), u
    assert CheckpointMetadata.from_json(cc.metadata.to_json(), url) == cc.metadata
    try:
        restore_reads(cc, storage, 2)
    except DstlError as e:
        return e
    return cc


def expected_state(last_round: int) -> dict[str, dict]:
    """What experiments.fuzz_seeds._write leaves after rounds 0..last_round."""
    out: dict[str, dict] = {"v": {}, "l": {}, "m": {}, "vt": {}, "lt": {}, "mt": {}}
    for i, value in enumerate(VALUES):
        key, value = (f"k{i}" if i % 2 else i), as_decoded(value)
        if i % 4 == 0:  # the TTL states
            if value is not None:  # (an update to None clears a value state)
                out["vt"][key] = value
            out["lt"][key] = [value] * (last_round + 1)
            out["mt"][key] = {f"u{r}": value for r in range(last_round + 1)}
        out["v"][key] = [last_round, value]
        out["l"][key] = [value] * (last_round + 1)
        rounds = [last_round] if i % 3 == 0 else range(last_round + 1)
        out["m"][key] = {f"u{r}": value for r in rounds}
        if i % 3 == 0:
            out["l"][f"gone{i}"] = [1, 2]
    return out


@pytest.mark.parametrize(("which", "last_round"),
                         [("checkpoint", 1), ("savepoint", 1), ("rescaled", 2)])
@pytest.mark.parametrize("parallelism", [1, 3])
def test_valid_metadata_restores_the_written_state(job, which, last_round, parallelism):
    url, data = seed(job, which)
    cc = load_checkpoint(url)
    assert CheckpointMetadata.from_json(data, url) == cc.metadata
    assert CheckpointMetadata.from_json(cc.metadata.to_json(), url) == cc.metadata
    client = d.StateChangelogClient(JOB, transport=d.DirectTransport(JOB, "memory://fz-r"))
    backends = restore_backends(client, cc, OPERATOR, parallelism, MAXP,
                                materialization_interval=None)
    state: dict[str, dict] = {n: {} for n in ("v", "l", "m", "vt", "lt", "mt")}
    for b in backends:
        for name, dd in b.dump().items():
            state[name].update(dd)
        b.close()
    assert state == expected_state(last_round)
    assert isinstance(outcome(url, data), d.CompletedCheckpoint)


@SETTINGS
@given(st.sampled_from(SEEDS), st.data())
def test_flipped_byte_is_refused_or_confined(job, which, data):
    url, raw = seed(job, which)
    pos = data.draw(st.integers(0, len(raw) - 1))
    bad = bytearray(raw)
    bad[pos] ^= 1 << data.draw(st.integers(0, 7))
    event(type(outcome(url, bytes(bad))).__name__)


@SETTINGS
@given(st.sampled_from(SEEDS), st.data())
def test_truncated_metadata_is_refused(job, which, data):
    url, raw = seed(job, which)
    assert isinstance(outcome(url, raw[:data.draw(st.integers(0, len(raw) - 1))]), RestoreError)


evil_values = st.one_of(
    st.sampled_from(EVIL), st.none(), st.booleans(), st.integers(-2**70, 2**70),
    st.floats(), st.text(max_size=12), st.lists(st.integers(-3, 2**40), max_size=4),
    st.dictionaries(st.text(max_size=4), st.integers(), max_size=2))


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.sampled_from(SEEDS), st.data())
def test_json_mutation_is_refused_or_confined(job, which, data):
    url, raw = seed(job, which)
    doc = json.loads(raw)
    for _ in range(data.draw(st.integers(1, 3))):
        slots = json_slots(doc)
        container, key = slots[data.draw(st.integers(0, len(slots) - 1))]
        if data.draw(st.booleans()) or not isinstance(container, dict):
            container[key] = copy.deepcopy(data.draw(evil_values))
        else:
            del container[key]
    event(type(outcome(url, json.dumps(doc).encode())).__name__)


# ------------------------------------------------------------- paths outside the base path

def mutated(job, which: str, change) -> tuple[str, bytes]:
    url, raw = seed(job, which)
    doc = json.loads(raw)
    change(doc)
    return url, json.dumps(doc).encode()


def components(doc, kind: str) -> list[dict]:
    return [c for s in doc["snapshots"] for c in s["components"] if c["type"] == kind]


ESCAPES = ["../x.dstm", "a/../../x.dstm", "/etc/x.dstm", "//host/x.dstm", "./x.dstm",
           "x\\..\\y.dstm", "s3://other/x.dstm", "file:///etc/x.dstm", "", "..", "mat/"]


@pytest.mark.parametrize("path", ESCAPES)
@pytest.mark.parametrize("which", ["checkpoint", "savepoint"])
def test_materialized_paths_outside_the_job_are_refused(job, which, path):
    def change(doc):
        components(doc, "materialized")[0]["path"] = path
    e = outcome(*mutated(job, which, change))
    assert isinstance(e, RestoreError) and isinstance(e.__cause__, HandleError)


@pytest.mark.parametrize("path", [p.replace(".dstm", ".dstl") for p in ESCAPES])
def test_segment_paths_outside_the_job_are_refused(job, path):
    def change(doc):
        components(doc, "changelog")[0]["handle"]["segments"][0]["path"] = path
    assert isinstance(outcome(*mutated(job, "checkpoint", change)), RestoreError)


@pytest.mark.parametrize("job_dir", ["../other", "/abs", "a/b", "", ".", "..", 7, ["fuzz"]])
@pytest.mark.parametrize("kind", ["materialized", "changelog"])
def test_job_directories_outside_the_base_are_refused(job, job_dir, kind):
    def change(doc):
        components(doc, kind)[0]["job"] = job_dir
    assert isinstance(outcome(*mutated(job, "checkpoint", change)), RestoreError)


@pytest.mark.parametrize("suffix", ["/../other/fuzz", "/other", "/fuzz/sub"])
def test_handle_job_paths_outside_the_job_are_refused(job, suffix):
    def change(doc):
        components(doc, "changelog")[0]["handle"]["job_path"] = job.base + suffix
    e = outcome(*mutated(job, "checkpoint", change))
    assert isinstance(e, RestoreError) and "outside the job's base path" in str(e)


@pytest.mark.parametrize("job_path", ["s3://bucket/fuzz", "http://host/fuzz", "memory://fuzz",
                                      "file:///etc/fuzz", "/no/scheme", "fuzz"])
def test_handle_job_paths_elsewhere_are_refused(job, job_path):
    def change(doc):
        components(doc, "changelog")[0]["handle"]["job_path"] = job_path
    assert isinstance(outcome(*mutated(job, "checkpoint", change)), RestoreError)


@pytest.mark.parametrize("spelling", ["//fuzz", "/x/../fuzz", "/./fuzz", "/fuzz/"])
def test_job_path_spellings_load_normalized(job, spelling):
    """Regression: another spelling of the job directory was accepted but kept as written, so
    file URLs differed from a listing's (orphan cleanup would delete them)."""
    def change(doc):
        components(doc, "changelog")[0]["handle"]["job_path"] = job.base + spelling
    cc = outcome(*mutated(job, "checkpoint", change))
    assert isinstance(cc, d.CompletedCheckpoint)
    assert all(u.startswith(f"{job.base}/{JOB}/") for u in cc.files.values())
    assert set(cc.files.values()) == set(load_checkpoint(job.checkpoint).files.values())


# ------------------------------------------------------------- numbers and types

@pytest.mark.parametrize(("field", "value"), [
    ("offset", -1), ("length", -5), ("offset", 1.5), ("length", True), ("sqn", [3, 1]),
    ("sqn", [-1, 2]), ("offset", "16"), ("length", None)])
def test_bad_segment_numbers_are_refused(job, field, value):
    def change(doc):
        components(doc, "changelog")[0]["handle"]["segments"][0][field] = value
    assert isinstance(outcome(*mutated(job, "checkpoint", change)), RestoreError)


@pytest.mark.parametrize("field", ["offset", "length"])
def test_huge_segment_ranges_fail_as_torn_not_memory(job, field):
    """A length field of 2**62 must not size a read buffer (was MemoryError on file://)."""
    def change(doc):
        components(doc, "changelog")[0]["handle"]["segments"][0][field] = 2**62
    e = outcome(*mutated(job, "checkpoint", change))
    assert isinstance(e, FormatError) and "torn" in str(e)


@pytest.mark.parametrize("section", [
    [0, -1, 30], [0, 12, -30], [0, 1e400, 30], [0, 12.0, 30], [0, 12, 10**9], [99, 12, 30],
    [0, 12], [0, 12, 30, 1], "0,12,30", [True, 12, 30], {"kg": 0}])
def test_bad_materialized_sections_are_refused(job, section):
    """Regression: a float section field (1e400) raised OverflowError, 12.0 was truncated."""
    def change(doc):
        components(doc, "materialized")[0]["sections"][0] = section
    e = outcome(*mutated(job, "checkpoint", change))
    assert isinstance(e, RestoreError) and isinstance(e.__cause__, HandleError)


def test_huge_materialized_size_fails_as_corrupt(job):
    def change(doc):
        comp = components(doc, "materialized")[0]
        comp["size"] = 2**62
        comp["sections"] = [[kg, 2**61, 2**40] for kg, _, _ in comp["sections"]]
    assert isinstance(outcome(*mutated(job, "checkpoint", change)), FormatError)


@pytest.mark.parametrize(("field", "value"), [
    ("id", -1), ("id", 2**63), ("id", "1"), ("id", True), ("max_parallelism", 0),
    ("max_parallelism", 2**15 + 1), ("max_parallelism", 8.0), ("kind", "full"),
    ("version", 2), ("type", "dstl-changelog-handle"), ("snapshots", {}), ("job", None),
    ("timestamp", 10**400), ("timestamp", math.inf), ("timestamp", math.nan),
    ("timestamp", True), ("timestamp", "now")])
def test_bad_top_level_fields_are_refused(job, field, value):
    """Regression: timestamp 10**400 raised OverflowError; NaN loaded but never equalled
    itself; a missing job loaded as "" which the writer then wrote and the reader refused."""
    def change(doc):
        doc[field] = value
    assert isinstance(outcome(*mutated(job, "checkpoint", change)), RestoreError)


@pytest.mark.parametrize("states", [
    [["v", ["value"]]], [["v", {"x": 1}]], [["v", "set"]], [["", "value"]],
    [["v", "value"], ["v", "list"]], [["x" * 201, "value"]], "v", [["v"]]])
@pytest.mark.parametrize("kind", ["materialized", "changelog"])
def test_bad_state_specs_are_refused(job, states, kind):
    """Regression: an unhashable state kind raised TypeError."""
    def change(doc):
        components(doc, kind)[0]["states"] = states
    assert isinstance(outcome(*mutated(job, "checkpoint", change)), RestoreError)


@pytest.mark.parametrize("key", ["path", "key_groups", "states", "sections", "size"])
def test_materialized_handle_missing_a_field_is_refused(job, key):
    """Regression: a handle without "states" raised KeyError."""
    def change(doc):
        del components(doc, "materialized")[0][key]
    assert isinstance(outcome(*mutated(job, "checkpoint", change)), RestoreError)


def test_restrict_outside_the_handle_is_refused(job):
    def change(doc):
        comp = next(c for c in components(doc, "changelog") if "restrict" in c)
        comp["restrict"] = [7, 7] if comp["handle"]["key_groups"][1] < 7 else [0, 0]
    assert isinstance(outcome(*mutated(job, "rescaled", change)), RestoreError)


@pytest.mark.parametrize("depth", [2_000, 100_000])
def test_deeply_nested_json_is_refused(job, depth):
    """Regression: json.loads raised RecursionError, in metadata and in handles."""
    text = b"[" * depth + b"]" * depth
    assert isinstance(outcome(job.checkpoint, text), RestoreError)
    with pytest.raises(HandleError, match="not valid JSON"):
        d.StateChangelogHandle.from_json(text)


def test_local_read_range_never_sizes_a_buffer_from_the_length(tmp_path):
    """Regression: LocalStorage.read_range(path, 0, 2**40) raised MemoryError."""
    st = LocalStorage(fsync=False)
    url = f"file://{tmp_path}/f"
    st.write_file(url, b"0123456789")
    assert st.read_range(url, 2, 2**62) == b"23456789"
    assert st.read_range(url, 2**62, 2**62) == b""
    with pytest.raises(StorageError, match="negative range"):
        st.read_range(url, -1, 4)
