"""Spark glue: Spark on Ray through RayDP, and reaching the nearest changelog node actor from
inside a Spark task's Python worker."""

from .nearest import connect, nearest_node_name
from .operator import BatchStats, KeyedStatefulOperator
from .session import gcs_address, spark_session, start_spark, stop_spark
from .sessions import Sessions
from .sinks import FileSink
from .state_reader import read_change_feed, read_state
from .ticks import with_ticks
from .views import KeyedState

__all__ = ["BatchStats", "FileSink", "KeyedState", "KeyedStatefulOperator", "Sessions", "connect",
           "gcs_address",
           "nearest_node_name", "read_change_feed", "read_state", "spark_session", "start_spark", "stop_spark",
           "with_ticks"]
