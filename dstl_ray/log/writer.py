"""The writer: one log per state backend instance (FLIP-158 "API": StateChangelogWriter).

``append`` is cheap: no I/O and no actor call, the change goes to the open changeset in memory.
``last_appended_sqn`` closes the open changeset and returns its sqn, a boundary: changes
appended before have sqn <= it, changes appended after have sqn > it. ``persist_durably(after)``
ships, as ONE request, the changesets with sqn > ``after`` that are neither uploaded nor
uploading, and combines the result with what earlier uploads already hold (FLIP-158 "Example").

Durability (docs/architecture.md "Write path" 1): a changeset's bytes stay in memory until an
upload of it succeeds, so a failed upload never loses a change a checkpoint may need; the
persist future fails with a :class:`PersistError` and the next persist request re-sends those
changesets. After a successful upload only its segment is kept, until ``truncate(before)``.
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
import uuid
from collections.abc import Sequence
from operator import itemgetter

from ..errors import DstlError, InvalidValueError, KeyGroupError, SqnError, WriterClosedError
from ..format.changelog import Changeset, encode_section
from ..format.segment import Segment
from ..keygroups import KeyGroupRange
from ..merging.pool import UNKNOWN_USE as UNKNOWN_CHECKPOINT
from ..merging.segments import SEGMENTS_DIR
from ..observability import tracing
from ..transport.base import PersistRequest, Transport
from .handle import StateChangelogHandle
from .uploads import InFlight, Upload, after_both, combine_uploads

log = logging.getLogger(__name__)

ENTRY_OVERHEAD = 4  # bytes per entry in the file besides the value (its length prefix)


class StateChangelogWriter:
    """Writer of one log; obtain it from :meth:`StateChangelogClient.create_writer`.

    Not thread-safe for its callers (like a Flink backend, use it from one thread); upload
    completions arrive on other threads and are synchronized internally.
    """

    def __init__(self, transport: Transport, job_id: str, operator_id: str,
                 key_group_range: KeyGroupRange) -> None:
        if not isinstance(key_group_range, KeyGroupRange):
            raise KeyGroupError(f"key_group_range must be a KeyGroupRange, got "
                                f"{type(key_group_range).__name__}")
        self._transport = transport
        self._job_id = job_id
        self.operator_id = operator_id
        self.key_group_range = key_group_range
        self.log_id = uuid.uuid4().hex
        self._log_bytes = bytes.fromhex(self.log_id)
        self._kg_start, self._kg_end = key_group_range.start, key_group_range.end
        cfg = transport.config
        self._compression = cfg.compression
        self._preemptive_threshold = cfg.preemptive_persist_threshold
        self._lock = threading.RLock()
        self._open: list[tuple[int, bytes]] = []
        self._unsent_bytes = 0  # bytes appended since the last upload started
        self._sqn = 0  # sqn of the last closed changeset
        self._truncated = 0  # changesets with sqn <= this were dropped
        self._subsumed = -1  # the job's subsumed watermark, sent with every request
        # the newest checkpoint id any handle of this log was made for (UNKNOWN_CHECKPOINT,
        # for good, once one was made without an id), sent with every request: should this
        # process die without releasing, its node releases its sections up to this one
        self.named = -1
        # the run of the job this log writes for (set by its backend's coordinator)
        self.incarnation = ""
        self._adopted: list[Segment] = []  # restored segments its backend still names
        self._changesets: dict[int, Changeset] = {}
        self._sizes: dict[int, int] = {}
        self._uploads: dict[int, Upload] = {}  # sqn -> upload holding that changeset
        self._in_flight = InFlight()  # also those no sqn names any more (truncated)
        self._closed = False
        self.preemptive_uploads = 0
        transport.register(self.log_id)
        # merged changelog files (the tree said so at registration): a node must know
        # ``named`` before a handle goes out
        self._acked_marks = bool(getattr(transport, "acked_marks", False))

    # ------------------------------------------------------------------ hot path

    def append(self, key_group: int, value: bytes) -> None:
        """Append one state change of ``key_group`` (cheap: memory only)."""
        if self._closed:
            raise WriterClosedError(f"writer {self.log_id} of {self.operator_id!r} is closed")
        if type(value) is not bytes:
            raise InvalidValueError(f"value must be bytes, got {type(value).__name__}")
        if not (type(key_group) is int and self._kg_start <= key_group <= self._kg_end):
            raise KeyGroupError(f"key group {key_group!r} is outside the writer's range "
                                f"{self._kg_start}..{self._kg_end}")
        self._open.append((key_group, value))
        self._unsent_bytes += len(value) + ENTRY_OVERHEAD
        if self._unsent_bytes >= self._preemptive_threshold:
            self._preemptive_persist()

    def append_all(self, entries: Sequence[tuple[int, bytes]]) -> None:
        """:meth:`append` of each ``(key group, change)``, all or none (a bad one raises as
        :meth:`append`), one pre-emptive persist check after them (pass chunks)."""
        self._check_open()
        lo, hi = self._kg_start, self._kg_end
        for kg, value in entries:
            if type(value) is not bytes or not (type(kg) is int and lo <= kg <= hi):
                self.append(kg, value)  # raises
        self._open.extend(entries)
        self._unsent_bytes += sum(len(v) for _, v in entries) + ENTRY_OVERHEAD * len(entries)
        if self._unsent_bytes >= self._preemptive_threshold:
            self._preemptive_persist()

    # ------------------------------------------------------------------ sqn

    def _rollover(self) -> None:
        if self._open:
            self._sqn += 1
            entries = tuple(self._open)
            self._changesets[self._sqn] = Changeset(self._sqn, entries)
            self._sizes[self._sqn] = (sum(map(len, map(itemgetter(1), entries)))
                                      + ENTRY_OVERHEAD * len(entries))
            self._open = []

    def last_appended_sqn(self) -> int:
        """Close the open changeset and return its sqn (the last sqn if nothing is open)."""
        self._check_open()
        with self._lock:
            self._rollover()
            return self._sqn

    def _check_open(self) -> None:
        if self._closed:
            raise WriterClosedError(f"writer {self.log_id} of {self.operator_id!r} is closed")

    # ------------------------------------------------------------------ persist

    def _send(self, sqns: list[int], preemptive: bool,
              trace: tuple[tuple[str, str], ...] = (), checkpoint_id: int = -1) -> Upload:
        """Ship changesets ``sqns`` as ONE request (caller holds the lock)."""
        section = encode_section(self._log_bytes, [self._changesets[s] for s in sqns],
                                 self._compression)
        up = Upload(tuple(sqns), len(section.data), preemptive)
        for s in sqns:
            self._uploads[s] = up
        self._in_flight.add(up)
        self._unsent_bytes = 0
        try:
            fut = self._transport.send(PersistRequest(self._job_id, section, self.log_id, trace,
                                                        checkpoint_id,
                                                        subsumed=self._subsumed,
                                                        incarnation=self.incarnation,
                                                        named=self.named))
        except Exception as e:  # noqa: BLE001 - the node is gone; fail this upload only
            fut = concurrent.futures.Future()
            fut.set_exception(e)
        fut.add_done_callback(lambda f, up=up: self._upload_done(up, f))
        return up

    def _upload_done(self, up: Upload, fut: concurrent.futures.Future) -> None:
        try:
            self._settle(up, fut)
        except BaseException as e:  # noqa: BLE001 - never leave a persist future pending
            log.error("completing upload of log %s failed: %r", self.log_id, e)
            if not up.future.done():
                up.future.set_exception(e)

    def _settle(self, up: Upload, fut: concurrent.futures.Future) -> None:
        err = fut.exception()
        release = False
        with self._lock:
            if err is None:
                up.segment = fut.result()
                # uploaded: only the segment is needed from now on, never the bytes again
                # (they are re-sent only while no upload holds them), so memory holds the
                # changes not yet durable, not every change since the last materialization
                # (Flink's writer, too, keeps handles of uploaded changes, not the changes)
                for s in up.sqns:
                    cs = self._changesets.get(s)
                    if cs is not None and cs.entries:
                        self._changesets[s] = Changeset(s, ())
                        self._sizes[s] = 0
                # truncated or closed before it finished: tell its node we are done with it
                release = self._closed or all(s not in self._changesets for s in up.sqns)
                up.released = release
            else:
                for s in up.sqns:
                    if self._uploads.get(s) is up:
                        del self._uploads[s]  # the next persist request re-sends it
        if err is None:
            if release:
                self._release(up)
            up.future.set_result(up.segment)
        else:
            log.warning("upload of sqn %s..%s of log %s failed: %s", up.sqns[0], up.sqns[-1],
                        self.log_id, err)
            up.future.set_exception(err)

    def _preemptive_persist(self) -> None:
        """Flink's pre-emptive persist: ship unsent changes before a checkpoint asks."""
        with self._lock:
            self._rollover()
            pending = [s for s in self._changesets if s not in self._uploads]
            if pending:
                self.preemptive_uploads += 1
                self._send(pending, preemptive=True)

    def persist_durably(self, after: int, checkpoint_id: int = -1
                        ) -> concurrent.futures.Future[StateChangelogHandle]:
        """Make every change with sqn > ``after`` durable; resolve to a handle for them.

        ``checkpoint_id`` (optional, as Flink's ``persist(from, checkpointId)``) lets the node
        actors keep the requests of one checkpoint in one batch, hence one file.

        Changesets already uploaded (or uploading) are reused, the rest is sent as ONE
        request to the node actor. On failure the future raises :class:`PersistError` and
        nothing is dropped: the next call sends the changes again.
        """
        self._check_open()
        if type(after) is not int or after < 0:
            raise SqnError(f"after must be a non-negative int sqn, got {after!r}")
        if type(checkpoint_id) is not int or checkpoint_id < -1:
            raise SqnError(f"checkpoint_id must be an int >= -1, got {checkpoint_id!r}")
        with self._lock:
            self._rollover()
            self.named = (UNKNOWN_CHECKPOINT if checkpoint_id < 0 or self.named ==
                          UNKNOWN_CHECKPOINT else max(self.named, checkpoint_id))
            if after > self._sqn:
                raise SqnError(f"persist_durably(after={after}) is beyond the last appended "
                               f"sqn {self._sqn} of writer {self.log_id}")
            if after < self._truncated:
                raise SqnError(f"persist_durably(after={after}): changes up to sqn "
                               f"{self._truncated} were truncated already")
            needed = [s for s in self._changesets if s > after]
            unsent = [s for s in needed if s not in self._uploads]
            wspan = tracing.start_span("dstl.writer.persist", log=self.log_id,
                                       operator=self.operator_id, after=after,
                                       sqn_to=self._sqn) if tracing.enabled() else None
            trace = tuple(tracing.carrier(wspan).items()) if wspan is not None else ()
            new = (self._send(unsent, preemptive=False, trace=trace,
                              checkpoint_id=checkpoint_id) if unsent else None)
            if wspan is not None:
                wspan.set_attribute("dstl.bytes_sent", new.size if new else 0)
                wspan.set_attribute("dstl.changesets", len(needed))
            uploads: list[Upload] = []
            for s in needed:
                # (a failed send may already have dropped its sqns from self._uploads)
                up = new if new is not None and s in new.sqns else self._uploads[s]
                if up not in uploads:
                    uploads.append(up)
            for up in uploads:
                up.used = True
                up.last_checkpoint = max(up.last_checkpoint, checkpoint_id
                                         if checkpoint_id >= 0 else UNKNOWN_CHECKPOINT)
            sqn_to = self._sqn
        marked: concurrent.futures.Future | None = None
        if new is None and (checkpoint_id >= 0 or self._acked_marks):
            # nothing new to send for this checkpoint: tell the node not to wait for us
            # (and, with merged files, how far our handles may be named, before one goes out)
            mark = getattr(self._transport, "mark", None)
            if mark is not None:
                marked = (mark(self.log_id, checkpoint_id, self.named) if self._acked_marks
                          else mark(self.log_id, checkpoint_id))
        result: concurrent.futures.Future[StateChangelogHandle] = concurrent.futures.Future()
        if self._acked_marks and isinstance(marked, concurrent.futures.Future):
            handle: concurrent.futures.Future[StateChangelogHandle] = concurrent.futures.Future()
            combine_uploads(handle, uploads, self._transport.job_path, self.log_id,
                            self.key_group_range, after, sqn_to)
            after_both(handle, marked, result)
        else:
            combine_uploads(result, uploads, self._transport.job_path, self.log_id,
                            self.key_group_range, after, sqn_to)
        if wspan is not None:
            result.add_done_callback(lambda f: tracing.end_span(
                wspan, error=f.exception(),
                segments=None if f.exception() else len(f.result().segments)))
        return result

    # ------------------------------------------------------------------ truncate / close

    def adopt(self, segments: Sequence[Segment]) -> None:
        """Segments of merged changelog files (a node's ``segments/``) that this log's
        backend restored and will name in its snapshots: their nodes keep them until
        :meth:`release_adopted` (FLIP-306 take-over after failover)."""
        retain = getattr(self._transport, "retain", None)
        for seg in segments:
            if retain is not None and seg.path.startswith(SEGMENTS_DIR + "/"):
                retain(seg, self.log_id, self.incarnation)
                self._adopted.append(seg)

    def release_adopted(self, last_checkpoint: int) -> None:
        """The backend no longer names its restored segments; the newest checkpoint that
        did is ``last_checkpoint`` (-1: none)."""
        adopted, self._adopted = self._adopted, []
        for seg in adopted:
            try:
                self._transport.release(seg, self.log_id, last_checkpoint >= 0,
                                        last_checkpoint)
            except DstlError as e:
                log.warning("cannot release restored segment %s: %s", seg, e)

    def subsumed(self, watermark: int) -> None:
        """Every checkpoint of the job up to ``watermark`` is subsumed or declined; the
        next request tells the nodes (FLIP-306 4.4)."""
        self._subsumed = max(self._subsumed, watermark)

    def truncate(self, before: int) -> None:
        """Drop every changeset with sqn <= ``before`` (called once state up to ``before``
        is materialized). Uploads it no longer needs are released: the node deletes a file
        once every log in it released it unused; files given out in handles belong to the
        checkpoints (shared state registry) from then on."""
        self._check_open()
        if type(before) is not int or before < 0:
            raise SqnError(f"before must be a non-negative int sqn, got {before!r}")
        to_release: list[Upload] = []
        with self._lock:
            if before > self._sqn:
                raise SqnError(f"truncate(before={before}) is beyond the last appended sqn "
                               f"{self._sqn} of writer {self.log_id}")
            for s in [s for s in self._changesets if s <= before]:
                del self._changesets[s]
                del self._sizes[s]
                up = self._uploads.pop(s, None)
                if (up is not None and not up.released and up.segment is not None
                        and not any(x in self._changesets for x in up.sqns)):
                    up.released = True
                    to_release.append(up)
            self._truncated = max(self._truncated, before)
        for up in to_release:
            self._release(up)

    def _release(self, up: Upload) -> None:
        try:
            self._transport.release(up.segment, self.log_id, up.used, up.last_checkpoint)
        except DstlError as e:
            log.warning("cannot release unused upload %s: %s", up.segment, e)

    def close(self) -> None:
        """Close the log: no more appends; changes never persisted are dropped, and uploads
        never given out in a handle are discarded (FLIP-158 "Cleanup on shutdown"), by the
        time it returns (releases run in the transport's background: it waits for them)."""
        if self._closed:
            return
        with self._lock:
            self._closed = True
            ups = {id(u): u for u in self._uploads.values()}.values()
            to_release = [u for u in ups if u.segment is not None and not u.released]
            for u in to_release:
                u.released = True
            self._changesets.clear()
            self._sizes.clear()
            self._uploads.clear()
            self._open = []
        for up in to_release:
            self._release(up)
        flush = getattr(self._transport, "flush_releases", None)
        if to_release and flush is not None and not flush(60):
            log.warning("closing writer %s: releases still pending after 60 s (orphan cleanup "
                        "after recovery removes what is left)", self.log_id)
        try:
            self._transport.unregister(self.log_id)
        except DstlError as e:
            log.warning("cannot unregister writer %s: %s", self.log_id, e)

    # ------------------------------------------------------------------ introspection

    def wait_uploads(self, timeout: float | None = None) -> None:
        """Block until every upload started so far finished (truncated, pre-emptive too)."""
        concurrent.futures.wait(self._in_flight.futures(), timeout=timeout)

    @property
    def closed(self) -> bool:
        return self._closed

    def retained_sqns(self) -> list[int]:
        """Sqns of the changesets held in memory (closed ones only)."""
        with self._lock:
            return list(self._changesets)

    def retained_bytes(self) -> int:
        with self._lock:
            return sum(self._sizes.values()) + sum(len(v) + ENTRY_OVERHEAD for _, v in self._open)

    def __enter__(self) -> StateChangelogWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
