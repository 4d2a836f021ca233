"""The job -> Ray namespace rule of node actors (dstl_ray.node.namespaces), as pure logic."""

import pytest

from dstl_ray import NamespaceError
from dstl_ray.node.namespaces import JobNamespaces
from dstl_ray.transport.sender import Caller


def test_first_caller_binds_the_job_and_others_are_refused():
    alive: set[str] = {"01", "02"}
    ns = JobNamespaces(all_dead=lambda jobs: not (set(jobs) & alive))
    ns.admit("orders", Caller("team-a", "01"))
    ns.admit("orders", Caller("team-a", "03"))  # another process of the same namespace
    with pytest.raises(NamespaceError, match="'orders' belongs to Ray namespace 'team-a'.*"
                                             "'team-b'"):
        ns.admit("orders", Caller("team-b", "02"))
    ns.admit("billing", Caller("team-b", "02"))  # other jobs are free
    assert ns.namespace_of("orders") == "team-a" and ns.refused == 1


def test_a_job_moves_only_once_every_ray_job_of_its_namespace_ended():
    alive = {"01", "03"}
    ns = JobNamespaces(all_dead=lambda jobs: not (set(jobs) & alive))
    ns.admit("orders", Caller("team-a", "01"))
    ns.admit("orders", Caller("team-a", "03"))
    alive.discard("01")
    with pytest.raises(NamespaceError):  # 03 still runs in team-a
        ns.admit("orders", Caller("restarted", "04"))
    alive.discard("03")
    ns.admit("orders", Caller("restarted", "04"))  # the crashed driver's successor
    assert ns.namespace_of("orders") == "restarted" and ns.taken_over == 1


@pytest.mark.parametrize("caller", [None, "team-a", ("team-a", "01"), Caller(7, "01")])
def test_requests_without_a_caller_are_refused(caller):
    ns = JobNamespaces(all_dead=lambda jobs: True)
    with pytest.raises(NamespaceError, match="names no caller namespace"):
        ns.admit("orders", caller)


def test_a_binding_without_known_ray_jobs_is_never_taken_over():
    ns = JobNamespaces(all_dead=lambda jobs: True)
    ns.admit("orders", Caller("team-a", ""))
    with pytest.raises(NamespaceError):
        ns.admit("orders", Caller("team-b", "09"))
