"""The operator's state_schema and drop_state on the driver (spark_glue.state_shapes): each
checked when the operator is made; the stored types of the checkpoint the job goes on from
are declared for states the run leaves out (so no checkpoint holds a state typed in one
snapshot and untyped in another), dropped ones excepted; a change stored values cannot
follow is refused before any task, and the coordinator's lease goes with the refusal."""

from __future__ import annotations

import pyarrow as pa
import pytest

import dstl_ray as d
from dstl_ray.errors import ConfigError, SchemaError
from spark_glue.state_shapes import check_against, drop_spec, schema_spec

from ..ckpt_util import client

JOB = "shapes"


def test_options_are_checked_and_canonical():
    assert schema_spec({"a": "BIGINT", "b": pa.float64()}) == (("a", "bigint"),
                                                               ("b", "double"))
    assert schema_spec(None) == () and drop_spec(None, ()) == ()
    assert drop_spec(["x", "x", "y"], ["a"]) == ("x", "y")
    with pytest.raises(ConfigError, match="'_timers' is the operator's timers"):
        schema_spec({"_timers": "bigint"})
    with pytest.raises(ConfigError, match="unknown type"):
        schema_spec({"a": "bignum"})
    with pytest.raises(ConfigError, match="a list of state names"):
        drop_spec("x", ())
    with pytest.raises(ConfigError, match=r"both name \['a'\]"):
        drop_spec(["a"], ["a"])


def test_stored_types_are_declared_and_an_incompatible_change_is_refused(tmp_path):
    base = f"file://{tmp_path}/dfs"
    coord = d.CheckpointCoordinator(JOB, base, max_parallelism=16, retained=2)
    (b,) = coord.restore(client(JOB, base), "op", 1, materialization_interval=None)
    b.value_state("x", schema="int").update("k", 1)
    b.value_state("y", schema="string").update("k", "a")
    b.value_state("plain").update("k", 1)
    coord.trigger_checkpoint().result(timeout=30)
    coord.shutdown()
    again = d.CheckpointCoordinator(JOB, base, max_parallelism=16, retained=2)
    again.restore(None, "op", 0)
    try:
        assert check_against(again, "op", (("x", "bigint"),), ("y",)) == (("x", "bigint"),)
        assert check_against(again, "op", ()) == (("x", "int"), ("y", "string"))
        with pytest.raises(SchemaError, match="'x'.*narrows int to smallint"):
            check_against(again, "op", (("x", "smallint"),))
    finally:
        again.shutdown()
    # the refusal released the job: a next driver takes it at once
    third = d.CheckpointCoordinator(JOB, base, max_parallelism=16, retained=2)
    third.restore(None, "op", 0)
    third.shutdown()
