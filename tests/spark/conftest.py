from __future__ import annotations

import pytest

EXECUTORS = 3
# The tests' JVMs (the driver, RayDP's app master, 3 executors) compile with C1 only and
# collect with one thread: each test moves little data through short-lived jobs, and C2's
# compiler threads in five JVMs on two cores cost more than the code they speed up (the
# timers and vectorized tests: 177-183 s -> 117-136 s). The semantics are the same; the
# experiments keep the JVM's defaults, as users do.
TEST_JVM = "-XX:TieredStopAtLevel=1 -XX:+UseSerialGC"
JVM_CONFIGS = {"spark.driver.extraJavaOptions": TEST_JVM,
               "spark.executor.extraJavaOptions": TEST_JVM,
               "spark.ray.raydp_app_master.extraJavaOptions": TEST_JVM}


@pytest.fixture(scope="session")
def spark(ray_cluster):
    """ONE Spark session on the shared Ray cluster (RayDP start-up is the slow part)."""
    from spark_glue import start_spark, stop_spark

    session = start_spark("dstl-tests", num_executors=EXECUTORS, executor_cores=1,
                          executor_memory="512M", configs=JVM_CONFIGS)
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
