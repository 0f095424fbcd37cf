"""The one settings object. Every field reads `CHATCORE_<NAME>` from the environment.

CLI flags override the environment through `Settings.model_copy(update=...)`.
Defaults work on a laptop: loopback only, SQLite in the user's data directory, and KV
tiers sized from the machine (`chatcore.kv.sizing`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal

from pydantic import Field, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

DEFAULT_MODEL = "default"


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="CHATCORE_", extra="ignore")

    # Network.
    host: str = "127.0.0.1"
    port: int = 8000

    # Model and compute.
    model: str = DEFAULT_MODEL
    device: str = Field("auto", pattern=r"^(auto|cpu|cuda(:[0-9]+)?)$",
                        description="auto: cuda when torch sees a GPU, else cpu; or cpu, cuda, cuda:N")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    kv_dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto", description="KV cache storage dtype; auto: the model's dtype (exact)")
    threads: int = Field(0, description="torch threads; 0 keeps torch's default")

    # KV cache.
    block_size: int = Field(16, ge=1)
    kv_cache_gb: Annotated[float, Field(gt=0)] | Literal["auto"] = Field(
        "auto", description="KV pool budget in GiB; auto: a quarter of the available RAM on the CPU, "
        "gpu_memory_fraction of the free GPU memory on CUDA")
    num_blocks: int | None = Field(None, ge=1, description="overrides kv_cache_gb")
    gpu_memory_fraction: float = Field(
        0.85, gt=0, le=1, description="on CUDA with kv_cache_gb=auto: the share of the GPU memory left after "
        "loading the model that the KV pool takes")
    low_watermark: float = Field(0.15, ge=0, lt=1)
    high_watermark: float = Field(0.30, ge=0, lt=1)
    cache_scope: Literal["global", "tenant"] = Field(
        "tenant", description="tenant: prefix blocks are shared within a tenant only; global: across tenants, "
        "which lets one tenant learn, from cached_tokens or timing, whether another's prompt starts with a guess")
    eviction_policy: Literal["lru", "cost", "session"] = Field(
        "session", description="session: whole conversations, the one expected back last first")
    debug_audit: bool = False

    # Scheduler.
    max_batch_tokens: int = Field(512, ge=16, description="tokens per engine step")
    max_num_seqs: int = Field(64, ge=1)
    max_queue_wait_s: float = Field(30.0, gt=0)
    max_waiting_requests: int = Field(1024, ge=1, description="requests queued for the engine at most; past it: busy")

    # Paths.
    cache_dir: Path = Path("~/.cache/chatcore")
    data_dir: Path = Path("~/.local/share/chatcore")
    database_url: str | None = None
    sqlite_synchronous: Literal["NORMAL", "FULL"] = Field(
        "NORMAL", description="NORMAL: a power loss may lose the last acknowledged turns; FULL: fsync every commit")
    kv_disk_dir: Path | None = None
    kv_disk_gb: Annotated[float, Field(ge=0)] | Literal["auto"] = Field(
        "auto", description="disk tier budget in GiB (0: off); auto: a fifth of the free disk, 1-64 GiB")

    # Sessions.
    hot_window_s: float = Field(30.0, ge=0)
    max_hot_sessions: int = Field(256, ge=1)
    pinned_kv_fraction: float = Field(0.5, gt=0, le=1, description="share of the pool hot sessions may pin")
    warm_idle_s: float = Field(600.0, ge=0)
    disconnect_grace_s: float = Field(30.0, ge=0)
    context_policy: Literal["truncate", "reject"] = Field(
        "truncate", description="a session turn that would overflow the context: truncate drops its oldest "
        "exchanges from the model's view (never the system prompt); reject refuses it (too_large)")
    context_low_water: float = Field(
        0.5, gt=0, le=1, description="truncate drops exchanges until the prompt is at most this share of the context")

    # Replicas (docs/deploy.md): who owns a session, and for how long without renewal.
    replica_id: str | None = Field(None, max_length=200, description="default: hostname and a hash of data_dir")
    lease_s: float = Field(15.0, gt=0, description="a session lease lapses this long after its last renewal")

    # Limits.
    max_frame_bytes: int = Field(65536, ge=256)
    max_message_tokens: int = Field(4096, ge=1)
    max_tokens_limit: int = Field(2048, ge=1)
    max_context: int | None = Field(
        None, ge=32, description="tokens of context per sequence (prompt + answer); default: the model's window")
    max_sessions_per_tenant: int = Field(1000, ge=1)
    max_turns_per_tenant: int = Field(16, ge=1)
    allowed_origins: list[str] = Field(default_factory=list)
    allowed_hosts: list[str] = Field(default_factory=list, description="Host names open mode answers besides loopback")
    insecure_open_mode: bool = Field(
        False, description="serve without API keys even off loopback (a bind address or ALLOWED_HOSTS): no access control")
    metrics_auth: Literal["key", "open"] = Field(
        "key", description="key: in keyed mode /metrics needs an API key, as every other route (a scraper's "
        "Bearer key); open: /metrics answers anyone. Open mode has no keys, so /metrics is open there either way")

    @model_validator(mode="after")
    def _expand(self) -> "Settings":
        self.cache_dir = self.cache_dir.expanduser()
        self.data_dir = self.data_dir.expanduser()
        if self.kv_disk_dir is not None:
            self.kv_disk_dir = self.kv_disk_dir.expanduser()
        if self.high_watermark < self.low_watermark:
            raise ValueError("high_watermark must be >= low_watermark")
        return self

    @property
    def resolved_database_url(self) -> str:
        if self.database_url:
            return self.database_url
        return f"sqlite+aiosqlite:///{self.data_dir / 'chatcore.db'}"

    @property
    def resolved_kv_disk_dir(self) -> Path:
        return self.kv_disk_dir if self.kv_disk_dir is not None else self.data_dir / "kv"


def load_settings(**overrides: object) -> Settings:
    """Settings from the environment, with explicit (CLI) overrides that are not None."""
    base = Settings()
    update = {k: v for k, v in overrides.items() if v is not None}
    return Settings(**{**base.model_dump(), **update}) if update else base
