from __future__ import annotations

import pytest

EXECUTORS = 3


@pytest.fixture(scope="session")
def spark(ray_cluster):
    """ONE Spark session on the shared Ray cluster (RayDP start-up is the slow part)."""
    from spark_glue import start_spark, stop_spark

    session = start_spark("dstl-tests", num_executors=EXECUTORS, executor_cores=1,
                          executor_memory="512M")
    yield session
    stop_spark()


@pytest.fixture(autouse=True)
def _all_executors(request):
    """Each Spark test starts with all its executors registered: an executor that an earlier
    test killed comes back as a new one seconds later, and a job started before then places
    its subtasks on fewer executors (the one killed next may then hold none)."""
    if "spark" in request.fixturenames:
        from spark_glue.session import wait_for_executors

        wait_for_executors(request.getfixturevalue("spark"), EXECUTORS)
