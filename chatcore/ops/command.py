"""`chatcore cluster up|down` (docs/deploy.md): the command line over `chatcore.ops.cluster`."""

from __future__ import annotations

import argparse
import sys

from chatcore.config import Settings
from chatcore.ops.cluster import cluster_down, cluster_up
from chatcore.ops.errors import ClusterError


def cluster_command(args: argparse.Namespace, settings: Settings) -> int:
    from chatcore.store.commands import masked_url

    action = args.cluster_command
    if action == "down":
        state = cluster_down(settings)
        print("no cluster recorded" if state is None else f"stopped nginx, {len(state.replicas)} replicas"
              + (" and PostgreSQL" if state.postgres else ""))
        return 0
    try:
        state = cluster_up(settings, args.replicas, port=settings.port,
                           postgres=args.postgres)
    except ClusterError as exc:
        print(f"chatcore cluster up: {exc}", file=sys.stderr)
        return 1
    for replica in state.replicas:
        print(f"{replica.id}: {replica.url} (pid {replica.pid}, log {replica.log})")
    print(f"database: {masked_url(state.database_url)}\ndisk tier: {state.kv_disk_dir}")
    print(f"chatcore cluster listening on {state.url}")
    return 0
