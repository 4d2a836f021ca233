"""The driver of ``experiments.multihost``: started by it inside the first host's network
namespace (a driver runs on a Ray node), it deploys the tree and runs two jobs until told to
stop, while the controller outside partitions and loses the other hosts.

* The main job is the chaos job (``experiments.chaos_job``): ``PAR`` subtasks counting keys,
  spread over every host, checkpointing round after round; a subtask lost with its host (or
  cut off past Ray's health check) fails the job over to its latest checkpoint, replayed on
  the hosts alive, and after every tenth checkpoint the live state and the latest checkpoint
  restored from storage are checked against the oracle (``Episode.verify``).
* The other job (``Bystander``) lives on this host only, which no fault touches: it must
  decline no checkpoint because of another host's partition.

Protocol: the driver prints ``READY`` once both jobs run; a ``STOP <json>`` line on stdin
(the faults' windows, seconds since the epoch) ends the run; the driver prints ``RESULT
<json>`` and exits.

Run by ``experiments.multihost`` only: ``python -m experiments.multihost_driver ADDRESS BASE
SEED``.
"""

from __future__ import annotations

import json
import sys
import threading
import time
from typing import Any

from .chaos_episode import Episode
from .chaos_job import PAR, Bystander, Placement, Subtask, final_files, kill_actors

NS = "multihost"
MAIN, OTHER = "multihost-job", "healthy-job"
VERIFY_EVERY = 10  # checkpoints
PROBE_S = 90.0  # longer than any partition: a subtask that does not answer by then is gone


class HostsHarness:
    """What ``Episode`` and ``Bystander`` need of a harness, on hosts: subtasks placed
    round-robin over the live Ray nodes by IP (the other job's on this host's node only)."""

    def __init__(self, base: str, seed: int, config: Any) -> None:
        import ray

        from dstl_ray import deploy

        self.base, self.seed, self.env = base, seed, {}
        self.tree = deploy(base, config, detached=False)
        self.actor = ray.remote(num_cpus=0, max_restarts=0, max_concurrency=2)(Subtask)
        here = ray.get_runtime_context().get_node_id()
        # (placed on a host that just went away: placed again, a probe's time later)
        self.every_host = Placement(self._hosts, attempts=5, timeout_s=PROBE_S, pause_s=2.0)
        self.here_only = Placement(lambda: [here], attempts=5, timeout_s=PROBE_S, pause_s=2.0)
        self.tree_wide: list[tuple[float, float]] = []  # set from the controller at the end

    def start(self, job: str, restore: str | None, incarnation: str = "",
              parallelism: int = PAR, foreign: bool = False) -> list[Any]:
        placement = self.here_only if job == OTHER else self.every_host
        return placement.start(self.actor, job, restore, NS, self.env, incarnation,
                               parallelism, foreign)

    @staticmethod
    def _hosts() -> list[str]:
        """The live Ray nodes, by IP."""
        import ray

        return [n["NodeID"] for n in sorted(ray.nodes(), key=lambda n: n["NodeManagerAddress"])
                if n["Alive"]]

    def kill(self, actors: list[Any]) -> None:
        kill_actors(actors)

    def debug(self, actors: list[Any], log: Any) -> None:
        """(The chaos harness logs node states here; between hosts a stall is expected.)"""

    def final_files(self, job: str) -> dict[str, int]:
        return final_files(self.base, job)


def alive(actors: list[Any]) -> bool:
    """Whether every subtask answers within :data:`PROBE_S`: one on a host cut off for a
    while is unavailable (Ray retries), one whose host is lost or declared dead is gone."""
    import ray
    from ray.exceptions import ActorUnavailableError

    deadline = time.monotonic() + PROBE_S
    while True:
        try:
            ray.get([a.rss_kb.remote() for a in actors],
                    timeout=max(1.0, deadline - time.monotonic()))
            return True
        except ActorUnavailableError:
            if time.monotonic() > deadline:
                return False
            time.sleep(1.0)
        except Exception:  # noqa: BLE001 - dead with its host, or cut off past the probe
            return False


def run(address: str, base: str, seed: int) -> dict[str, Any]:
    import ray

    from dstl_ray import ChangelogConfig

    ray.init(address=address, namespace=NS, log_to_driver=False)
    t0 = time.time()

    def log(msg: str) -> None:
        print(f"[driver {time.time() - t0:6.1f}s] {msg}", file=sys.stderr, flush=True)

    config = ChangelogConfig(namespace=NS, branching_factor=2, membership_interval_s=1.0)
    h = HostsHarness(base, seed, config)
    other = Bystander(h, OTHER, time.monotonic())
    ep = Episode(h, MAIN, log)
    stop: list[str] = []
    threading.Thread(target=lambda: stop.append(sys.stdin.readline()), daemon=True).start()
    print("READY", flush=True)
    rounds: list[dict[str, Any]] = []
    since_verify = 0
    while not stop:
        ep.rnd += 1
        at, ok = time.time(), False
        try:
            ep.apply_to(ep.rnd)
            at, c0 = time.time(), time.perf_counter()
            ok = ep.checkpoint(ep.rnd)
            rounds.append({"at": round(at, 3), "ok": ok,
                           "ms": round((time.perf_counter() - c0) * 1000, 2)})
        except Exception as e:  # noqa: BLE001 - a subtask gone with its host
            log(f"round {ep.rnd}: {type(e).__name__}: {str(e)[:160]}")
            rounds.append({"at": round(at, 3), "ok": False, "ms": None})
        if not ok and not alive(ep.actors):
            log(f"round {ep.rnd}: a subtask is gone: failing over")
            ep.failover(new_coordinator=False)
            ep.caught_up()
            continue
        since_verify += ok
        if since_verify >= VERIFY_EVERY:
            since_verify = 0
            try:
                ep.verify(f"round {ep.rnd}")
            except Exception as e:  # noqa: BLE001 - a subtask gone meanwhile: next round
                log(f"verify at round {ep.rnd}: {type(e).__name__}: {str(e)[:160]}")
        time.sleep(0.2)
    faults = json.loads(stop[0].split(" ", 1)[1])
    h.tree_wide = [(f["start"], f["end"]) for f in faults]
    for _attempt in range(5):  # the last fault may still be healing
        if alive(ep.actors):
            break
        ep.failover(new_coordinator=False)
    ep.verify("end")
    ep.stop()
    res = dict(ep.res)
    res["faults_by_kind"] = dict(res["faults_by_kind"])
    res.update(other.stop(log))
    res["other_job_decline_times"] = [[a, b] for a, b, _t in other.declines]
    res.update(final_files(base, MAIN))
    res["rounds"] = rounds
    h.tree.shutdown()
    return res


def main() -> None:
    address, base, seed = sys.argv[1], sys.argv[2], int(sys.argv[3])
    print("RESULT " + json.dumps(run(address, base, seed)), flush=True)


if __name__ == "__main__":
    main()
