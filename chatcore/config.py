"""The one settings object, and where each value came from.

`load_config` layers, highest first: CLI flags, the environment (`CHATCORE_<NAME>`), a TOML file
(`--config PATH`, else `CHATCORE_CONFIG`, else `chatcore.toml` in the working directory), the defaults.
`Settings()` alone reads the environment and the defaults. Defaults work on a laptop: loopback only,
SQLite in the user's data directory, and KV tiers sized from the machine (`chatcore.kv.sizing`).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import Field, ValidationError, model_validator
from pydantic_settings import (
    BaseSettings,
    EnvSettingsSource,
    SettingsConfigDict,
    TomlConfigSettingsSource,
)
from pydantic_settings.exceptions import SettingsError

from chatcore.cache import DEFAULT_EVICTION

DEFAULT_MODEL = "default"
CONFIG_ENV = "CHATCORE_CONFIG"
CONFIG_FILE = "chatcore.toml"
Source = Literal["default", "file", "env", "flag"]


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="CHATCORE_", extra="ignore")

    # Network.
    host: str = Field("127.0.0.1", description="address to listen on; open mode (no API keys) refuses a non-loopback "
                      "one unless insecure_open_mode is set")
    port: int = Field(8000, description="port to listen on")

    # Model and compute.
    model: str = Field(DEFAULT_MODEL, description="a local Hugging Face folder, a local .gguf file (architecture "
                       "llama), a hub id (org/name) from the local HF cache, or 'default' (SmolLM2's GGUF and its "
                       "converted folder)")
    device: str = Field("auto", pattern=r"^(auto|cpu|cuda(:[0-9]+)?)$",
                        description="auto: cuda when torch sees a GPU, else cpu; or cpu, cuda, cuda:N")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto", description="model dtype; auto: bfloat16 on a GPU that supports it (else float16), on the CPU "
        "bfloat16 with AVX-512 BF16/AMX, else float32; with a GGUF's blocks (weights=gguf, or auto where it picks them) float32 activations")
    kv_dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto", description="KV cache storage dtype; auto: the model's dtype (exact)")
    weights: Literal["auto", "full", "gguf", "int8"] = Field(
        "auto", description="auto: gguf for a model given as a .gguf file, and on a CPU without native bfloat16 "
        "matmuls (AVX2, AVX-512F), else full "
        "(on an AVX512-BF16/AMX CPU full bfloat16 decodes as fast and prefills 2-4x faster than float32 over the "
        "blocks, docs/kernels.md); gguf: on the CPU, a GGUF model (the default model, or model=PATH.gguf) serves "
        "its own quantized blocks (Q4_0, Q4_1, Q8_0: the decoder's linears and the LM head), any other model "
        "as full; full: the linears in the model's dtype (a GGUF dequantized); int8: the decoder "
        "layers' linears as int8 weights (torchao, AWQ scales found at load; CPU only), the LM head and the rest "
        "in the model's dtype")
    quant_isa: Literal["auto", "avx512vnni", "avx2int8", "avx512bf16", "avx512f", "avx2", "reference"] = Field(
        "auto", description="with a GGUF's blocks: the few-row products' path; auto: the best this CPU runs "
        "(integer dot products: avx512vnni, else avx2int8), or a lower one forced (float: avx512bf16, avx512f, avx2; "
        "reference: torch); a path this CPU lacks is refused at load (docs/kernels.md)")
    threads: int = Field(0, description="torch threads; 0 keeps torch's default")
    cuda_graphs: bool = Field(True, description="on CUDA: capture the decode step as CUDA graphs at start, one per "
                              "batch size up to max_num_seqs (prefill runs eagerly)")

    # KV cache.
    block_size: int = Field(16, ge=1, description="tokens per KV block")
    kv_cache_gb: Annotated[float, Field(gt=0)] | Literal["auto"] = Field(
        "auto", description="KV pool budget in GiB; auto: a quarter of the available RAM on the CPU, "
        "gpu_memory_fraction of the free GPU memory on CUDA")
    num_blocks: int | None = Field(None, ge=1, description="overrides kv_cache_gb")
    gpu_memory_fraction: float = Field(
        0.85, gt=0, le=1, description="on CUDA with kv_cache_gb=auto: the share of the GPU memory left after "
        "loading the model that the KV pool takes")
    low_watermark: float = Field(0.15, ge=0, lt=1, description="share of free blocks below which admission stops")
    high_watermark: float = Field(0.30, ge=0, lt=1, description="share of free blocks above which the pool may shrink")
    cache_scope: Literal["global", "tenant"] = Field(
        "tenant", description="tenant: prefix blocks are shared within a tenant only; global: across tenants, "
        "which lets one tenant learn, from cached_tokens or timing, whether another's prompt starts with a guess")
    eviction_policy: Literal["lru", "cost", "session"] = Field(
        DEFAULT_EVICTION, description="session: whole conversations, the one expected back last first")
    debug_audit: bool = Field(False, description="audit the cache after every engine step")

    # Scheduler.
    max_batch_tokens: Annotated[int, Field(ge=16)] | Literal["auto"] = Field(
        "auto", description="tokens per engine step; auto: 512 on the CPU, 8192 on CUDA")
    max_num_seqs: Annotated[int, Field(ge=1)] | Literal["auto"] = Field(
        "auto", description="running sequences per engine step at most; auto: 64 on the CPU, 256 on CUDA")
    max_queue_wait_s: float = Field(30.0, gt=0, description="a request waiting longer fails with busy")
    max_waiting_requests: int = Field(1024, ge=1, description="requests queued for the engine at most; past it: busy")

    # Paths.
    cache_dir: Path = Field(Path("~/.cache/chatcore"), description="converted models")
    data_dir: Path = Field(Path("~/.local/share/chatcore"), description="database and disk tier")
    database_url: str | None = Field(None, description="any SQLAlchemy async URL; default: SQLite in data_dir")
    sqlite_synchronous: Literal["NORMAL", "FULL"] = Field(
        "NORMAL", description="NORMAL: a power loss may lose the last acknowledged turns; FULL: fsync every commit")
    kv_disk_dir: Path | None = Field(None, description="disk tier folder; default: kv under data_dir")
    kv_disk_gb: Annotated[float, Field(ge=0)] | Literal["auto"] = Field(
        "auto", description="disk tier budget in GiB (0: off); auto: a fifth of the free disk, 1-64 GiB")

    # Sessions.
    hot_window_s: float = Field(30.0, ge=0, description="seconds a session stays pinned after its turn")
    max_hot_sessions: int = Field(256, ge=1, description="sessions pinned at once at most")
    pinned_kv_fraction: float = Field(0.5, gt=0, le=1, description="share of the pool hot sessions may pin")
    warm_idle_s: float = Field(600.0, ge=0, description="idle seconds before a session goes cold")
    disconnect_grace_s: float = Field(30.0, ge=0, description="a turn whose client left is cancelled after this")
    context_policy: Literal["truncate", "reject"] = Field(
        "truncate", description="a session turn that would overflow the context: truncate drops its oldest "
        "exchanges from the model's view (never the system prompt); reject refuses it (too_large)")
    context_low_water: float = Field(
        0.5, gt=0, le=1, description="truncate drops exchanges until the prompt is at most this share of the context")

    # Replicas (docs/deploy.md): who owns a session, and for how long without renewal.
    replica_id: str | None = Field(None, max_length=200, description="default: hostname and a hash of data_dir")
    lease_s: float = Field(15.0, gt=0, description="a session lease lapses this long after its last renewal")

    # Limits.
    max_frame_bytes: int = Field(65536, ge=256, description="largest WebSocket frame a client may send")
    max_message_tokens: int = Field(4096, ge=1, description="tokens in one user message at most")
    max_tokens_limit: int = Field(2048, ge=1, description="the largest max_tokens a request may ask for")
    max_context: int | None = Field(
        None, ge=32, description="tokens of context per sequence (prompt + answer); default: the model's window")
    max_sessions_per_tenant: int = Field(1000, ge=1, description="stored sessions per tenant at most")
    max_turns_per_tenant: int = Field(
        16, ge=1, description="sequences (a request's n, or its beam width) a tenant has in flight at once at most, "
        "in keyed mode; in open mode (no keys: every client is one tenant) the bound is max_num_seqs + "
        "max_waiting_requests; past it: busy")
    import_context_multiple: float = Field(
        8.0, gt=0, description="an import's history holds at most this many contexts (max_context), in tokens, "
        "and 8 characters a token before it is tokenized; past it: too_large")
    max_concurrent_imports: int = Field(1, ge=1, description="imports tokenizing at once, server-wide, at most (they "
                                        "share the tokenizer thread with every turn); past it: busy")
    max_stored_chars_per_tenant: int = Field(
        50_000_000, ge=1, description="characters of stored messages (turns, their other answers, system prompts) "
        "per tenant at most; a write that would pass it (an import, a branch, a session's system prompt, a turn: "
        "its message plus its answers' worst case) is refused (too_large)")
    max_connections: int = Field(1000, ge=1, description="open connections (HTTP and WebSocket) at most; past it a "
                                 "request or upgrade gets 503")
    header_timeout_s: float = Field(10.0, gt=0, description="a connection whose request headers are not complete "
                                    "this long after it opened (or after its last response) is closed")
    body_timeout_s: float = Field(30.0, gt=0, description="a request whose body has not arrived in full this long "
                                  "after its headers did gets 408 and its connection is closed")
    max_connections_per_tenant: Annotated[int, Field(ge=1)] | Literal["auto"] = Field(
        "auto", description="a tenant's open WebSockets and HTTP requests in flight, at most; auto: half of "
        "max_connections, so no tenant holds them all; past it a request gets busy (429) and a socket an error "
        "frame and a close (1008)")
    socket_idle_timeout_s: float = Field(
        300.0, gt=0, description="a WebSocket that has sent no frame (a ping counts) and runs no turn for this "
        "long is closed (4408, naming this setting); a client that pings stays open")
    max_unauthenticated_sockets_per_address: int = Field(
        8, ge=1, description="WebSockets from one client address waiting for their auth frame at once, at most; "
        "past it the socket gets busy and is closed (1008)")
    max_history_reads_per_minute: int = Field(
        30, ge=1, description="hello and history frames a WebSocket may send a minute; past it: busy")
    history_page_messages: int = Field(
        100, ge=2, description="messages (whole exchanges) a session or history frame carries at most")
    max_schema_bytes: int = Field(
        32768, ge=64, description="a response_format (or required tool call) JSON schema's size as compact JSON, in "
        "bytes, at most (the tools' parameters summed)")
    max_schema_depth: int = Field(
        32, ge=2, description="a JSON schema's nesting depth at most: levels of objects and arrays below its "
        "own object")
    max_schema_enum_values: int = Field(1000, ge=1, description="enum values in a JSON schema at most (all enums)")
    grammar_compile_threads: int = Field(
        4, ge=1, description="JSON schemas compiling into grammars at once at most, each on its own low-priority "
        "thread; a tenant may use half of them; past either: busy")
    grammar_compile_timeout_s: float = Field(
        10.0, gt=0, description="a schema not compiled within this is refused (bad_request); its compile finishes "
        "in the background, holding its thread")
    grammar_cache_mb: int = Field(
        64, ge=0, description="compiled grammars kept for reuse, in MiB of the memory they hold as measured, "
        "grammars running requests still hold included (0: none kept)")
    grammar_mask_share: float = Field(
        0.25, gt=0, le=4, description="the part of a step's forward time that grammar masks may add to the step, "
        "split evenly among the tenants with requests; a tenant's constrained rows past its part wait a step")
    allowed_origins: list[str] = Field(default_factory=list, description="browser origins allowed besides the "
                                       "server's own, for HTTP (with CORS headers) and the WebSocket")
    allowed_hosts: list[str] = Field(default_factory=list, description="Host names open mode answers besides loopback")
    insecure_open_mode: bool = Field(
        False, description="serve without API keys even off loopback (a bind address or ALLOWED_HOSTS): no access control")
    metrics_auth: Literal["key", "open"] = Field(
        "key", description="key: in keyed mode /metrics needs an API key, as every other route (a scraper's "
        "Bearer key); open: /metrics answers anyone. Open mode has no keys, so /metrics is open there either way")

    # Logs.
    log_format: Literal["text", "json"] = Field(
        "text", description="text: one readable line per record; json: one JSON object per line, with a turn's "
        "fields as keys")

    @model_validator(mode="after")
    def _expand(self) -> Settings:
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
    def resolved_max_connections_per_tenant(self) -> int:
        if self.max_connections_per_tenant != "auto":
            return self.max_connections_per_tenant
        return max(1, self.max_connections // 2)

    @property
    def resolved_kv_disk_dir(self) -> Path:
        return self.kv_disk_dir if self.kv_disk_dir is not None else self.data_dir / "kv"


class ConfigError(ValueError):
    """A configuration that cannot be used, said in one line."""


@dataclass(frozen=True)
class Config:
    settings: Settings
    sources: dict[str, Source]  # per field: the layer its value came from
    file: Path | None


def config_file(named: str | Path | None = None) -> Path | None:
    """The TOML file to read: `named` (--config), else CHATCORE_CONFIG, else ./chatcore.toml if present."""
    named = named or os.environ.get(CONFIG_ENV)
    if not named:
        local = Path(CONFIG_FILE)
        return local if local.is_file() else None
    path = Path(named).expanduser()
    if not path.is_file():
        raise ConfigError(f"config file {path} not found")
    return path


def _file_values(path: Path) -> dict[str, Any]:
    try:
        values = TomlConfigSettingsSource(Settings, toml_file=path).toml_data
    except ValueError as exc:  # tomllib.TOMLDecodeError
        raise ConfigError(f"{path} is not valid TOML: {exc}") from None
    unknown = sorted(set(values) - set(Settings.model_fields))
    if unknown:
        raise ConfigError(f"{path}: unknown setting(s) {', '.join(unknown)} (`chatcore config show` lists them)")
    return values


def load_config(flags: Mapping[str, object] | None = None, config: str | Path | None = None) -> Config:
    """Settings from flags (values that are not None) over the environment over the file over the defaults."""
    path = config_file(config)
    try:
        env = EnvSettingsSource(Settings)()
    except SettingsError as exc:
        raise ConfigError(str(exc)) from None
    layers: dict[Source, dict[str, Any]] = {
        "flag": {k: v for k, v in (flags or {}).items() if v is not None},
        "env": env,
        "file": _file_values(path) if path else {},
    }
    sources: dict[str, Source] = {name: next((s for s, values in layers.items() if name in values), "default")
                                  for name in Settings.model_fields}
    try:
        settings = Settings(**{**layers["file"], **layers["env"], **layers["flag"]})
    except ValidationError as exc:
        raise ConfigError(_one_line(exc, sources, path)) from None
    return Config(settings, sources, path)


def _one_line(exc: ValidationError, sources: Mapping[str, Source], path: Path | None) -> str:
    """Each problem as `name (from where): what is wrong`, the offending values left out (they may be secrets)."""
    where = {"default": "default", "file": f"file {path}", "env": "environment", "flag": "flag"}
    problems = []
    for error in exc.errors():
        name = str(error["loc"][0]) if error["loc"] else ""
        origin = f" ({where[sources[name]]})" if name in sources else ""
        problems.append(f"{name}{origin}: {error['msg']}" if name else error["msg"])
    return "invalid settings: " + "; ".join(problems)


def load_settings(**overrides: object) -> Settings:
    """`load_config(overrides).settings`: overrides (CLI flags) that are not None win."""
    return load_config(overrides).settings
