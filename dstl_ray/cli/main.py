"""The ``dstl-ray`` command for operators: up, status, down, inspect, demo."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from ..config import ChangelogConfig, env_var
from ..errors import DstlError


def _config(args: argparse.Namespace) -> ChangelogConfig:
    overrides: dict[str, Any] = {}
    for opt in ("branching_factor", "flush_bytes", "persist_delay_s", "routing_horizon",
                "compression", "namespace"):
        v = getattr(args, opt, None)
        if v is not None:
            overrides[opt] = v
    return ChangelogConfig.from_env(**overrides)


def _tree_table(status: list[dict[str, Any]]) -> str:
    head = (f"{'node':28} {'lvl':>3} {'parent':28} {'writers':>7} {'buffered':>9} "
            f"{'requests':>8} {'files':>6} {'flushed B':>10} {'forwarded B':>11} {'bypass':>6}")
    rows = [head]
    for s in status:
        if "error" in s:
            rows.append(f"{s['name']:28} DEAD: {s['error']}")
            continue
        rows.append(
            f"{s['name']:28} {s['level']:>3} {str(s['parent'] or '-'):28} {s['writers']:>7} "
            f"{s['buffered_bytes']:>9} {s['requests']:>8} {s['files_flushed']:>6} "
            f"{s['bytes_flushed']:>10} {s['bytes_forwarded']:>11} {s.get('routed_direct', 0):>6}")
    return "\n".join(rows)


def cmd_up(args: argparse.Namespace) -> int:
    from ..deploy import deploy

    tree = deploy(args.base_path, _config(args), address=args.address, detached=True)
    print(f"deployed {len(tree.nodes)} node actors (root {tree.root}) in namespace "
          f"{tree.config.namespace!r}, base path {tree.base_path}")
    print(_tree_table(tree.status()))
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    from ..deploy import attach

    tree = attach(_config(args), address=args.address)
    status = tree.status()
    if args.json:
        print(json.dumps({"base_path": tree.base_path, "root": tree.root, "nodes": status},
                         indent=2))
    else:
        print(f"tree in namespace {tree.config.namespace!r}, base path {tree.base_path}, "
              f"root {tree.root}")
        print(_tree_table(status))
    return 0


def cmd_down(args: argparse.Namespace) -> int:
    from ..deploy import attach

    tree = attach(_config(args), address=args.address)
    n = len(tree.nodes)
    tree.shutdown()
    print(f"stopped {n} node actors in namespace {tree.config.namespace!r}")
    return 0


def cmd_inspect(args: argparse.Namespace) -> int:
    from .inspect import inspect_path, render

    summary = inspect_path(args.path)
    print(json.dumps(summary, indent=2, sort_keys=True) if args.json else render(summary))
    return 0


def cmd_trace(args: argparse.Namespace) -> int:
    from ..observability.trace_view import draw, load_spans

    summary = draw(load_spans(args.spans), args.flush, args.out)
    print(json.dumps(summary, indent=2))
    print(f"wrote {args.out}")
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    from spark_glue.demo import run_pipeline_demo

    return run_pipeline_demo(args)


def cmd_demo_changelog(args: argparse.Namespace) -> int:
    from .demo import run_demo

    return run_demo(args)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="dstl-ray", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)

    def cluster_opts(sp: argparse.ArgumentParser) -> None:
        sp.add_argument("--address", default=None,
                        help="Ray cluster address (default: RAY_ADDRESS or the local cluster)")
        sp.add_argument("--namespace", default=None,
                        help=f"Ray namespace of the tree (default {env_var('namespace')} "
                             f"or dstl_ray)")

    up = sub.add_parser("up", help="deploy node actors on a running `ray start` cluster")
    cluster_opts(up)
    up.add_argument("--base-path", required=True, help="DFS base URL: file://..., s3://...")
    up.add_argument("--branching", dest="branching_factor", type=int)
    up.add_argument("--flush-bytes", dest="flush_bytes", type=int)
    up.add_argument("--persist-delay", dest="persist_delay_s", type=float)
    up.add_argument("--routing-horizon", dest="routing_horizon", type=int)
    up.add_argument("--compression", choices=["none", "zstd"])
    up.set_defaults(func=cmd_up)

    st = sub.add_parser("status", help="the tree; per node level, parent, buffers, counters")
    cluster_opts(st)
    st.add_argument("--json", action="store_true")
    st.set_defaults(func=cmd_status)

    dn = sub.add_parser("down", help="stop the node actors")
    cluster_opts(dn)
    dn.set_defaults(func=cmd_down)

    ins = sub.add_parser("inspect", help="decode a changelog file or checkpoint metadata")
    ins.add_argument("path")
    ins.add_argument("--json", action="store_true")
    ins.set_defaults(func=cmd_inspect)

    tr = sub.add_parser("trace", help="draw one flush's path through the tree as a PNG, "
                        "from spans exported with tracing=file:<dir>")
    tr.add_argument("spans", help="the directory given as tracing=file:<dir>")
    tr.add_argument("--flush", type=int, default=-1,
                    help="which flush, in time order (default: the last)")
    tr.add_argument("--out", default="dstl-trace.png")
    tr.set_defaults(func=cmd_trace)

    from spark_glue.demo import add_arguments

    demo = sub.add_parser("demo", help="run the main job: a stateful PySpark stream on RayDP "
                          "over a local 3-node Ray cluster, with a failure, checked against "
                          "a batch recomputation")
    add_arguments(demo)
    demo.set_defaults(func=cmd_demo)
    dc = sub.add_parser("demo-changelog", help="the changelog alone: writers, checkpoints "
                        "with truncation, restores checked")
    dc.add_argument("--base-path", default=None, help="default: ./demo-data")
    dc.add_argument("--writers", type=int, default=8)
    dc.add_argument("--checkpoints", type=int, default=5)
    dc.set_defaults(func=cmd_demo_changelog)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except DstlError as e:
        print(f"dstl-ray {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
