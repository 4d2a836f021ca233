"""Spark glue: Spark on Ray through RayDP, and reaching the nearest changelog node actor from
inside a Spark task's Python worker."""

from .nearest import connect, nearest_node_name
from .session import gcs_address, spark_session, start_spark, stop_spark

__all__ = ["connect", "gcs_address", "nearest_node_name", "spark_session", "start_spark",
           "stop_spark"]
