"""Checkpoints: the coordinator, the ``_metadata`` file, recovery, savepoints, the job lease,
and reading checkpoints without the job."""
