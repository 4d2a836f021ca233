"""Chaos for the Spark pipeline (issue "Reliability", part 2): the main job's stateful stream on
RayDP over a 3-node Ray cluster, with seeded random faults and a plain batch recomputation of
all input so far as the oracle after every round.

Each round adds input files and runs the stream until it has processed them, injecting faults
picked by a seeded RNG at random moments:

* ``executor_kill``: a RayDP executor actor is killed (Spark loses its tasks, blocks, workers);
* ``node_actor_kill``: a changelog node actor is killed mid-stream (Ray restarts it);
* ``task_failure``: the update function fails the first attempt of the tasks holding a victim
  key, after other keys of the task were applied;
* ``driver_restart``: the driver dies right after a checkpoint completed and before Spark's
  commit log (the sink raises); a new operator and query resume from the same checkpoint
  location, and Spark replays the batch.

The last ``--big-rounds`` rounds are each one micro-batch of ``--big-keys`` distinct keys
(1,000,000 by default: each subtask's persist request is tens of MB, far above Ray's inline
limit, fetched from the Spark Python worker that sent it), with an executor kill, a node-actor
kill and a task failure in turn (and sometimes a second fault) injected while it runs.

After each round: the state of the latest checkpoint, restored from storage, must equal the
recomputation (changes lost = keys whose count or sum differ). At the end a new operator
start runs orphan cleanup, and storage must hold exactly the retained checkpoints' files.

With ``--file-merging across_checkpoints`` the nodes append every flush to merged files, and
``--dead-writer-check S`` makes them release, every S seconds, the sections of writers whose
process died (a killed executor's Python workers): the results then count the merged files
still on storage that no retained checkpoint names, before the final cleanup
(``segment_files_unnamed``), and what the nodes released (``dead_writers``).

With ``--hosts N`` (as root) the cluster is N hosts, network namespaces with IPs of their own
(``dstl_ray.local.hosts``), a Ray node and a RayDP executor on each, the driver in the first:
Spark's driver reaches its executors, and the tree its nodes, between hosts, and every round
also cuts a host with an executor off from the driver for 5-9 s (``host_partition``: its
link down, healed while the round runs). Results: ``chaos_spark_hosts``.

Run: python -m experiments.chaos_spark [--quick] [--seed N] [--big-keys N] [--big-rounds N]
[--file-merging none|across_checkpoints] [--dead-writer-check S] [--hosts N]
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from .common import machine, parser, plt, write_results

NS = "chaos-spark"
KINDS = ("executor_kill", "node_actor_kill", "task_failure", "driver_restart")
PARTITION_S = (5.0, 9.0)
FLAG = {"dir": ""}


def chaotic_update(key: Any, rows: list[Any], state: Any) -> list[Any]:
    """The main job's update, failing a task's first attempt while a flag file names a key."""
    from pyspark import TaskContext

    from spark_glue.pipeline import count_and_sum

    flag = os.path.join(FLAG["dir"], "fail-key")
    if os.path.exists(flag) and TaskContext.get().attemptNumber() == 0:
        with open(flag) as f:
            if f.read().strip() == key:
                raise RuntimeError(f"chaos: task failure on key {key}")
    return count_and_sum(key, rows, state)


class _DriverDies(Exception):
    pass


def partition_a_host(links: Any, rng: random.Random, log: list[dict[str, Any]]
                     ) -> threading.Thread:
    """Cut a host other than the driver's off for 5-9 s, in the background (healed in any
    case): the driver loses the executor there, and the tree the node there."""
    victim = rng.choice(links.hosts[1:])
    seconds = rng.uniform(*PARTITION_S)

    def cut() -> None:
        links.partition(victim)
        try:
            time.sleep(seconds)
        finally:
            links.heal(victim)

    log.append({"host": victim.ip, "seconds": round(seconds, 1)})
    t = threading.Thread(target=cut, name=f"partition-{victim.ip}")
    t.start()
    return t


def main() -> None:
    p = parser(__doc__)
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--rounds", type=int, default=0)
    p.add_argument("--big-keys", type=int, default=-1,
                   help="distinct keys of a big round's one micro-batch (0: no big rounds)")
    p.add_argument("--big-rounds", type=int, default=1)
    p.add_argument("--file-merging", default="none",
                   choices=("none", "within_checkpoint", "across_checkpoints"))
    p.add_argument("--dead-writer-check", type=float, default=0.0,
                   help="seconds between the nodes' checks for dead writers (0: off)")
    p.add_argument("--state-backend", default="heap", choices=("heap", "rocksdb"),
                   help="the subtasks' state table (rocksdb: results as chaos_spark_rocksdb)")
    p.add_argument("--hosts", type=int, default=0,
                   help="run on N network-namespace hosts (root; results: chaos_spark_hosts)")
    p.add_argument("--ray-address", default="", help=argparse.SUPPRESS)  # a host's driver
    args = p.parse_args()
    if args.hosts and not args.ray_address:  # the cluster's owner; the driver runs inside
        from dstl_ray.local.hosts import rerun_on_hosts

        raise SystemExit(rerun_on_hosts(args.hosts, [sys.executable, "-m", __spec__.name]))
    rounds = args.rounds or (3 if args.quick else 12)
    big_keys = args.big_keys if args.big_keys >= 0 else (20_000 if args.quick else 1_000_000)

    import ray
    from pyspark import cloudpickle

    from dstl_ray import ChangelogConfig, deploy
    from dstl_ray.local.hosts import HostLinks
    from dstl_ray.storage.registry import get_storage
    from dstl_ray.testing import start_local_cluster
    from spark_glue import KeyedStatefulOperator, start_spark, stop_spark
    from spark_glue.pipeline import (
        SCHEMA,
        diff,
        recompute,
        write_distinct_key_file,
        write_event_file,
    )
    from spark_glue.session import executor_hosts, kill_executor

    cloudpickle.register_pickle_by_value(sys.modules[__name__])
    rng = random.Random(args.seed)
    work = Path(tempfile.mkdtemp(prefix="chaos-spark-"))
    FLAG["dir"] = str(work / "flags")
    os.makedirs(FLAG["dir"])
    src, chk, base = work / "input", work / "spark-chk", work / "dstl"
    links = HostLinks.from_env() if args.ray_address else None
    if args.ray_address:  # the driver of --hosts N
        ray.init(address=args.ray_address, namespace=NS, log_to_driver=False)
        cluster = None
    else:
        cluster = start_local_cluster(3, 1, NS)
    executors = len(links.hosts) if links else 3
    faults: dict[str, int] = dict.fromkeys(KINDS + ("host_partition",) * bool(links), 0)
    partitions: list[dict[str, Any]] = []
    seen_hosts: set[str] = set()  # where executors ran
    events: list[dict[str, Any]] = []
    lost = verified = leaked = 0
    checkpoints = recoveries = 0
    big: list[dict[str, Any]] = []
    big_rounds = args.big_rounds if big_keys > 0 else 0
    t_start = time.time()
    try:
        tree = deploy(f"file://{base}", ChangelogConfig(
            namespace=NS, persist_delay_s=0.2, file_merging=args.file_merging,
            dead_writer_check_s=args.dead_writer_check), detached=False)
        spark = start_spark("chaos-spark", num_executors=executors, executor_cores=1,
                            executor_memory="1G" if big_keys > 100_000 else "512M")
        state: dict[str, Any] = {"die_at": None, "max_keys": 0}

        def sink(batch_id: int, _out: list[Any]) -> None:
            state["max_keys"] = max(state["max_keys"], len(_out))  # one output per key
            if state["die_at"] is not None and batch_id >= state["die_at"]:
                state["die_at"] = None
                raise _DriverDies(f"chaos: driver dies after checkpoint {batch_id}")

        def new_op() -> Any:
            return KeyedStatefulOperator("chaos", key="user", update=chaotic_update,
                                         namespace=NS, parallelism=3, max_parallelism=64,
                                         materialization_interval=5.0, sink=sink,
                                         state_backend=args.state_backend,
                                         local_dir=str(work / "local"))

        op = new_op()
        n_files = 0
        for r in range(rounds + big_rounds):
            is_big = r >= rounds
            if is_big:  # ONE micro-batch of big_keys distinct keys, faults while it runs
                write_distinct_key_file(src, n_files, big_keys, seed=args.seed)
                n_files += 1
                first = KINDS[(r - rounds) % 3]
                kinds = [first] + rng.sample([k for k in KINDS[:3] if k != first],
                                             rng.randint(0, 1))
                t_big = time.time()
            else:
                for _ in range(4):
                    write_event_file(src, n_files, 400, 300, seed=args.seed)
                    n_files += 1
                kinds = rng.sample(KINDS, rng.randint(1, 3))
                if links:  # between hosts: a host cut off from the driver, every round
                    kinds.append("host_partition")  # injected first
            q = (spark.readStream.schema(SCHEMA).option("maxFilesPerTrigger", 1)
                 .json(str(src)).writeStream.foreachBatch(op)
                 .option("checkpointLocation", str(chk)).start())
            pending = list(kinds)
            seen_hosts.update(executor_hosts(spark))
            done_before = op.history.total
            cuts: list[threading.Thread] = []
            while pending:  # inject at random moments while the round runs
                time.sleep(rng.uniform(0.5, 3.0) * (1 + 4 * is_big * (big_keys > 100_000)))
                kind = pending.pop()
                if kind == "executor_kill":
                    kill_executor(rng.randrange(executors))
                elif kind == "host_partition":
                    cuts.append(partition_a_host(links, rng, partitions))
                elif kind == "node_actor_kill":
                    name = rng.choice([s["name"] for s in tree.status()])
                    ray.kill(ray.get_actor(name, namespace=NS), no_restart=False)
                elif kind == "task_failure":
                    victim = (f"k{rng.randrange(big_keys):07d}" if is_big
                              else f"u{rng.randrange(300)}")
                    Path(FLAG["dir"], "fail-key").write_text(victim)
                elif kind == "driver_restart":
                    state["die_at"] = len(op.history) and op.history[-1].batch_id + 1
                faults[kind] += 1
                events.append({"round": r, "kind": kind, "t": round(time.time() - t_start, 2)})
            deadline = time.time() + 300
            while True:  # run the round to the end, restarting the driver when it died
                try:
                    q.processAllAvailable()
                    q.stop()
                    break
                except Exception as e:  # noqa: BLE001 - the driver "died"
                    if "chaos: driver dies" not in str(e) or time.time() > deadline:
                        raise
                    q.stop()
                    checkpoints += op.history.total
                    op.coordinator.shutdown()
                    op = new_op()  # a new driver: new coordinator, new epoch
                    recoveries += 1
                    q = (spark.readStream.schema(SCHEMA).option("maxFilesPerTrigger", 1)
                         .json(str(src)).writeStream.foreachBatch(op)
                         .option("checkpointLocation", str(chk)).start())
            for cut in cuts:  # healed before the round's state is checked
                cut.join()
            Path(FLAG["dir"], "fail-key").unlink(missing_ok=True)
            if is_big:
                big.append({"keys": big_keys, "faults": kinds,
                            "duration_s": round(time.time() - t_big, 1)})
            recoveries += sum(1 for k in kinds if k not in ("driver_restart", "host_partition"))
            want = recompute(spark, src)
            problems = diff(op.state(), want, limit=10_000)
            lost += len(problems)
            verified += sum(want["count"].values())
            print(f"[chaos_spark] round {r}: faults {kinds}, batches "
                  f"{op.history.total - done_before}, state "
                  f"{'OK' if not problems else f'{len(problems)} DIFFERENCES'}", flush=True)
        checkpoints += op.history.total
        # merged files no retained checkpoint names, while the job still runs (a dead
        # writer's sections keep theirs until released)
        named = {u.split("#")[0] for c in op.coordinator.completed_checkpoints()
                 for u in c.files.values()}
        job = f"file://{base}/chaos"
        seg = [f for f in get_storage(job).list_files(job) if "/segments/" in f]
        unnamed = len([f for f in seg if f not in named])
        node_st = tree.status()
        dead_st = {k: sum(s.get(f"dead_writers_{k}", 0) for s in node_st)
                   for k in ("released", "kept")}
        op.close()
        # a new start runs orphan cleanup; storage must hold exactly the retained files
        op = new_op()
        keep = {u for c in op.coordinator.completed_checkpoints() for u in c.files.values()}
        keep |= {c.metadata_url for c in op.coordinator.completed_checkpoints()}
        keep.add(op.coordinator.lease.url)  # the job's lease: one live driver per job
        have = set(get_storage(job).list_files(job))
        leaked = len(have - keep)
        missing = len(keep - have)
        op.close()
        stop_spark()
    finally:
        ray.shutdown()
        if cluster is not None:
            cluster.shutdown()
        shutil.rmtree(work, ignore_errors=True)
    data = {
        "seed": args.seed, "rounds": rounds, "faults_injected": sum(faults.values()),
        "faults_by_kind": faults, "recoveries": recoveries,
        "checkpoints_completed": checkpoints, "changes_verified": verified,
        "changes_lost": lost, "leaked_files": leaked, "missing_files": missing,
        "max_keys_per_batch": state["max_keys"], "big_batches": big,
        "file_merging": args.file_merging, "dead_writer_check_s": args.dead_writer_check,
        "state_backend": args.state_backend,
        "hosts": len(links.hosts) if links else 0, "host_partitions": partitions,
        "executor_hosts": sorted(seen_hosts),
        "segment_files": len(seg), "segment_files_unnamed": unnamed, "dead_writers": dead_st,
        "duration_s": round(time.time() - t_start, 1), "events": events, "machine": machine(),
    }
    pyplot = plt()
    fig, ax = pyplot.subplots(figsize=(7, 3))
    ax.bar(list(faults), list(faults.values()), color="tab:red")
    ax.set_ylabel("faults injected")
    ax.set_title(f"Spark pipeline chaos ({args.state_backend}): {verified} events verified, {lost} lost, "
                 f"{leaked} leaked files")
    name = ("chaos_spark" + ("_rocksdb" if args.state_backend == "rocksdb" else "")
            + ("_hosts" if links else ""))
    write_results(name, data, fig, args.out)
    if lost or leaked or missing:
        raise SystemExit(f"chaos_spark FAILED: lost={lost} leaked={leaked} missing={missing}")


if __name__ == "__main__":
    threading.excepthook = lambda a: None  # a dying query's threads must not spam stderr
    main()
