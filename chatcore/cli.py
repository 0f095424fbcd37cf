"""The `chatcore` command line. Each subcommand imports its module lazily, so `--help` stays fast.

Flags whose `dest` matches a `Settings` field override the environment (`CHATCORE_*`).
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Sequence

from chatcore.config import DEFAULT_MODEL, Settings, load_settings
from chatcore.models.errors import ModelUnavailable

Handler = Callable[[argparse.Namespace, Settings], int]


def _model_fetch(args: argparse.Namespace, settings: Settings) -> int:
    from chatcore.models.fetch import fetch_default_model

    path, converted = fetch_default_model(settings.cache_dir)
    print(f"default model {'converted to' if converted else 'already at'} {path}")
    return 0


def _generate(args: argparse.Namespace, settings: Settings) -> int:
    from chatcore.engine.generate_cli import run_generate

    return run_generate(args, settings)


def _migrate(args: argparse.Namespace, settings: Settings) -> int:
    from chatcore.store.commands import migrate_command

    return migrate_command(settings)


def _keys_create(args: argparse.Namespace, settings: Settings) -> int:
    from chatcore.store.commands import keys_create_command

    return keys_create_command(settings, tenant=args.tenant, admin=args.admin)


def _keys_list(args: argparse.Namespace, settings: Settings) -> int:
    from chatcore.store.commands import keys_list_command

    return keys_list_command(settings, tenant=args.tenant)


def _keys_revoke(args: argparse.Namespace, settings: Settings) -> int:
    from chatcore.store.commands import keys_revoke_command

    return keys_revoke_command(settings, args.key_id)


def _serve(args: argparse.Namespace, settings: Settings) -> int:
    from chatcore.server.run import serve_command

    return serve_command(settings)


def _cluster(args: argparse.Namespace, settings: Settings) -> int:
    from chatcore.cluster import cluster_command

    return cluster_command(args, settings)


def _bench(args: argparse.Namespace, settings: Settings) -> int:
    from bench.cli import bench_command

    return bench_command(args, settings)


PRIVATE_COMMANDS = {"serve", "migrate", "keys"}  # cluster: its replicas are `serve` processes
DEVICE_COMMANDS = {"serve", "generate", "bench"}


def _gb_or_auto(value: str) -> float | str:
    if value == "auto":
        return value
    try:
        return float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of GiB or 'auto', not {value!r}") from None


def _add_engine_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help="a local Hugging Face folder, a hub id (org/name) from the "
                        "local HF cache, or 'default' (CHATCORE_MODEL)")
    parser.add_argument("--device", default=None,
                        help="auto (cuda when there is a GPU, else cpu), cpu, cuda or cuda:N (CHATCORE_DEVICE)")
    parser.add_argument("--gpu-memory-fraction", dest="gpu_memory_fraction", type=float, default=None,
                        help="on CUDA: the share of the GPU memory free after loading that the KV pool takes "
                        "when --kv-cache-gb is auto (CHATCORE_GPU_MEMORY_FRACTION, 0.85)")
    parser.add_argument("--dtype", default=None, choices=["auto", "float32", "bfloat16", "float16"])
    parser.add_argument("--kv-dtype", dest="kv_dtype", default=None, choices=["auto", "float32", "bfloat16", "float16"],
                        help="KV cache storage dtype; auto: the model's (CHATCORE_KV_DTYPE)")
    parser.add_argument("--block-size", dest="block_size", type=int, default=None)
    parser.add_argument("--kv-cache-gb", dest="kv_cache_gb", type=_gb_or_auto, default=None,
                        help="KV pool budget in GiB, or auto")
    parser.add_argument("--num-blocks", dest="num_blocks", type=int, default=None)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (0: torch's default)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="chatcore", description="A multi-session chat server with a paged KV cache.")
    parser.add_argument("--cache-dir", dest="cache_dir", default=None, help="converted models (CHATCORE_CACHE_DIR)")
    parser.add_argument("--data-dir", dest="data_dir", default=None, help="database and disk tier (CHATCORE_DATA_DIR)")
    sub = parser.add_subparsers(dest="command", required=True)

    model = sub.add_parser("model", help="manage models")
    model_sub = model.add_subparsers(dest="model_command", required=True)
    model_sub.add_parser("fetch", help="install and convert the default model (idempotent)").set_defaults(
        handler=_model_fetch
    )

    gen = sub.add_parser("generate", help="generate a chat answer in-process")
    gen.add_argument("--prompt", required=True)
    gen.add_argument("--system", default=None)
    gen.add_argument("--max-tokens", dest="max_tokens", type=int, default=128)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", dest="top_p", type=float, default=1.0)
    gen.add_argument("--top-k", dest="top_k", type=int, default=0)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--n", type=int, default=1)
    gen.add_argument("--beam-width", dest="beam_width", type=int, default=1)
    gen.add_argument("--json", dest="as_json", action="store_true", help="print one JSON object")
    _add_engine_flags(gen)
    gen.set_defaults(handler=_generate)

    mig = sub.add_parser("migrate", help="upgrade the database to the newest schema")
    mig.add_argument("--database-url", dest="database_url", default=None)
    mig.set_defaults(handler=_migrate)

    keys = sub.add_parser("keys", help="manage API keys")
    keys_sub = keys.add_subparsers(dest="keys_command", required=True)
    create = keys_sub.add_parser("create", help="create an API key and print it once")
    create.add_argument("--tenant", required=True)
    create.add_argument("--admin", action="store_true", help="the key may read /v1/admin/*")
    create.add_argument("--database-url", dest="database_url", default=None)
    create.set_defaults(handler=_keys_create)
    listing = keys_sub.add_parser("list", help="list API keys (ids, tenants, prefixes; never the keys)")
    listing.add_argument("--tenant", default=None, help="only this tenant's keys")
    listing.add_argument("--database-url", dest="database_url", default=None)
    listing.set_defaults(handler=_keys_list)
    revoke = keys_sub.add_parser("revoke", help="revoke an API key by its id")
    revoke.add_argument("key_id", help="the key's id, from `chatcore keys list`")
    revoke.add_argument("--database-url", dest="database_url", default=None)
    revoke.set_defaults(handler=_keys_revoke)

    serve = sub.add_parser("serve", help="serve the UI, the WebSocket API and the OpenAI-compatible API")
    serve.add_argument("--host", default=None)
    serve.add_argument("--port", type=int, default=None)
    serve.add_argument("--database-url", dest="database_url", default=None)
    serve.add_argument("--kv-disk-gb", dest="kv_disk_gb", type=_gb_or_auto, default=None,
                       help="disk tier budget in GiB (0: off), or auto")
    serve.add_argument("--eviction-policy", dest="eviction_policy", default=None, choices=["session", "cost", "lru"])
    serve.add_argument("--insecure-open-mode", dest="insecure_open_mode", action="store_true", default=None,
                       help="serve without API keys off loopback: anyone who reaches it can use it")
    serve.add_argument("--metrics-auth", dest="metrics_auth", default=None, choices=["key", "open"],
                       help="key: /metrics needs an API key in keyed mode (the default); open: anyone may scrape it")
    _add_engine_flags(serve)
    serve.set_defaults(handler=_serve)

    cluster = sub.add_parser("cluster", help="run replicas behind nginx on loopback (docs/deploy.md)")
    cluster_sub = cluster.add_subparsers(dest="cluster_command", required=True)
    up = cluster_sub.add_parser("up", help="start PostgreSQL (with --postgres), N replicas and nginx")
    up.add_argument("--replicas", type=int, default=2)
    up.add_argument("--postgres", action="store_true", help="start a PostgreSQL cluster under the data dir")
    up.add_argument("--port", type=int, default=None, help="nginx's port; replicas use the next N ports")
    up.set_defaults(handler=_cluster)
    cluster_sub.add_parser("down", help="stop what `cluster up` started").set_defaults(handler=_cluster)

    bench = sub.add_parser("bench", help="run the benchmarks against their baselines")
    bench.add_argument("--suite", default="all")
    bench.add_argument("--quick", action="store_true")
    bench.add_argument("--out", default="bench/results")
    bench.add_argument("--no-fail", dest="no_fail", action="store_true",
                       help="exit 0 even when a target is missed (report only)")
    bench.add_argument("--sessions", default=None, help="sessions suite: session counts, e.g. 16,64,256")
    bench.add_argument("--turns", type=int, default=None, help="sessions suite: turns per session")
    bench.add_argument("--kv-disk-gb", dest="kv_disk_gb", type=_gb_or_auto, default=None,
                       help="sessions suite: the disk tier budget of its default-tier runs (GiB, 0: off, auto)")
    _add_engine_flags(bench)
    bench.set_defaults(handler=_bench)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    overrides = {key: getattr(args, key, None) for key in Settings.model_fields}
    try:
        settings = load_settings(**overrides)
    except ValueError as exc:
        parser.error(str(exc))
    handler: Handler = args.handler
    if args.command in DEVICE_COMMANDS:
        from chatcore.models.device import DeviceUnavailable, resolve_device
        from chatcore.models.loader import resolve_model_path

        try:
            resolve_device(settings.device)
            if settings.model != DEFAULT_MODEL:  # a missing model fails here, before a server starts
                resolve_model_path(settings)
        except (DeviceUnavailable, ModelUnavailable) as exc:
            print(f"chatcore: {exc}", file=sys.stderr)
            return 2
    if args.command in PRIVATE_COMMANDS:
        os.umask(0o077)  # the database, the KV files and their folders: the server's user's alone
    try:
        return handler(args, settings)
    except ModelUnavailable as exc:  # a model refused at load (models/support.py)
        print(f"chatcore: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
