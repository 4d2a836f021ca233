from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def spark(ray_cluster):
    """ONE Spark session on the shared Ray cluster (RayDP start-up is the slow part)."""
    from spark_glue import start_spark, stop_spark

    session = start_spark("dstl-tests", num_executors=3, executor_cores=1,
                          executor_memory="512M")
    yield session
    stop_spark()
