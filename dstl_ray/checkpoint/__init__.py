"""Checkpoints: the coordinator, snapshots and metadata, the shared-state registry,
recovery, and the job lease."""
