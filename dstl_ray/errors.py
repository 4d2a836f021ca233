"""Exceptions raised by dstl-ray. Every error derives from :class:`DstlError`."""

from __future__ import annotations


class DstlError(Exception):
    """Base class of every error raised by dstl-ray."""


class ConfigError(DstlError, ValueError):
    """A configuration option has a bad value; the message names the option and its range."""


class WriterClosedError(DstlError):
    """The writer was closed; no appends or persist requests are possible any more."""


class KeyGroupError(DstlError, ValueError):
    """A key group is outside the writer's (or backend's) key group range."""


class InvalidValueError(DstlError, TypeError):
    """An appended value is not ``bytes``."""


class SqnError(DstlError, ValueError):
    """A sequence number lies outside what the writer has handed out."""


class FormatError(DstlError):
    """A changelog file (or section of it) is torn, corrupt or of an unknown version.

    The message names the file and the byte offset where decoding failed.
    """

    def __init__(self, message: str, *, path: str | None = None, offset: int | None = None):
        where = ""
        if path is not None:
            where += f" in {path}"
        if offset is not None:
            where += f" at offset {offset}"
        super().__init__(f"{message}{where}")
        self.path = path
        self.offset = offset


class HandleError(DstlError, ValueError):
    """A persisted handle or metadata document is malformed or unsafe (e.g. a path escaping
    the job's base path)."""


class StorageError(DstlError):
    """A DFS call failed (after retries); the message names the file and the cause."""


class PersistError(DstlError):
    """A ``persist_durably`` request could not be made durable. The changes are still held by
    the writer; the checkpoint that asked must be declined, and a later one may succeed."""


class NodeUnavailableError(DstlError):
    """No changelog node actor could be reached (not deployed, or dead)."""


class CheckpointError(DstlError):
    """A checkpoint could not be completed or restored."""


class StateError(DstlError, ValueError):
    """Keyed state misuse: unknown or mismatched state, a value the serializer cannot encode."""


class SchemaError(StateError):
    """A state's declared type cannot change as asked (its stored values could not be read
    with the new one): the message names the state, both schemas and what breaks."""


class LocalStateError(StateError):
    """The local working copy of a state table failed: its directory could not be made, the
    disk is full, an I/O error, or the table was used after it was closed. The message names
    the directory and the cause."""


class CheckpointDeclinedError(CheckpointError):
    """A checkpoint was declined (a backend's snapshot failed, or it was subsumed/aborted)."""


class HubError(CheckpointError):
    """A checkpoint hub connection failed or was refused (a wrong token, a broken frame, the
    hub or the participant gone)."""


class RestoreError(CheckpointError):
    """Restoring from a checkpoint failed; the message names the checkpoint and the file."""

    def __init__(self, message: str, *, checkpoint: str | None = None,
                 path: str | None = None) -> None:
        super().__init__(message)
        self.checkpoint = checkpoint
        self.path = path


class MissingStateError(CheckpointError):
    """A run needs state that no checkpoint of the job holds: a Spark micro-batch ``n > 0``
    whose job has no complete checkpoint ``n - 1`` or ``n`` (its changelog base path is new
    or emptied while Spark's checkpoint location says batches before ``n`` ran). Starting
    from empty state instead must be chosen explicitly. The message names the job, the batch
    and what was found."""

    def __init__(self, message: str, *, job_id: str, batch_id: int, latest_id: int | None,
                 base_path: str) -> None:
        super().__init__(message)
        self.job_id = job_id
        self.batch_id = batch_id
        self.latest_id = latest_id
        self.base_path = base_path


class NamespaceError(DstlError, PermissionError):
    """A request for a job came from another Ray namespace than the job's own: node actors
    accept a job's requests only from the namespace that job's writers run in."""


class JobLeaseError(DstlError):
    """Another live driver holds the job, or took it over from this one (one live driver per
    job: the lease in the job directory)."""


class StaleIncarnationError(DstlError):
    """A request of an older incarnation of a job reached a node that already serves a newer
    one (the job was restarted under the same id): it is refused, never mixed in."""


class FencedError(DstlError):
    """The sending process's Ray job was found dead and its writers' merged-file sections
    released (dstl_ray.node.dead_writers): nothing more is accepted from it."""


class DeadlineError(DstlError, TimeoutError):
    """A request's or checkpoint's deadline passed before it could be completed."""


class MissingDependencyError(DstlError, ImportError):
    """An optional dependency is not installed; the message names the extra that brings it
    (plots need matplotlib: ``pip install 'dstl-ray[plot]'``)."""
