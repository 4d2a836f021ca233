"""What an operator's sink is given and what it refuses, without Spark: a FileSink needs an
output schema (it writes Spark DataFrames), a bad format or path is a ConfigError naming it,
and the per-key API's outputs stay one list without a schema."""

from __future__ import annotations

import pytest

from dstl_ray.errors import ConfigError
from spark_glue.sinks import FORMATS, BatchOutputs, FileSink, Outputs


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


class _Logged:
    """A sink with a log, as a FileSink has: the batches it holds for good."""

    def __init__(self) -> None:
        self.got: list[tuple[int, object]] = []

    def __call__(self, batch_id, outputs) -> None:
        self.got.append((batch_id, outputs))

    def committed(self, spark) -> int | None:
        return self.got[-1][0] if self.got else None


class _Spark:
    """createDataFrame only, recording what it was given (the shaping is what is tested)."""

    def createDataFrame(self, rows, schema):  # noqa: N802 - Spark's name
        return ("frame", rows, schema)


def test_timers_outputs_go_apart_to_their_own_sink_when_they_have_a_schema():
    results = [{"outputs": [("a", 1)], "timer_outputs": [("a", 10, 20)]},
               {"outputs": [("b", 2)], "timer_outputs": []}]
    update, timers = _Logged(), _Logged()
    outputs = Outputs("rows", None, update, timer_output_schema="k STRING, s LONG, e LONG",
                      timer_sink=timers, has_timers=True)
    assert outputs.apart
    shaped = outputs.shape(results, _Spark())
    assert shaped == ([("a", 1), ("b", 2)],
                      ("frame", [("a", 10, 20)], "k STRING, s LONG, e LONG"))
    assert outputs.deliver(3, shaped) == [("a", 1), ("b", 2)] == outputs.last
    assert update.got == [(3, shaped[0])] and timers.got == [(3, shaped[1])]
    assert outputs.last_timers == shaped[1] and outputs.delivered(None, 3)
    timers.got.clear()  # the driver died between the two sinks: the batch is not done
    assert not outputs.delivered(None, 3)
    together = Outputs("rows", None, None)  # no timer schema: one stream, as before
    assert not together.apart and together.shape(results, None) == ([("a", 1), ("b", 2)], None)


def test_timer_outputs_options_are_checked():
    with pytest.raises(ConfigError, match="timer_sink needs a timer_output_schema"):
        Outputs("rows", None, None, timer_sink=lambda b, o: None, has_timers=True)
    with pytest.raises(ConfigError, match="timer_output_schema needs on_timer"):
        Outputs("rows", None, None, timer_output_schema="k STRING")
    assert Outputs("pandas", None, None, timer_output_schema="k STRING", has_timers=True,
                   timer_sink=FileSink("/t")).apart  # a file sink of the timers' own


def test_one_directory_for_both_sinks_is_refused_and_timers_without_a_sink_hold_nothing():
    with pytest.raises(ConfigError, match="sink and timer_sink write to one directory"):
        Outputs("rows", "k STRING", FileSink("/out/x"), timer_output_schema="k STRING",
                timer_sink=FileSink("/out/x/"), has_timers=True)
    update = _Logged()
    outputs = Outputs("rows", None, update, timer_output_schema="k STRING", has_timers=True)
    outputs.deliver(4, ([("a", 1)], None))
    # the update's sink holds the batch, the timers' outputs are held nowhere: a replay of
    # it is done, not recomputed
    assert outputs.delivered(None, 4) and not outputs.delivered(None, 5)
