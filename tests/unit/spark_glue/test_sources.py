"""What a state source names (``spark_glue.sources``): the one resolution ``read_state``,
``read_change_feed`` and ``initial_state`` share."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from dstl_ray.errors import ConfigError, RestoreError
from spark_glue.sources import JobOperator, checkpoint_url


@dataclass
class _Operator:
    base_path: str
    job_id: str
    operator_id: str


def test_a_path_names_its_metadata_and_no_operator(tmp_path):
    assert checkpoint_url(f"{tmp_path}/job/chk-7") == (f"file://{tmp_path}/job/chk-7/_metadata",
                                                        None)
    assert checkpoint_url(f"file://{tmp_path}/job/savepoint-ab/_metadata")[0] == (
        f"file://{tmp_path}/job/savepoint-ab/_metadata")


def test_an_operator_is_recognized_by_what_it_has_and_names_itself(tmp_path):
    op = _Operator(f"file://{tmp_path}", "job", "keyed")
    assert isinstance(op, JobOperator)
    with pytest.raises(RestoreError, match="no complete checkpoint under .*/job"):
        checkpoint_url(op)  # the operator's job directory, which holds no checkpoint yet


@pytest.mark.parametrize("bad", [None, "", 7])
def test_anything_else_is_refused_naming_the_argument(bad):
    with pytest.raises(ConfigError, match=r"initial_state must be a checkpoint or savepoint "
                                          r"\(a URL or path\), a job id or an operator"):
        checkpoint_url(bad, what="initial_state")
