"""A declined checkpoint's late snapshot: its changelog upload lands after the checkpoint was
declined and after a materialization truncated the changes it holds. Nothing will ever name
that file again, so once the job shuts down storage must hold exactly what the retained
checkpoints reference (it used to stay until the next recovery's orphan cleanup); and a file
a later checkpoint names too must survive."""

from __future__ import annotations

import concurrent.futures
import threading
import uuid

import pytest

import dstl_ray as d
from dstl_ray.storage.deleter import flush_deletes

from ..ckpt_util import MAXP, client, dump_all, files, new_base, owner, referenced


class HeldTransport(d.DirectTransport):
    """Writes the persist requests of checkpoint ``hold`` only once ``gate`` is set (a slow
    upload); every other request is written at once."""

    def __init__(self, job_id: str, base_path: str, hold: int) -> None:
        super().__init__(job_id, base_path)
        self.hold = hold
        self.gate = threading.Event()
        self.held: list[concurrent.futures.Future] = []

    def send(self, request):
        if request.checkpoint_id != self.hold:
            return super().send(request)
        out: concurrent.futures.Future = concurrent.futures.Future()

        def later() -> None:
            self.gate.wait(30)
            try:
                out.set_result(d.DirectTransport.send(self, request).result(30))
            except BaseException as e:  # noqa: BLE001 - the writer learns it
                out.set_exception(e)

        threading.Thread(target=later, daemon=True).start()
        self.held.append(out)
        return out


def _job(base: str, hold: int = 1):
    coord = d.CheckpointCoordinator("job", base, max_parallelism=MAXP, retained=1)
    transport = HeldTransport("job", base, hold)
    (b,) = coord.restore(client("job", base, transport), "op", 1,
                         materialization_interval=None)
    return coord, b, transport


def _decline(pc: d.PendingCheckpoint) -> None:
    pc.abort.set_result(d.CheckpointDeclinedError("declined by the test"))
    with pytest.raises(d.CheckpointDeclinedError):
        pc.result()


def _late_files(pc: d.PendingCheckpoint) -> set[str]:
    """The changelog files the (late) snapshot of ``pc`` names."""
    (snap,) = [f.result(30) for f in pc.snapshots]
    return {u for c in snap.components if isinstance(c, d.ChangelogComponent)
            for u in c.handle.file_paths()}


def _recovered_state(base: str) -> dict:
    coord = d.CheckpointCoordinator("job", base, max_parallelism=MAXP, retained=1)
    bs = coord.restore(client("job", base), "op", 1, materialization_interval=None)
    try:
        assert files(base) == referenced(coord)
        return dump_all(bs)
    finally:
        coord.shutdown()


def test_late_upload_after_truncation_is_deleted():
    """Declined, then materialized (truncating its changes), then its upload lands: the
    file goes at once, and shutdown leaves exactly the retained checkpoint's files."""
    base = new_base()
    coord, b, transport = _job(base)
    b.value_state("v").update("k", 1)
    pc1 = coord.trigger_checkpoint()
    _decline(pc1)
    b.materialize().result(30)  # truncates sqn 1 while its upload is still held
    transport.gate.set()
    late = _late_files(pc1)  # written: the snapshot resolved after its write
    assert late and not late & files(base), "the late changelog file is unreferenced"
    assert late <= set(coord.registry.deleted)  # the registry deleted it, nobody else
    coord.trigger_checkpoint().result()
    coord.shutdown()
    assert files(base) == referenced(coord)
    assert _recovered_state(base) == {"v": {"k": 1}, "l": {}, "m": {}}


def test_late_upload_during_shutdown_is_deleted():
    """The declined checkpoint's upload is still held when the job shuts down: closing the
    backend waits for it (it was truncated, so no upload list named it any more) and the
    file goes before shutdown returns."""
    base = new_base()
    coord, b, transport = _job(base)
    b.value_state("v").update("k", 1)
    pc1 = coord.trigger_checkpoint()
    _decline(pc1)
    b.materialize().result(30)
    coord.trigger_checkpoint().result()
    timer = threading.Timer(0.3, transport.gate.set)
    timer.start()
    coord.shutdown()
    timer.join()
    late = _late_files(pc1)  # resolved during shutdown
    assert all(f.done() for f in transport.held)
    assert flush_deletes(30)
    assert late and not late & files(base)
    assert late <= set(coord.registry.deleted)
    assert files(base) == referenced(coord)


def test_late_upload_a_later_checkpoint_names_is_kept():
    """Checkpoint 2 reuses the held upload of declined checkpoint 1 (the same changes), and
    a materialization truncates them before it lands: the file is unreferenced when the
    late snapshot of 1 comes in, but checkpoint 2 is pending and names it, so it stays and
    checkpoint 2 restores from it."""
    base = new_base()
    coord, b, transport = _job(base)
    b.value_state("v").update("k", 1)
    pc1 = coord.trigger_checkpoint()
    pc2 = coord.trigger_checkpoint()  # nothing new to send: its handle is the held upload
    _decline(pc1)
    b.materialize().result(30)
    b.value_state("v").update("k", 2)  # after the materialization: not in checkpoint 2
    transport.gate.set()
    late = _late_files(pc1)
    cc2 = pc2.result()
    assert late <= set(cc2.files.values()) and late <= files(base)
    coord.shutdown()
    assert files(base) == referenced(coord)
    assert late <= referenced(coord)
    assert _recovered_state(base) == {"v": {"k": 1}, "l": {}, "m": {}}


class NodeLikeTransport(d.DirectTransport):
    """Writes the requests sent while ``hold`` is set into ONE file on :meth:`flush`, as a
    node actor batches many logs' sections (and two of one log) into a file."""

    def __init__(self, job_id: str, base_path: str) -> None:
        super().__init__(job_id, base_path)
        self.hold = False
        self.held: list[tuple] = []

    def send(self, request):
        if not self.hold:
            return super().send(request)
        out: concurrent.futures.Future = concurrent.futures.Future()
        self.held.append((request, out))
        return out

    def flush(self) -> str:
        from dstl_ray.format.changelog import FILE_SUFFIX, assemble_file
        from dstl_ray.format.segment import Segment
        from dstl_ray.storage.base import join

        held, self.held = self.held, []
        data, offsets = assemble_file([r.section for r, _ in held])
        rel = f"dstl/node-x/{uuid.uuid4().hex}{FILE_SUFFIX}"
        self.uploader.write(join(self.job_path, rel), data)
        self.files.track(rel, [(r.log_id, o) for (r, _), o in zip(held, offsets, strict=True)])
        for (r, fut), o in zip(held, offsets, strict=True):
            s = r.section
            fut.set_result(Segment(rel, o, len(s.data), s.sqn_min, s.sqn_max, "node-x"))
        return rel


@pytest.mark.parametrize("backends", [1, 2])
def test_a_late_snapshots_node_file_holding_other_sections_is_kept(backends):
    """A node's file holds the late (truncated) section and one nobody named yet: the same
    backend's pre-emptive upload, or another backend's checkpoint section. The next
    checkpoint names it, and it must restore."""
    base = new_base()
    coord = d.CheckpointCoordinator("job", base, max_parallelism=MAXP, retained=1)
    t = NodeLikeTransport("job", base)
    bs = coord.restore(client("job", base, t), "op", backends, materialization_interval=None)
    a, b = bs[0], bs[-1]
    ka = next(f"k{i}" for i in range(64) if owner(bs, f"k{i}") is a)
    kb = next(f"k{i}" for i in range(64) if owner(bs, f"k{i}") is b and f"k{i}" != ka)
    t.hold = True
    a.value_state("v").update(ka, 1)
    if backends == 2:
        b.value_state("v").update(kb, 10)
    pc = coord.trigger_checkpoint()
    pc.abort.set_result(d.CheckpointDeclinedError("declined (test)"))
    with pytest.raises(d.CheckpointDeclinedError):
        pc.result()
    a.materialize().result(30)  # a's section of checkpoint 1 truncated while in flight
    if backends == 1:
        a.value_state("v").update(ka, 2)
        a.writer._preemptive_persist()  # into the same node file
    t.flush()
    t.hold = False
    flush_deletes(10)
    coord.trigger_checkpoint().result(timeout=30)
    want = dump_all(bs)
    coord.shutdown()
    coord = d.CheckpointCoordinator("job", base, max_parallelism=MAXP, retained=1)
    bs = coord.restore(client("job", base), "op", backends, materialization_interval=None)
    assert dump_all(bs) == want
    coord.shutdown()
