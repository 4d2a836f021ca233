"""Unit tests of the Spark glue's pure logic (no Spark session)."""
