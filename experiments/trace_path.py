"""One checkpoint's path through the tree, drawn from exported OpenTelemetry spans.

    python -m experiments.trace_path [--quick]

Starts a 5-node Ray cluster on this machine, deploys the tree (branching 2, up-front routing
for 2 checkpoints) with ``tracing=file:<dir>``, runs 3 checkpoints with a writer on every
node, then draws checkpoint 1 (every hop) and checkpoint 2 (routed: leaves skip the middle
level) with ``dstl-ray trace``'s drawing code. Writes trace_path.json and trace_path.png
(checkpoint 1) and trace_path_routed.png (checkpoint 2).
"""

from __future__ import annotations

import os
import tempfile

from .common import parser, write_results


def main() -> None:
    args = parser(__doc__).parse_args()
    import ray

    from dstl_ray import ChangelogConfig, deploy
    from dstl_ray.observability.trace_view import draw, load_spans
    from dstl_ray.testing import start_local_cluster
    from experiments.workload import place_writers

    spans_dir = tempfile.mkdtemp(prefix="dstl-spans-")
    base = tempfile.mkdtemp(prefix="dstl-trace-")
    cluster = start_local_cluster(5, 1)
    try:
        cfg = ChangelogConfig(namespace="trace", branching_factor=2, routing_horizon=2,
                              tracing=f"file:{spans_dir}")
        tree = deploy(f"file://{base}", cfg, detached=False)
        actors = place_writers("traced", "trace", [s["node_id"] for s in tree.status()], 2)
        for _ in range(3):
            assert all(r["ok"] for r in ray.get([a.checkpoint.remote(100, 100)
                                                 for a in actors]))
        tree.shutdown()
    finally:
        ray.shutdown()
        cluster.shutdown()
    spans = load_spans(spans_dir)
    os.makedirs(args.out, exist_ok=True)
    first = draw(spans, 0, os.path.join(args.out, "trace_path.png"))
    routed = draw(spans, 1, os.path.join(args.out, "trace_path_routed.png"))
    print("checkpoint 1 hops:", list(first["hops"]), flush=True)
    print("checkpoint 2 hops:", list(routed["hops"]), flush=True)
    write_results("trace_path", {"spans": len(spans), "checkpoint_1": first,
                                 "checkpoint_2_routed": routed}, None, args.out)


if __name__ == "__main__":
    main()
