"""FLIP-158 batch triggers of a node (dstl_ray.node.batching) on a manual clock, without Ray
or an event loop: the persist delay (and its height factor), every source pending, the size
threshold, late sources of the previous checkpoint (never one queued behind its own
process's request), the first checkpoint's wait for the sources registered for its job (and
its hold while sources still register), marks, the persist_max_wait_s cap and idle sources."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from dstl_ray import ChangelogConfig
from dstl_ray.format.changelog import EncodedSection
from dstl_ray.node.batching import BatchScheduler, Pending
from dstl_ray.node.peers import Peers, Place
from dstl_ray.node.sources import Sources
from dstl_ray.node.stats import NodeCounters
from dstl_ray.transport.base import PersistRequest

DELAY = 0.010
MAX_WAIT = 0.5


class _Timer:
    def __init__(self, when: float, fn: Callable[[], None]) -> None:
        self.when, self.fn, self.cancelled = when, fn, False

    def cancel(self) -> None:
        self.cancelled = True


class ManualClock:
    """Time moves only when the test says; due timers fire in order as it does."""

    def __init__(self) -> None:
        self.t = 100.0
        self.timers: list[_Timer] = []

    def now(self) -> float:
        return self.t

    def call_later(self, delay: float, fn: Callable[[], None]) -> _Timer:
        timer = _Timer(self.t + delay, fn)
        self.timers.append(timer)
        return timer

    def advance(self, dt: float) -> None:
        end = self.t + dt
        while True:
            due = [x for x in self.timers if not x.cancelled and x.when <= end + 1e-12]
            if not due:
                break
            timer = min(due, key=lambda x: x.when)
            self.timers.remove(timer)
            self.t = max(self.t, timer.when)
            timer.fn()
        self.t = end

    def armed(self) -> int:
        return sum(not x.cancelled for x in self.timers)


class Node:
    """A scheduler with real sources, a manual clock and a list of the batches sent."""

    def __init__(self, height: int = 0, **config: object) -> None:
        cfg = dict(persist_delay_s=DELAY, persist_max_wait_s=MAX_WAIT, source_idle_s=0.0)
        cfg.update(config)
        self.config = ChangelogConfig(**cfg)
        self.clock = ManualClock()
        self.counters = NodeCounters()
        place = Place("node", height=height)
        self.sources = Sources(place, Peers("ns"), self.counters, upstream=lambda: None)
        self.sent: list[list[Pending]] = []
        self.changed = 0
        self.s = BatchScheduler(self.config, place, self.sources, self.counters, self.clock,
                                send=self.sent.append, sources_changed=self._changed)

    def _changed(self) -> None:
        self.changed += 1

    def writer(self, log: str, job: str = "J") -> None:
        self.sources.add_writer(log, job, self.clock.now())

    def child(self, name: str, jobs: list[str]) -> None:
        self.sources.add_child(name, jobs, self.clock.now())

    def send(self, source: str, checkpoint_id: int = -1, size: int = 10,
             job: str = "J", process: str = "") -> Pending:
        section = EncodedSection(log_id=source.encode().ljust(16, b"_"), data=b"x" * size,
                                 index=(), sqn_min=0, sqn_max=0, flags=0)
        r = PersistRequest(job_id=job, section=section, source=source,
                           checkpoint_id=checkpoint_id, process=process)
        item = Pending([r], None, source, size, arrived=self.clock.now())
        self.s.add(item)
        return item

    def settle(self) -> None:
        """Time passes after the registrations: a job's first checkpoint is not held for
        sources that may still register (``BatchScheduler.hold_left``)."""
        self.clock.advance(MAX_WAIT)

    def batches(self) -> list[list[str]]:
        """The sources of each batch sent, in order."""
        return [[p.source for p in b] for b in self.sent]


def test_a_batch_goes_out_persist_delay_after_its_first_request():
    n = Node()
    n.writer("a")
    n.writer("b")
    n.send("a")
    n.clock.advance(DELAY / 2)
    n.send("a")  # a second request does not restart the delay
    n.clock.advance(DELAY / 2 - 1e-6)
    assert n.sent == []
    n.clock.advance(2e-6)
    assert n.batches() == [["a", "a"]] and n.counters.sent_delay == 1
    assert n.s.pending == [] and n.s.pending_bytes == 0 and n.clock.armed() == 0


@pytest.mark.parametrize("height", [0, 1, 3])
def test_the_delay_grows_with_the_levels_below(height):
    """A child's batch cannot arrive before the child's own delay: a node waits once per
    level below it."""
    n = Node(height=height)
    n.writer("a")
    n.writer("b")
    n.send("a")
    n.clock.advance(DELAY * (1 + height) - 1e-6)
    assert n.sent == []
    n.clock.advance(2e-6)
    assert n.batches() == [["a"]] and n.counters.sent_delay == 1


def test_every_source_pending_sends_at_once():
    n = Node()
    n.writer("a")
    n.child("c", ["J"])
    n.send("a")
    assert n.sent == []
    n.send("c")
    assert n.batches() == [["a", "c"]] and n.counters.sent_all_pending == 1
    assert n.clock.armed() == 0, "the delay timer is cancelled"
    n.clock.advance(10 * DELAY)
    assert len(n.sent) == 1 and n.counters.sent_delay == 0


def test_the_size_threshold_sends_at_once():
    n = Node(persist_size_threshold=100)
    n.writer("a")
    n.writer("b")
    n.send("a", size=60)
    assert n.sent == []
    n.send("a", size=40)
    assert n.batches() == [["a", "a"]] and n.counters.sent_size == 1
    assert n.s.pending_bytes == 0


def _checkpoint_one_sent(n: Node) -> None:
    """Writers a and b of J took part in checkpoint 1; c, of another job, never sends."""
    for log in ("a", "b"):
        n.writer(log)
    n.writer("c", job="other")
    n.settle()
    n.send("a", 1)
    n.send("b", 1)
    assert n.sent == []  # c is not pending
    n.clock.advance(DELAY)
    assert n.batches() == [["a", "b"]] and n.counters.sent_delay == 1


def test_a_late_source_of_the_previous_checkpoint_is_waited_for():
    n = Node()
    _checkpoint_one_sent(n)
    n.send("a", 2)
    n.clock.advance(DELAY)
    assert len(n.sent) == 1, "b sent checkpoint 1 and not yet 2: wait for it"
    assert n.s.late_sources() == {"b"} and n.counters.waits_for_late == 1
    n.clock.advance(DELAY)
    n.send("b", 2)
    assert n.batches()[1] == ["a", "b"] and n.counters.sent_late_arrived == 1
    assert n.clock.armed() == 0


def test_the_wait_for_late_sources_ends_at_persist_max_wait():
    n = Node()
    _checkpoint_one_sent(n)
    first = n.clock.now()
    n.send("a", 2)
    n.clock.advance(MAX_WAIT - 1e-3)
    assert len(n.sent) == 1 and n.counters.waits_for_late == 1
    n.clock.advance(2e-3)
    assert n.batches()[1] == ["a"] and n.counters.sent_delay == 2
    assert n.clock.now() - first >= MAX_WAIT


def test_no_wait_past_the_delay_when_max_wait_is_zero():
    n = Node(persist_max_wait_s=0.0)
    _checkpoint_one_sent(n)
    n.send("a", 2)
    n.clock.advance(DELAY)
    assert n.batches()[1] == ["a"] and n.counters.waits_for_late == 0


def test_the_first_checkpoint_waits_for_the_sources_registered_for_its_job():
    """Before a job's first checkpoint here, the batch waits for the writers and children
    registered for that job (not for sources of other jobs); marks release the wait."""
    n = Node()
    n.writer("a")
    n.writer("x")
    n.writer("o", job="other")
    n.child("child", ["J"])
    n.child("child2", ["other"])
    n.settle()
    n.send("a", 0)
    n.clock.advance(DELAY)
    assert n.sent == [] and n.s.late_sources() == {"x", "child"}
    n.s.mark("J", "child", 0)
    assert n.sent == [] and n.s.late_sources() == {"x"}
    n.s.mark("J", "x", 0)  # x has nothing for checkpoint 0
    assert n.batches() == [["a"]] and n.counters.sent_late_arrived == 1


def test_only_the_first_checkpoint_waits_for_a_silent_registered_source():
    """A registered source that never sends costs one wait (up to persist_max_wait_s), not
    one per checkpoint."""
    n = Node()
    n.writer("a")
    n.writer("x")  # registers for J and never sends
    n.send("a", 0)
    n.clock.advance(MAX_WAIT - 1e-3)
    assert n.sent == []
    n.clock.advance(2e-3)
    assert n.batches() == [["a"]] and n.counters.sent_delay == 1
    n.send("a", 1)
    n.clock.advance(DELAY)
    assert n.batches()[1] == ["a"] and n.counters.waits_for_late == 1


def test_a_mark_completes_every_source_pending():
    """A source that marked the pending checkpoint (nothing to send) counts as pending."""
    n = Node()
    n.writer("a")
    n.writer("b")
    n.settle()
    n.send("a", 3)
    n.s.mark("J", "b", 2)  # an older checkpoint: still waited for
    assert n.sent == []
    n.s.mark("J", "b", 3)
    assert n.batches() == [["a"]] and n.counters.sent_all_pending == 1


def test_a_mark_goes_upstream_once_when_nothing_of_its_checkpoint_is_here():
    n = Node()
    n.writer("a")
    n.writer("b")
    n.s.mark("J", "a", 4)
    assert not n.s.pass_mark_up("J", 4), "b (registered for J) is late for checkpoint 4"
    n.s.mark("J", "b", 4)
    assert n.s.pass_mark_up("J", 4)
    assert not n.s.pass_mark_up("J", 4), "once per checkpoint"
    n.send("a", 5)
    assert not n.s.pass_mark_up("J", 5), "a request of checkpoint 5 goes up itself"


def test_idle_sources_are_dropped_when_a_batch_waited_for_the_delay():
    n = Node(source_idle_s=1.0)
    n.writer("a")
    n.writer("gone")  # a killed process: never sends, never unregisters
    n.clock.advance(0.9)
    n.writer("late")  # registered recently: not idle
    n.clock.advance(0.2)
    n.send("a")
    n.clock.advance(DELAY)
    assert n.batches() == [["a"]] and n.counters.sent_delay == 1
    assert n.counters.idle_sources_dropped == 1 and n.changed == 1
    assert n.sources.all() == {"a", "late"}
    n.send("a")
    n.send("late")
    assert n.batches()[1] == ["a", "late"] and n.counters.sent_all_pending == 1


def test_idle_means_at_least_four_delays():
    """A live source merely late by a few batching delays is still waited for."""
    n = Node(source_idle_s=0.001, persist_delay_s=0.1, persist_max_wait_s=0.0)
    n.writer("a")
    n.writer("b")
    n.clock.advance(0.3)  # < 4 delays of silence
    n.send("a")
    n.clock.advance(0.1)
    assert n.counters.idle_sources_dropped == 0 and "b" in n.sources.all()
    n.clock.advance(0.2)
    n.send("a")
    n.clock.advance(0.1)
    assert n.counters.idle_sources_dropped == 1 and n.sources.all() == {"a"}


def test_a_pending_source_is_never_dropped():
    n = Node(source_idle_s=1.0)
    n.writer("a")
    n.writer("b")
    n.clock.advance(5.0)
    n.send("a")
    n.clock.advance(DELAY)
    assert n.sources.all() == {"a"}, "a was pending, b idle"


def test_no_idle_drop_when_source_idle_s_is_zero():
    n = Node(source_idle_s=0.0)
    n.writer("a")
    n.writer("b")
    n.clock.advance(3600.0)
    n.send("a")
    n.clock.advance(DELAY)
    assert n.sources.all() == {"a", "b"} and n.counters.idle_sources_dropped == 0


def _one_process_in_turn(n: Node) -> None:
    """Writers a and b live in process P and persist one after the other; w in process Q."""
    for log in ("a", "b", "w"):
        n.writer(log)
    n.settle()
    n.s.answered(n.send("a", 1, process="P"))
    n.s.answered(n.send("b", 1, process="P"))
    n.s.answered(n.send("w", 1, process="Q"))
    assert n.batches() == [["a", "b", "w"]] and n.counters.sent_all_pending == 1


def test_a_writer_queued_behind_its_own_process_request_is_not_waited_for():
    """Issue 28 item 6: b (process P) sent checkpoint 1 and not yet 2, but P waits for the
    answer to a's request before b persists, so b cannot come before this batch is sent.
    The batch goes after the delay, not persist_max_wait_s later (on the old code it waited
    the full 0.5 s for b: waits_for_late 1, sent at +MAX_WAIT)."""
    n = Node()
    _one_process_in_turn(n)
    start = n.clock.now()
    a2 = n.send("a", 2, process="P")
    w2 = n.send("w", 2, process="Q")
    assert n.s.late_sources() == set()
    n.clock.advance(DELAY)
    assert n.batches()[1] == ["a", "w"] and n.counters.sent_delay == 1
    assert n.counters.waits_for_late == 0 and n.clock.now() - start < MAX_WAIT / 10
    n.s.answered(a2)
    n.s.answered(w2)
    n.send("b", 2, process="P")  # now b persists: everyone else sent 2 already
    assert n.batches()[2] == ["b"] and n.counters.sent_all_pending == 2
    assert n.s.unanswered == {"P": 1}


def test_a_late_writer_of_another_process_is_still_waited_for():
    n = Node()
    _one_process_in_turn(n)
    n.send("a", 2, process="P")
    n.send("b", 2, process="P")
    n.clock.advance(DELAY)
    assert len(n.sent) == 1 and n.s.late_sources() == {"w"} and n.counters.waits_for_late == 1
    n.send("w", 2, process="Q")
    assert n.batches()[1] == ["a", "b", "w"] and n.counters.sent_all_pending == 2


def test_writers_of_one_process_persisting_at_once_share_one_batch():
    """Two calls of one process (its transport ships what queued while the previous call
    was submitted) within the delay: one batch, as before."""
    n = Node()
    _one_process_in_turn(n)
    n.send("w", 2, process="Q")
    n.send("a", 2, process="P")
    n.clock.advance(DELAY / 2)
    n.send("b", 2, process="P")
    assert n.batches()[1] == ["w", "a", "b"] and n.counters.sent_all_pending == 2


def test_a_late_writer_of_a_process_persisting_at_once_is_still_waited_for():
    """A process whose writers persisted checkpoint 1 at once (b arrived while a was
    unanswered) is not one that waits for each answer: when b is late for checkpoint 2,
    its request is on its way, and the batch waits for it (one file)."""
    n = Node()
    for log in ("a", "b"):
        n.writer(log)
    n.settle()
    a1, b1 = n.send("a", 1, process="P"), n.send("b", 1, process="P")
    n.s.answered(a1)
    n.s.answered(b1)
    n.send("a", 2, process="P")
    n.clock.advance(DELAY)
    assert len(n.sent) == 1 and n.s.late_sources() == {"b"} and n.counters.waits_for_late == 1
    n.clock.advance(0.1)
    n.send("b", 2, process="P")
    assert n.batches()[1] == ["a", "b"]


def test_a_process_is_judged_by_what_it_did_last():
    """In turn (b's request came after the answer to a's), then at once, then in turn."""
    n = Node()
    _one_process_in_turn(n)
    assert n.s.in_turn == {"P"}
    a2, b2 = n.send("a", 2, process="P"), n.send("b", 2, process="P")
    assert n.s.in_turn == set()
    n.s.answered(a2)
    n.s.answered(b2)
    n.s.answered(n.send("a", 3, process="P"))
    n.send("b", 3, process="P")
    assert n.s.in_turn == {"P"}


def test_a_request_sent_on_and_not_answered_still_blocks_its_process():
    """a's request went on to the parent, which has not answered yet: b, of the same
    process, cannot come before that answer, so this node's next batch does not wait for
    b either; once the answer is in, b is waited for again."""
    n = Node()
    _one_process_in_turn(n)
    a2 = n.send("a", 2, process="P")
    n.s.answered(n.send("w", 2, process="Q"))
    n.clock.advance(DELAY)
    assert n.batches()[1] == ["a", "w"]  # sent on, a's not answered yet
    n.send("w", 3, process="Q")
    n.clock.advance(DELAY)
    assert n.batches()[2] == ["w"] and n.counters.waits_for_late == 0
    n.s.answered(a2)
    n.send("w", 4, process="Q")
    n.clock.advance(DELAY)
    assert len(n.sent) == 3 and n.s.late_sources() == {"a"}, "P may send again: a is late"
    assert n.counters.waits_for_late == 1


def test_the_first_checkpoint_is_held_while_sources_of_its_job_register():
    """Issue 28 item 8: writers that start with the job register while its first requests
    are on their way. The root's own writer sent at once; a child registered for the job
    50 ms later. On the old code the root sent its lone writer's request at once (every
    source it knew of was pending) and the child's forward became a second file."""
    n = Node(height=2)
    n.writer("a")
    n.send("a", 0)
    assert n.sent == [], "held: sources of the job may still register"
    n.clock.advance(0.05)
    n.child("child", ["J"])
    n.clock.advance(MAX_WAIT / 4)  # quiet since the child registered: the child is late
    assert n.sent == [] and n.s.late_sources() == {"child"}
    n.clock.advance(0.05)
    n.send("child", 0)
    assert n.batches() == [["a", "child"]]


def test_the_first_checkpoint_hold_ends_once_registrations_are_quiet():
    n = Node()
    n.writer("a")
    n.send("a", 0)
    n.clock.advance(MAX_WAIT / 4 - 1e-6)
    assert n.sent == []
    n.clock.advance(2e-6)
    assert n.batches() == [["a"]] and n.counters.waits_for_late == 0
    n.send("a", 1)  # no longer the first checkpoint: every source pending, at once
    assert n.batches()[1] == ["a"] and n.counters.sent_all_pending == 1


def test_the_hold_never_passes_persist_max_wait():
    n = Node()
    n.writer("a")
    first = n.clock.now()
    n.send("a", 0)
    for i in range(20):  # sources keep registering
        n.clock.advance(MAX_WAIT / 8)
        n.writer(f"x{i}", job="J")
        if n.sent:
            break
    assert n.batches() == [["a"]] and n.clock.now() - first <= MAX_WAIT + 1e-9


def test_a_hold_shorter_than_the_delay_ends_with_every_source_pending():
    """With a long delay, the first checkpoint goes when its hold ends (every source
    pending), not when the delay does."""
    n = Node(persist_delay_s=5.0)
    n.writer("a")
    n.writer("b")
    n.send("a", 0)
    n.send("b", 0)
    assert n.sent == []
    n.clock.advance(MAX_WAIT / 4)
    assert n.batches() == [["a", "b"]] and n.counters.sent_all_pending == 1
    n.send("a", 1)
    n.clock.advance(MAX_WAIT)
    assert len(n.sent) == 1, "not held: the delay runs"
    n.clock.advance(5.0)
    assert n.batches()[1] == ["a"] and n.counters.sent_delay == 1
