"""The `chatcore` command line. Each subcommand imports its module lazily, so `--help` stays fast.

Settings flags are generated from `Settings` (`chatcore.config_flags`), and each command takes, and its
`--help` lists, only the settings it uses, grouped as `chatcore.config_groups` groups them: serve, bench
and `config show` every one; generate the model's and the engine's; migrate and keys the database's;
chat the server's address. The global options (`--config`, `--cache-dir`, `--data-dir`) are taken before
or after the command, with one meaning either way. Flags win over the environment, which wins over the
config file (`--config`, `CHATCORE_CONFIG` or ./chatcore.toml).
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Sequence
from importlib import metadata

from chatcore.config import (
    CONFIG_ENV,
    CONFIG_FILE,
    DEFAULT_MODEL,
    ConfigError,
    Settings,
    load_config,
)
from chatcore.config_flags import add_settings_flags
from chatcore.config_groups import GROUPS, grouped, settings_of
from chatcore.environment import check_at_start
from chatcore.kernels import cpu_kind
from chatcore.models.errors import ModelUnavailable

Handler = Callable[[argparse.Namespace, Settings], int]


def _model_fetch(args: argparse.Namespace, settings: Settings) -> int:
    from chatcore.models.fetch import fetch_default_model

    path, converted = fetch_default_model(settings.cache_dir)
    print(f"default model {'converted to' if converted else 'already at'} {path}")
    return 0


def _chat(args: argparse.Namespace, settings: Settings) -> int:
    from chatcore.chat.command import ChatOptions, chat_command, default_url

    params = {k: v for k, v in (("max_tokens", args.max_tokens), ("temperature", args.temperature)) if v is not None}
    return chat_command(ChatOptions(url=args.url or default_url(settings.host, settings.port), api_key=args.api_key,
                                    session=args.session, resume_token=args.resume_token, system=args.system,
                                    params=params, data_dir=settings.data_dir, default_port=settings.port))


def _model_list(args: argparse.Namespace, settings: Settings) -> int:
    from chatcore.models.cache_commands import list_command

    return list_command(settings.cache_dir, settings.model)


def _model_rm(args: argparse.Namespace, settings: Settings) -> int:
    from chatcore.models.cache_commands import rm_command

    return rm_command(settings.cache_dir, args.name)


def _model_pull(args: argparse.Namespace, settings: Settings) -> int:
    from chatcore.models.cache_commands import pull_command

    return pull_command(settings.cache_dir, args.source)


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
GLOBAL_SETTINGS = ("cache_dir", "data_dir")  # with --config: before or after the command, one meaning either way
STORE_SETTINGS = ("database_url", "sqlite_synchronous")
EVERY_SETTING = settings_of(*GROUPS)
Subparsers = argparse._SubParsersAction  # argparse names no public type for it


def version() -> str:
    try:
        return metadata.version("chatcore")
    except metadata.PackageNotFoundError:  # a checkout on PYTHONPATH, never installed
        return "unknown (not installed)"


def _add_global_options(parser: argparse.ArgumentParser | argparse._ArgumentGroup, default: object) -> None:
    parser.add_argument("--config", default=default, metavar="PATH",
                        help=f"a TOML file of settings ({CONFIG_ENV}; default: ./{CONFIG_FILE} if present)")
    add_settings_flags(parser, GLOBAL_SETTINGS)


def _command(sub: Subparsers, name: str, help: str, settings: Sequence[str] = ()) -> argparse.ArgumentParser:
    """A command that takes the global options after its name too, and the flags of `settings`, grouped."""
    parser: argparse.ArgumentParser = sub.add_parser(name, help=help, description=help)
    _add_global_options(parser.add_argument_group("global options (before or after the command)"),
                        argparse.SUPPRESS)  # left out, the value given before the command stands
    for group, names in grouped(n for n in settings if n not in GLOBAL_SETTINGS).items():
        add_settings_flags(parser.add_argument_group(f"{group} settings"), names)
    return parser


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="chatcore", description="A multi-session chat server with a paged KV cache.")
    parser.add_argument("--version", action="version", version=f"chatcore {version()}")
    _add_global_options(parser, None)
    sub = parser.add_subparsers(dest="command", required=True)
    _add_model(sub)
    _add_chat(sub)
    _add_generate(sub)
    _command(sub, "migrate", "upgrade the database to the newest schema", STORE_SETTINGS).set_defaults(
        handler=_migrate)
    _add_keys(sub)
    _command(sub, "serve", "serve the UI, the WebSocket API and the OpenAI-compatible API",
             EVERY_SETTING).set_defaults(handler=_serve)
    _add_cluster(sub)
    _add_bench(sub)
    config = sub.add_parser("config", help="inspect the settings")
    config_sub = config.add_subparsers(dest="config_command", required=True)
    _command(config_sub, "show", "print every effective setting and where it came from (flag, env, file, default), "
             "secrets redacted", EVERY_SETTING).set_defaults(handler=_config_show)
    return parser


def _add_model(sub: Subparsers) -> None:
    model = sub.add_parser("model", help="manage the models in the cache folder")
    model_sub = model.add_subparsers(dest="model_command", required=True)
    _command(model_sub, "fetch", "install and convert the default model (idempotent)").set_defaults(
        handler=_model_fetch)
    _command(model_sub, "list", "the models in the cache folder: name, architecture, parameters, weights, size on "
             "disk, and the default (the one the model setting names)", ("model",)).set_defaults(handler=_model_list)
    rm = _command(model_sub, "rm", "remove a model from the cache folder (refused while a process uses it)")
    rm.add_argument("name", help="a NAME from `chatcore model list`")
    rm.set_defaults(handler=_model_rm)
    pull = _command(model_sub, "pull", "add a model to the cache folder: ORG/NAME from the Hugging Face hub, a local "
                    "model folder, or a local .gguf file (converted to safetensors)")
    pull.add_argument("source", help="ORG/NAME, a folder or a .gguf file")
    pull.set_defaults(handler=_model_pull)


def _add_chat(sub: Subparsers) -> None:
    chat = _command(sub, "chat", "chat with a running server over its WebSocket API: each line of standard input is "
                    "a turn; /exit, /new, /system TEXT, /sessions, /history, /help", ("host", "port"))
    chat.add_argument("--url", default=None, help="the server's address: http://HOST:PORT (as the server prints it), "
                      "https://HOST, HOST:PORT or ws://HOST:PORT/v1/ws (default: the host and port settings)")
    chat.add_argument("--api-key", dest="api_key", default=None,
                      help="in keyed mode, the tenant's API key (default: CHATCORE_API_KEY)")
    chat.add_argument("--session", default=None, metavar="ID",
                      help="resume this session (its resume token is read from the data folder)")
    chat.add_argument("--resume-token", dest="resume_token", default=None, metavar="TOKEN",
                      help="the resume token of a session this client did not open")
    chat.add_argument("--system", default=None, metavar="TEXT", help="the system prompt of new sessions")
    chat.add_argument("--max-tokens", dest="max_tokens", type=int, default=None, help="an answer's length at most")
    chat.add_argument("--temperature", type=float, default=None)
    chat.set_defaults(handler=_chat)


def _add_generate(sub: Subparsers) -> None:
    gen = _command(sub, "generate", "generate a chat answer in-process", settings_of("model", "engine"))
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
    gen.set_defaults(handler=_generate)


def _add_keys(sub: Subparsers) -> None:
    keys = sub.add_parser("keys", help="manage API keys")
    keys_sub = keys.add_subparsers(dest="keys_command", required=True)
    create = _command(keys_sub, "create", "create an API key and print it once", STORE_SETTINGS)
    create.add_argument("--tenant", required=True)
    create.add_argument("--admin", action="store_true", help="the key may read /v1/admin/*")
    create.set_defaults(handler=_keys_create)
    listing = _command(keys_sub, "list", "list API keys (ids, tenants, prefixes; never the keys)", STORE_SETTINGS)
    listing.add_argument("--tenant", default=None, help="only this tenant's keys")
    listing.set_defaults(handler=_keys_list)
    revoke = _command(keys_sub, "revoke", "revoke an API key by its id", STORE_SETTINGS)
    revoke.add_argument("key_id", help="the key's id, from `chatcore keys list`")
    revoke.set_defaults(handler=_keys_revoke)


def _add_cluster(sub: Subparsers) -> None:
    cluster = sub.add_parser("cluster", help="run replicas behind nginx on loopback (docs/deploy.md)")
    cluster_sub = cluster.add_subparsers(dest="cluster_command", required=True)
    up = _command(cluster_sub, "up", "start PostgreSQL (with --postgres), N replicas and nginx")
    up.add_argument("--replicas", type=int, default=2)
    up.add_argument("--postgres", action="store_true", help="start a PostgreSQL cluster under the data dir")
    up.add_argument("--port", type=int, default=None, help="nginx's port; replicas use the next N ports")
    up.set_defaults(handler=_cluster)
    _command(cluster_sub, "down", "stop what `cluster up` started").set_defaults(handler=_cluster)


def _add_bench(sub: Subparsers) -> None:
    bench = _command(sub, "bench", "run the benchmarks against their baselines (the sessions suite reads "
                     "--kv-cache-gb and --kv-disk-gb for its default-tier runs)", EVERY_SETTING)
    bench.add_argument("--suite", default="all")
    bench.add_argument("--quick", action="store_true")
    bench.add_argument("--out", default="bench/results")
    bench.add_argument("--no-fail", dest="no_fail", action="store_true",
                       help="exit 0 even when a target is missed (report only)")
    bench.add_argument("--sessions", default=None, help="sessions suite: session counts, e.g. 16,64,256")
    bench.add_argument("--turns", type=int, default=None, help="sessions suite: turns per session")
    bench.set_defaults(handler=_bench)


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not check_at_start():  # a missing or conflicting package: one line each, not a traceback
        return 2
    try:
        cpu_kind.kind()  # CHATCORE_CPU_ISA: a kind this CPU runs, or one line
    except ValueError as exc:
        print(f"chatcore: {exc}", file=sys.stderr)
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
