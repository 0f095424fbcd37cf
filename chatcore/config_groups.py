"""Which group each setting belongs to (model, engine, server, storage), so a command's `--help` lists,
grouped, only the settings that command uses. Every field of `Settings` is in exactly one group
(tests/test_cli.py checks it)."""

from __future__ import annotations

from collections.abc import Iterable

GROUPS: dict[str, tuple[str, ...]] = {
    "model": ("model", "device", "dtype", "kv_dtype", "weights", "quant_isa", "threads", "cuda_graphs", "cache_dir"),
    "engine": ("block_size", "kv_cache_gb", "num_blocks", "gpu_memory_fraction", "low_watermark", "high_watermark",
               "cache_scope", "eviction_policy", "debug_audit", "max_batch_tokens", "max_num_seqs",
               "max_queue_wait_s", "max_waiting_requests", "max_context", "max_schema_bytes", "max_schema_depth",
               "max_schema_enum_values", "grammar_compile_threads", "grammar_compile_timeout_s", "grammar_cache_mb",
               "grammar_mask_share"),
    "server": ("host", "port", "hot_window_s", "max_hot_sessions", "pinned_kv_fraction", "warm_idle_s",
               "disconnect_grace_s", "context_policy", "context_low_water", "replica_id", "lease_s", "max_frame_bytes",
               "max_message_tokens", "max_tokens_limit", "max_sessions_per_tenant", "max_turns_per_tenant",
               "import_context_multiple", "max_concurrent_imports", "max_stored_chars_per_tenant", "max_connections",
               "header_timeout_s", "body_timeout_s", "max_connections_per_tenant", "socket_idle_timeout_s",
               "max_unauthenticated_sockets_per_address",
               "max_history_reads_per_minute", "history_page_messages", "allowed_origins", "allowed_hosts",
               "insecure_open_mode", "metrics_auth", "log_format"),
    "storage": ("data_dir", "database_url", "sqlite_synchronous", "kv_disk_dir", "kv_disk_gb"),
}
GROUP_OF: dict[str, str] = {name: group for group, names in GROUPS.items() for name in names}


def settings_of(*groups: str) -> tuple[str, ...]:
    """Every setting of `groups`, in their order."""
    return tuple(name for group in groups for name in GROUPS[group])


def grouped(names: Iterable[str]) -> dict[str, list[str]]:
    """`names` by group, in the groups' order (a group none of them is in is left out)."""
    wanted = set(names)
    return {group: [n for n in members if n in wanted] for group, members in GROUPS.items() if wanted & set(members)}
