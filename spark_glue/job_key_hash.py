"""Which key hash a Spark operator's job files its keys by (dstl_ray.key_hashes), batch by
batch: the hash of the state it goes on from, or, for a job with no state yet, Spark's
``xxhash64`` of the key column's type when Spark computes it (so Spark's JVM routes the rows,
spark_glue.jvm_route), unless the operator was told ``key_hash="blake2b"``."""

from __future__ import annotations

from typing import Any

from dstl_ray.checkpoint.recovery import load_checkpoint
from dstl_ray.errors import ConfigError
from dstl_ray.key_hashes import BLAKE2B, SparkXxHash64, key_hash_named, spark_key_hash

# the operator's key_hash option: "auto" (a new job's keys hashed by Spark when it can) or
# "blake2b" (hashed in Python, routed by the Python splitter); a job with state keeps the
# hash its checkpoints record, whatever the option says
KEY_HASH_OPTIONS = ("auto", "blake2b")


class JobKeyHash:
    """One operator's choice (``option``: one of :data:`KEY_HASH_OPTIONS`)."""

    def __init__(self, job_id: str, key: str, option: str = "auto") -> None:
        if option not in KEY_HASH_OPTIONS:
            raise ConfigError(f"key_hash must be one of {', '.join(KEY_HASH_OPTIONS)}, got "
                              f"{option!r}")
        self.job_id, self.key, self.option = job_id, key, option
        self._points: dict[str, str] = {}  # restore point URL -> its hash (read once)

    def of(self, df: Any, latest: Any, point: Any) -> str:
        """The hash's name for micro-batch ``df``: ``latest``'s (the job's latest complete
        checkpoint), else ``point``'s (its restore point: ``initial_state``), else a new
        job's. A job hashed by Spark whose key column has changed type fails here, before
        any task: its state would not be found under the new type's keys."""
        if latest is not None:
            name = latest.metadata.key_hash
        elif point is not None:
            name = self._points.get(point.metadata_url) or self._points.setdefault(
                point.metadata_url, load_checkpoint(point.metadata_url).metadata.key_hash)
        elif self.option == "auto":
            return spark_key_hash(self._key_type(df)).name
        else:
            return BLAKE2B.name
        kind = key_hash_named(name)
        if isinstance(kind, SparkXxHash64) and kind.key_type != self._key_type(df):
            raise ConfigError(f"job {self.job_id!r} files its keys by the key hash {name}, of "
                              f"a Spark {kind.key_type} key column; the micro-batch's "
                              f"{self.key!r} is {self._key_type(df)}: its state would not be "
                              f"found under the new type's keys")
        return name

    def _key_type(self, df: Any) -> str:
        types = {f.name: f.dataType.simpleString() for f in df.schema.fields}
        if self.key not in types:
            raise ConfigError(f"key column {self.key!r} is not in the micro-batch's columns "
                              f"{list(types)}")
        return types[self.key]
