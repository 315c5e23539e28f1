"""Configuration: per-domain frozen dataclasses; the only module that reads the environment.

Every field carries help text and the environment variable that sets it, so each service's
command line (``--nats-url`` ...) and its container form (``DUALPATH_NATS_URL`` ...) are
generated from one definition: ``add_arguments(parser, Cls)`` then ``from_args(Cls, ns)``.
Precedence: command-line flag > environment variable > default.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import typing
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar, cast

if TYPE_CHECKING:
    from dualpath.transfer.tls import TlsConfig

__all__ = [
    "BusConfig",
    "EmulationConfig",
    "EngineConfig",
    "GatewayConfig",
    "KvPersistenceConfig",
    "ModelConfigSpec",
    "NodeConfig",
    "SchedulerConfig",
    "add_arguments",
    "default_of",
    "env_vars",
    "from_args",
]

T = TypeVar("T")


def opt(default: Any, help: str, env: str | None = None, **kw) -> Any:
    """A config field with help text and an environment variable name."""
    return field(default=default, metadata={"help": help, "env": env, **kw})


@dataclass(frozen=True, slots=True, kw_only=True)
class BusConfig:
    nats_url: str = opt("nats://127.0.0.1:4222", "NATS server URL(s), comma-separated for a cluster", "DUALPATH_NATS_URL")
    namespace: str = opt("dualpath", "subject namespace: one deployment per namespace on a shared NATS", "DUALPATH_NAMESPACE")
    nats_creds: str = opt("", "NATS credentials file (.creds); empty = no auth", "DUALPATH_NATS_CREDS")
    nats_user: str = opt("", "NATS user this service connects as (one identity per service: dualpath.bus.auth)", "DUALPATH_NATS_USER")
    nats_password: str = opt(
        "", "the NATS user's password (pass it in the environment: a command line is visible to every local user)", "DUALPATH_NATS_PASSWORD"
    )
    nats_password_file: str = opt("", "file holding the NATS user's password (a mounted secret)", "DUALPATH_NATS_PASSWORD_FILE")
    nats_tls_ca: str = opt("", "CA bundle to verify the NATS server's TLS certificate; empty = no TLS", "DUALPATH_NATS_TLS_CA")
    nats_tls_cert: str = opt("", "client certificate for NATS mutual TLS", "DUALPATH_NATS_TLS_CERT")
    nats_tls_key: str = opt("", "client key for NATS mutual TLS", "DUALPATH_NATS_TLS_KEY")
    metrics_port: int = opt(0, "serve Prometheus metrics on this port, all interfaces (0 = no metrics endpoint)", "DUALPATH_METRICS_PORT")
    nats_ping_s: float = opt(
        2.0,
        "seconds between PINGs to the NATS server; after 3 unanswered the connection is dropped and "
        "another server of the cluster tried (a server cut off by the network sends no RST: without "
        "this a client waits for TCP's own timeouts)",
        "DUALPATH_NATS_PING_S",
    )

    def urls(self) -> list[str]:
        return [u.strip() for u in self.nats_url.split(",") if u.strip()]

    def connect_options(self) -> dict[str, Any]:
        """Keyword arguments for ``nats.connect`` (credentials and TLS when configured)."""
        options: dict[str, Any] = {"ping_interval": self.nats_ping_s, "max_outstanding_pings": 3}
        if self.nats_creds:
            options["user_credentials"] = self.nats_creds
        if self.nats_user:
            # the identity may subscribe only to its own reply inboxes (dualpath.bus.auth.Identity.inbox)
            password = self.nats_password
            if self.nats_password_file:
                with open(self.nats_password_file) as f:
                    password = f.read().strip()
            options.update(user=self.nats_user, password=password, inbox_prefix=f"_INBOX.{self.nats_user}")
        if self.nats_tls_ca or self.nats_tls_cert:
            import ssl

            ctx = ssl.create_default_context(cafile=self.nats_tls_ca or None)
            if self.nats_tls_cert:
                ctx.load_cert_chain(self.nats_tls_cert, self.nats_tls_key or None)
            options["tls"] = ctx
        return options


@dataclass(frozen=True, slots=True, kw_only=True)
class ModelConfigSpec:
    model: str = opt("", "model checkpoint directory (Hugging Face layout)", "DUALPATH_MODEL")
    model_name: str = opt("", "name served in the API (default: the directory name)", "DUALPATH_MODEL_NAME")
    device: str = opt("cpu", "torch device for engines: cpu, cuda, cuda:N", "DUALPATH_DEVICE")
    dtype: str = opt(
        "", "KV/compute dtype: float32, bfloat16, float16 (default: float32 on CPU, checkpoint dtype on GPU)", "DUALPATH_DTYPE"
    )
    block_tokens: int = opt(64, "tokens per KV block (hash-chain granularity)", "DUALPATH_BLOCK_TOKENS")


@dataclass(frozen=True, slots=True, kw_only=True)
class NodeConfig:
    node_id: str = opt("node0", "this node's id (subject-safe: letters, digits, _ and -)", "DUALPATH_NODE_ID")
    storage: str = opt("./.dualpath/storage", "storage root holding Full Block files (local dir or a shared mount)", "DUALPATH_STORAGE")
    storage_fsync: bool = opt(
        True,
        "fsync each block file and its directory before the block is indexed (false: leave "
        "durability to the storage system; the testbed, whose SNIC models the write time)",
        "DUALPATH_STORAGE_FSYNC",
    )
    storage_direct: bool = opt(
        False,
        "read and write block files with O_DIRECT (bypass the page cache; buffered where the filesystem has no direct I/O)",
        "DUALPATH_STORAGE_DIRECT",
    )
    buffer_mb: int = opt(1024, "node DRAM buffer size in MiB (PE buffer on prefill nodes, DE buffer on decode nodes)", "DUALPATH_BUFFER_MB")
    transport: str = opt("tcp", "data-plane transport between nodes: tcp or verbs", "DUALPATH_TRANSPORT")
    data_host: str = opt("127.0.0.1", "address the data-plane endpoint listens on and advertises", "DUALPATH_DATA_HOST")
    data_tls: bool = opt(
        False,
        "run the tcp data plane over mutual TLS 1.3 (links that leave a trusted fabric; every node of a "
        "deployment must agree); needs --data-tls-ca, --data-tls-cert and --data-tls-key",
        "DUALPATH_DATA_TLS",
    )
    data_tls_ca: str = opt("", "data-plane TLS: the CA bundle that signs every data-plane host's certificate", "DUALPATH_DATA_TLS_CA")
    data_tls_cert: str = opt(
        "", "data-plane TLS: this host's certificate (its --data-host among the subject alternative names)", "DUALPATH_DATA_TLS_CERT"
    )
    data_tls_key: str = opt("", "data-plane TLS: the private key of --data-tls-cert", "DUALPATH_DATA_TLS_KEY")
    report_interval: float = opt(0.2, "seconds between state reports to the scheduler", "DUALPATH_REPORT_INTERVAL")
    prefetch_mb: int = opt(0, "agent-aware prefetch cache per node, MiB (0: off; a hint cache outside the buffer)", "DUALPATH_PREFETCH_MB")
    prefetch_ttl_s: float = opt(60.0, "seconds a prefetched block is kept for the session's next turn", "DUALPATH_PREFETCH_TTL")
    reclaim_after_s: float = opt(
        30.0,
        "seconds after another scheduler instance became active before the buffer slots the old one "
        "reserved, and nothing has used, are given back (its in-flight prefills hand off before that)",
        "DUALPATH_RECLAIM_AFTER_S",
    )

    def data_tls_config(self) -> TlsConfig | None:
        """The ``transfer.tls.TlsConfig`` of ``--data-tls`` (None when off).

        Raises:
            ValueError: ``data_tls`` is on but a file is not named.
        """
        if not self.data_tls:
            return None
        from dualpath.transfer.tls import TlsConfig

        missing = [f"--data-tls-{n}" for n in ("ca", "cert", "key") if not getattr(self, f"data_tls_{n}")]
        if missing:
            raise ValueError(f"--data-tls needs {', '.join(missing)}")
        return TlsConfig(ca=self.data_tls_ca, cert=self.data_tls_cert, key=self.data_tls_key)


@dataclass(frozen=True, slots=True, kw_only=True)
class EngineConfig:
    engine_id: str = opt("engine0", "this engine's id (one engine per GPU)", "DUALPATH_ENGINE_ID")
    compute_quota_ms: float = opt(
        300.0,
        "prefill: compute quota per batch (paper §6.2): requests are packed FIFO while the "
        "predicted batch time stays within it, the one that would exceed it cut to a "
        "block-aligned chunk",
        "DUALPATH_COMPUTE_QUOTA_MS",
    )
    kv_capacity_tokens: int = opt(65536, "decode: tokens of KV the engine may hold (its 'HBM')", "DUALPATH_KV_CAPACITY_TOKENS")
    max_running: int = opt(64, "decode: most requests decoded together", "DUALPATH_MAX_RUNNING")
    torch_threads: int = opt(1, "CPU threads for torch in this engine (several engines share a host's cores)", "DUALPATH_TORCH_THREADS")
    stream_interval: int = opt(
        1, "decode: tokens per streamed event (like vLLM's --stream-interval; >1 saves CPU)", "DUALPATH_STREAM_INTERVAL"
    )
    layerwise: bool = opt(
        True,
        "prefill: bring each layer's cached KV in just before the layer, overlapped with compute "
        "(false: load every layer before computing and send the KV after, the ablation's baseline)",
        "DUALPATH_LAYERWISE",
    )


@dataclass(frozen=True, slots=True, kw_only=True)
class EmulationConfig:
    compute: str = opt("torch", "compute backend: torch (real model) or modeled (cost-model time, no math)", "DUALPATH_COMPUTE")
    target: str = opt(
        "ds27b",
        "modeled target model: a name (ds660b, ds27b, qwen32b, dsv3) or a path to a model's config.json (any supported architecture)",
        "DUALPATH_TARGET",
    )
    gpu: str = opt("h800", "modeled GPU: h800, h100", "DUALPATH_GPU")
    scale: float = opt(
        1000.0,
        "testbed scale factor: bytes and bandwidths are divided by it (times preserved); "
        "the launchers pass 1 with a real model (compute torch)",
        "DUALPATH_SCALE",
    )
    gpus_per_node: int = opt(8, "emulated GPUs per node (the SNIC is shared by them)", "DUALPATH_GPUS_PER_NODE")
    engines_per_node: int = opt(
        0, "engine processes per node (0 = gpus per node); the SNIC shrinks in proportion", "DUALPATH_ENGINES_PER_NODE"
    )
    snic_gbps: float = opt(0.0, "emulated storage NIC per node, Gbit/s before scaling (0 = not emulated)", "DUALPATH_SNIC_GBPS")
    cnic_gbps: float = opt(0.0, "emulated compute NIC per GPU, Gbit/s before scaling (0 = not emulated)", "DUALPATH_CNIC_GBPS")
    oracle: bool = opt(False, "oracle mode: no storage reads and no KV transfers (hits are free)", "DUALPATH_ORACLE")
    slowdown: float = opt(
        1.0,
        "testbed slow motion: modeled times x this and NIC rates / this, so the host's own "
        "overhead shrinks in proportion (reported times are divided back)",
        "DUALPATH_SLOWDOWN",
    )
    model_traffic: str = opt(
        "auto",
        "modeled expert-parallel all-to-all of MoE targets on the emulated CNIC (MODEL class): "
        "auto (the share crossing nodes; none when EP fits one node), on (every remote EP "
        "rank through the CNIC), off",
        "DUALPATH_MODEL_TRAFFIC",
    )
    nic_classes: int = opt(
        2,
        "traffic classes of the emulated CNICs: 2 (model traffic first, KV low priority) or 1 (one FIFO queue for both: no isolation)",
        "DUALPATH_NIC_CLASSES",
    )

    @property
    def modeled(self) -> bool:
        return self.compute == "modeled"

    def byte_scale(self) -> float:
        """What KV bytes are really divided by: modeled KV has a whole, even number of bytes per
        token and layer, so the nominal ``scale`` is corrected to the ratio actually used."""
        if not self.modeled:
            return self.scale
        from dualpath.cost import cost_model
        from dualpath.testbed.profile import scaled_bytes_per_token_layer

        kv = cost_model(self.target, self.gpu).target.kv_bytes_per_token_layer
        return kv / scaled_bytes_per_token_layer(kv, self.scale)

    def profile(self):
        """The ``HardwareProfile`` these settings describe (NIC figures 400 Gbit/s when unset)."""
        from dualpath.testbed.profile import HardwareProfile

        return HardwareProfile(
            gpus_per_node=self.gpus_per_node,
            cnic_gbps=self.cnic_gbps or 400.0,
            snic_gbps=self.snic_gbps or 400.0,
            scale=self.byte_scale(),
            slowdown=self.slowdown,
        )

    def engines(self) -> int:
        return self.engines_per_node or self.gpus_per_node

    def validate(self) -> None:
        """Check the settings before anything starts.

        Raises:
            ValueError: a scale below 1, a slowdown not positive, or a negative NIC rate.
            LookupError: an unknown modeled target or GPU (``dualpath.cost.errors``).
        """
        if self.snic_gbps < 0 or self.cnic_gbps < 0:
            raise ValueError(f"NIC rates must not be negative (snic {self.snic_gbps:g}, cnic {self.cnic_gbps:g} Gbit/s)")
        if self.model_traffic not in ("auto", "on", "off") or self.nic_classes not in (1, 2):
            raise ValueError(
                f"model_traffic must be auto, on or off and nic_classes 1 or 2 (got {self.model_traffic!r}, {self.nic_classes})"
            )
        if self.modeled:
            from dualpath.cost import cost_model

            cost_model(self.target, self.gpu)
        self.profile()


@dataclass(frozen=True, slots=True, kw_only=True)
class SchedulerConfig:
    policy: str = opt("dualpath", "scheduling policy: dualpath, round_robin, least_tokens", "DUALPATH_POLICY")
    read_path: str = opt("auto", "which side reads hit KV: auto (scheduler decides), pe, de, split (both)", "DUALPATH_READ_PATH")
    prefetch: bool = opt(
        False, "agent-aware prefetch: when a session's turn ends, hint its blocks to its prefill node", "DUALPATH_PREFETCH"
    )
    engine_timeout: float = opt(3.0, "seconds without a report after which an engine is considered dead", "DUALPATH_ENGINE_TIMEOUT")
    max_queue: int = opt(10000, "most requests waiting in the scheduler; more are refused with 429", "DUALPATH_MAX_QUEUE")
    max_attempts: int = opt(3, "dispatch attempts per request before it fails", "DUALPATH_MAX_ATTEMPTS")
    urgent_wait: float = opt(
        3.0,
        "seconds a request may wait before it goes ahead of every fresher one (online TTFT); inf: never "
        "(a rollout judged by its job completion time: the queue keeps its longest-decode-first order)",
        "DUALPATH_URGENT_WAIT",
    )


@dataclass(frozen=True, slots=True, kw_only=True)
class KvPersistenceConfig:
    index_path: str = opt("", "trie index log file (default: <storage>/index.log)", "DUALPATH_INDEX_PATH")
    capacity_blocks: int = opt(0, "most blocks indexed before LRU eviction of leaves (0 = unbounded)", "DUALPATH_CAPACITY_BLOCKS")
    replication: str = opt(
        "none",
        "none: one replica, index in a local log; jetstream: replicas share an index replicated "
        "through a NATS JetStream stream (survives the loss of any one replica)",
        "DUALPATH_INDEX_REPLICATION",
    )
    replica_id: int = opt(0, "this replica's number (logs and metrics only)", "DUALPATH_REPLICA_ID")
    stream_replicas: int = opt(3, "copies of the index stream JetStream keeps (fewer on a smaller cluster)", "DUALPATH_STREAM_REPLICAS")


@dataclass(frozen=True, slots=True, kw_only=True)
class GatewayConfig:
    host: str = opt("127.0.0.1", "HTTP listen address", "DUALPATH_HOST")
    port: int = opt(8000, "HTTP listen port", "DUALPATH_PORT")
    api_key: str = opt(
        "", "require 'Authorization: Bearer <key>' (or x-api-key) when set; its callers are tenant 'default'", "DUALPATH_API_KEY"
    )
    api_key_file: str = opt(
        "",
        "file of 'KEY TENANT [max_concurrency=N] [tokens_per_minute=N]' lines: each caller's tenant (its own KV cache "
        "namespace and limits); blank lines and # comments allowed",
        "DUALPATH_API_KEY_FILE",
    )
    tenant_max_concurrency: int = opt(
        0, "requests a tenant may have in flight; more get 429 with Retry-After (0 = no limit)", "DUALPATH_TENANT_MAX_CONCURRENCY"
    )
    tenant_tokens_per_minute: int = opt(
        0,
        "prompt plus generated tokens a tenant may use per minute; beyond, 429 with Retry-After (0 = no limit)",
        "DUALPATH_TENANT_TOKENS_PER_MINUTE",
    )
    gateway_id: str = opt("gw0", "this gateway's id (token streams are addressed to it)", "DUALPATH_GATEWAY_ID")
    request_timeout: float = opt(600.0, "seconds before an unfinished request fails with 504", "DUALPATH_REQUEST_TIMEOUT")
    max_prompt_tokens: int = opt(0, "refuse longer prompts (0 = the model's context length)", "DUALPATH_MAX_PROMPT_TOKENS")
    prefix_cache: bool = opt(True, "reuse persisted KV blocks (false: every prompt is a full recompute)", "DUALPATH_PREFIX_CACHE")
    tool_parser: str = opt(
        "auto", "tool-call format of the model's output: auto (from the chat template), hermes, llama3_json", "DUALPATH_TOOL_PARSER"
    )
    reasoning_parser: str = opt(
        "",
        "split <think>…</think> off chat answers as reasoning: deepseek_r1, qwen3 ('' = none)",
        "DUALPATH_REASONING_PARSER",
    )
    responses_ttl_s: float = opt(
        7 * 24 * 3600.0, "seconds a stored /v1/responses answer is kept (the shared JetStream bucket's TTL)", "DUALPATH_RESPONSES_TTL_S"
    )


def parse_bool(text: str) -> bool:
    """``true/1/yes/on`` or ``false/0/no/off`` (any case).

    Raises:
        ValueError: anything else.
    """
    value = str(text).strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"{text!r} is not a boolean (use true or false)")


def _converter(kind: type):
    return parse_bool if kind is bool else kind


def env_vars(*classes: type) -> dict[str, str]:
    """All environment variable names the given config classes read, with their help text."""
    out = {}
    for cls in classes:
        for f in dataclasses.fields(cls):
            if f.metadata.get("env"):
                out[f.metadata["env"]] = f.metadata["help"]
    return out


def add_arguments(parser: argparse.ArgumentParser, cls: type, *, skip: tuple[str, ...] = ()) -> None:
    """Add one ``--flag`` per field of ``cls`` (help text shows the env variable and default)."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if f.name in skip:
            continue
        env = f.metadata.get("env")
        kind = hints[f.name]
        help_text = f"{f.metadata.get('help', '')} [env {env}; default {f.default!r}]" if env else f.metadata.get("help", "")
        parser.add_argument("--" + f.name.replace("_", "-"), dest=f.name, type=_converter(kind), default=None, help=help_text)


def default_of(cls: type[Any], name: str) -> Any:
    """The default of field ``name`` of config class ``cls``: launchers take their flags' defaults
    from here, so ``dualpath up`` and a service run alone agree on them."""
    return cls.__dataclass_fields__[name].default


def from_args(cls: type[T], ns: argparse.Namespace | None = None, **overrides: Any) -> T:
    """Build ``cls``: explicit overrides > command-line value > environment > default.

    Raises:
        ValueError: an environment variable cannot be converted to the field's type.
    """
    hints = typing.get_type_hints(cls)
    values: dict[str, Any] = {}
    for f in dataclasses.fields(cast(Any, cls)):  # a config dataclass
        if f.name in overrides and overrides[f.name] is not None:
            values[f.name] = overrides[f.name]
            continue
        cli = getattr(ns, f.name, None) if ns is not None else None
        if cli is not None:
            values[f.name] = cli
            continue
        env = f.metadata.get("env")
        if env and env in os.environ:
            try:
                values[f.name] = _converter(hints[f.name])(os.environ[env])
            except ValueError:
                raise ValueError(f"environment variable {env}={os.environ[env]!r} is not a valid {hints[f.name].__name__}") from None
    return cls(**values)
