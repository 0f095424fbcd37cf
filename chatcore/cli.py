"""The `chatcore` command line. Each subcommand imports its module lazily, so `--help` stays fast.

Settings flags are generated from `Settings` (`chatcore.config_flags`): commands that run the model or a
server (serve, generate, bench) and `config show` take every setting; the database commands (migrate,
keys) take the database's; `model fetch` takes the cache folder. Flags win over the environment, which
wins over the config file (`--config`, `CHATCORE_CONFIG` or ./chatcore.toml).
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Sequence

from chatcore.config import (
    CONFIG_ENV,
    CONFIG_FILE,
    DEFAULT_MODEL,
    ConfigError,
    Settings,
    load_config,
)
from chatcore.config_flags import add_settings_flags
from chatcore.environment import check_at_start
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
    from chatcore.ops.command import cluster_command

    return cluster_command(args, settings)


def _bench(args: argparse.Namespace, settings: Settings) -> int:
    from chatcore.bench.cli import bench_command

    return bench_command(args, settings)


def _config_show(args: argparse.Namespace, settings: Settings) -> int:
    from chatcore.config_show import render

    print(render(args.config_loaded))
    return 0


PRIVATE_COMMANDS = {"serve", "migrate", "keys"}  # cluster: its replicas are `serve` processes
DEVICE_COMMANDS = {"serve", "generate", "bench"}
STORE_SETTINGS = ("database_url", "sqlite_synchronous")  # with --data-dir, before the command


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="chatcore", description="A multi-session chat server with a paged KV cache.")
    parser.add_argument("--config", default=None, metavar="PATH",
                        help=f"a TOML file of settings ({CONFIG_ENV}; default: ./{CONFIG_FILE} if present)")
    add_settings_flags(parser, ("cache_dir", "data_dir"))
    sub = parser.add_subparsers(dest="command", required=True)
    model = sub.add_parser("model", help="manage models")
    model_sub = model.add_subparsers(dest="model_command", required=True)
    model_sub.add_parser("fetch", help="install and convert the default model (idempotent)").set_defaults(
        handler=_model_fetch
    )
    _add_generate(sub)
    mig = sub.add_parser("migrate", help="upgrade the database to the newest schema")
    add_settings_flags(mig, STORE_SETTINGS)
    mig.set_defaults(handler=_migrate)
    _add_keys(sub)
    serve = sub.add_parser("serve", help="serve the UI, the WebSocket API and the OpenAI-compatible API")
    add_settings_flags(serve)
    serve.set_defaults(handler=_serve)
    _add_cluster(sub)
    _add_bench(sub)
    config = sub.add_parser("config", help="inspect the settings")
    config_sub = config.add_subparsers(dest="config_command", required=True)
    show = config_sub.add_parser("show", help="print every effective setting and where it came from "
                                 "(flag, env, file, default), secrets redacted")
    add_settings_flags(show)
    show.set_defaults(handler=_config_show)
    return parser


def _add_generate(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
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
    add_settings_flags(gen.add_argument_group("settings"))
    gen.set_defaults(handler=_generate)


def _add_keys(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    keys = sub.add_parser("keys", help="manage API keys")
    keys_sub = keys.add_subparsers(dest="keys_command", required=True)
    create = keys_sub.add_parser("create", help="create an API key and print it once")
    create.add_argument("--tenant", required=True)
    create.add_argument("--admin", action="store_true", help="the key may read /v1/admin/*")
    add_settings_flags(create, STORE_SETTINGS)
    create.set_defaults(handler=_keys_create)
    listing = keys_sub.add_parser("list", help="list API keys (ids, tenants, prefixes; never the keys)")
    listing.add_argument("--tenant", default=None, help="only this tenant's keys")
    add_settings_flags(listing, STORE_SETTINGS)
    listing.set_defaults(handler=_keys_list)
    revoke = keys_sub.add_parser("revoke", help="revoke an API key by its id")
    revoke.add_argument("key_id", help="the key's id, from `chatcore keys list`")
    add_settings_flags(revoke, STORE_SETTINGS)
    revoke.set_defaults(handler=_keys_revoke)


def _add_cluster(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    cluster = sub.add_parser("cluster", help="run replicas behind nginx on loopback (docs/deploy.md)")
    cluster_sub = cluster.add_subparsers(dest="cluster_command", required=True)
    up = cluster_sub.add_parser("up", help="start PostgreSQL (with --postgres), N replicas and nginx")
    up.add_argument("--replicas", type=int, default=2)
    up.add_argument("--postgres", action="store_true", help="start a PostgreSQL cluster under the data dir")
    up.add_argument("--port", type=int, default=None, help="nginx's port; replicas use the next N ports")
    up.set_defaults(handler=_cluster)
    cluster_sub.add_parser("down", help="stop what `cluster up` started").set_defaults(handler=_cluster)


def _add_bench(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    bench = sub.add_parser("bench", help="run the benchmarks against their baselines")
    bench.add_argument("--suite", default="all")
    bench.add_argument("--quick", action="store_true")
    bench.add_argument("--out", default="bench/results")
    bench.add_argument("--no-fail", dest="no_fail", action="store_true",
                       help="exit 0 even when a target is missed (report only)")
    bench.add_argument("--sessions", default=None, help="sessions suite: session counts, e.g. 16,64,256")
    bench.add_argument("--turns", type=int, default=None, help="sessions suite: turns per session")
    add_settings_flags(bench.add_argument_group("settings (the sessions suite reads --kv-cache-gb and --kv-disk-gb "
                                                "for its default-tier runs)"))
    bench.set_defaults(handler=_bench)


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not check_at_start():  # a missing or conflicting package: one line each, not a traceback
        return 2
    try:
        args.config_loaded = load_config({key: getattr(args, key, None) for key in Settings.model_fields},
                                         args.config)
    except ConfigError as exc:
        print(f"chatcore: {exc}", file=sys.stderr)
        return 2
    settings = args.config_loaded.settings
    handler: Handler = args.handler
    if args.command in DEVICE_COMMANDS:
        from chatcore.models.device import DeviceUnavailable, resolve_device
        from chatcore.models.int8_weights import check_weights

        try:
            check_weights(settings.weights, resolve_device(settings.device))
            if settings.model != DEFAULT_MODEL:  # a missing model fails here, before a server starts
                from chatcore.models.loader import (
                    resolve_model_path,  # transformers: seconds to import
                )

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
