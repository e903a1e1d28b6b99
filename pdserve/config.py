"""Configuration as types: each service's configuration (`GatewayConfig`, `PrefillConfig`, `DecodeConfig`,
`ColocatedConfig`, `StackConfig`) is a frozen dataclass of option groups (`pdserve.options`), built once from the
parsed flags (`pdserve.flags.from_args`). `pdserve up` renders its children's argument lists from the same objects,
and the services take them whole, so a flag, its default and its help text exist in one place."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pdserve.options import (
    APIKeyOptions,
    DecodeOptions,
    DrainOptions,
    EngineOptions,
    GatewayOptions,
    HTTPOptions,
    LocalPrefillOptions,
    MigrationOptions,
    ObservabilityOptions,
    PrefillWorkersOptions,
    QueueOptions,
    RoutingOptions,
    ServerOptions,
    TLSOptions,
    TokenizerOptions,
    UpOptions,
    WorkerOptions,
)


@dataclass(frozen=True)
class GatewayConfig:
    server: ServerOptions
    model: TokenizerOptions
    prefill: PrefillWorkersOptions
    gateway: GatewayOptions
    routing: RoutingOptions
    migration: MigrationOptions
    http: HTTPOptions
    observability: ObservabilityOptions
    tls: TLSOptions
    api_key: APIKeyOptions


@dataclass(frozen=True)
class PrefillConfig:
    server: ServerOptions
    engine: EngineOptions
    worker: WorkerOptions
    observability: ObservabilityOptions
    tls: TLSOptions


@dataclass(frozen=True)
class DecodeConfig:
    server: ServerOptions
    engine: EngineOptions
    worker: WorkerOptions
    decode: DecodeOptions
    prefill: PrefillWorkersOptions
    local_prefill: LocalPrefillOptions
    queue: QueueOptions
    drain: DrainOptions
    observability: ObservabilityOptions
    tls: TLSOptions


@dataclass(frozen=True)
class ColocatedConfig:
    """A worker that prefills every prompt itself: a decode worker without the flags about prefill workers."""

    server: ServerOptions
    engine: EngineOptions
    worker: WorkerOptions
    queue: QueueOptions
    drain: DrainOptions
    observability: ObservabilityOptions
    tls: TLSOptions

    def as_decode(self) -> DecodeConfig:
        """The decode worker's configuration it runs with: no prefill workers, no local-prefill threshold."""
        return DecodeConfig(
            self.server,
            self.engine,
            self.worker,
            DecodeOptions(),
            PrefillWorkersOptions(),
            LocalPrefillOptions(0),
            self.queue,
            self.drain,
            self.observability,
            self.tls,
        )


@dataclass(frozen=True)
class StackConfig:
    """`pdserve up`: the whole stack on this machine."""

    server: ServerOptions
    engine: EngineOptions
    up: UpOptions
    http: HTTPOptions
    routing: RoutingOptions
    migration: MigrationOptions
    local_prefill: LocalPrefillOptions
    observability: ObservabilityOptions
    tls: TLSOptions
    api_key: APIKeyOptions


# command -> its configuration and the defaults it gives some fields
COMMANDS: dict[str, tuple[type, dict[str, Any]]] = {
    "up": (StackConfig, {"port": 50051, "metrics_port": 9400}),
    "gateway": (GatewayConfig, {"port": 50051, "metrics_port": 9400}),
    "prefill": (PrefillConfig, {"port": 50061, "metrics_port": 9401}),
    "decode": (DecodeConfig, {"port": 50071, "metrics_port": 9402}),
    "colocated": (ColocatedConfig, {"port": 50071, "metrics_port": 9402}),
}
