"""File formats: changelog files, materialized state files, RocksDB bundles, and the segments
and path checks every handle is made of."""
