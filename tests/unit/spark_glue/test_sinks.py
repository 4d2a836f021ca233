"""What an operator's sink is given and what it refuses, without Spark: a FileSink needs an
output schema (it writes Spark DataFrames), a bad format or path is a ConfigError naming it,
and the per-key API's outputs stay one list without a schema."""

from __future__ import annotations

import pytest

from dstl_ray.errors import ConfigError
from spark_glue.sinks import FORMATS, BatchOutputs, FileSink


def test_a_file_sink_names_what_is_wrong():
    assert FileSink("/out").format == "parquet" and set(FORMATS) >= {"parquet", "json", "csv"}
    with pytest.raises(ConfigError, match="format must be one of parquet, json, csv, orc, "
                                          "got 'xml'"):
        FileSink("/out", "xml")
    with pytest.raises(ConfigError, match="path must be a directory path or URL, got ''"):
        FileSink("")
    with pytest.raises(ConfigError, match="writes Spark DataFrames, got list"):
        FileSink("/out")(0, [("a", 1)])
    assert FileSink("/o", options={"compression": "zstd", "n": 1}).options == {
        "compression": "zstd", "n": "1"}


def test_outputs_for_a_file_sink_need_a_schema():
    with pytest.raises(ConfigError, match=r"FileSink\('/out', 'json'\) writes Spark "
                                          r"DataFrames: give the operator an output_schema"):
        BatchOutputs("rows", None, FileSink("/out", "json"))
    BatchOutputs("rows", "k STRING, n LONG", FileSink("/out"))  # either API, with a schema
    BatchOutputs("pandas", "k STRING, n LONG", FileSink("/out"))
    with pytest.raises(ConfigError, match="sink must be callable"):
        BatchOutputs("rows", None, "s3://bucket/out")
    with pytest.raises(ConfigError, match="api must be one of rows, pandas, got 'arrow'"):
        BatchOutputs("arrow", None, None)


def test_the_sink_gets_the_shaped_outputs_once_per_batch():
    got: list[tuple[int, object]] = []
    outputs = BatchOutputs("rows", None, lambda b, out: got.append((b, out)))
    results = [{"outputs": [("a", 1)]}, {"outputs": []}, {"outputs": [("b", 2), ("c", 3)]}]
    shaped = outputs.shape(results, spark=None)
    assert outputs.deliver(7, shaped) == [("a", 1), ("b", 2), ("c", 3)]
    assert got == [(7, [("a", 1), ("b", 2), ("c", 3)])]
    assert not outputs.delivered(None, 7)  # a callback keeps no log: a replay recomputes
