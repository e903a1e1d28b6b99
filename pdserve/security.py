"""Who may call a pdserve service: TLS on every gRPC hop (mutual between services) and an API key on the public API.

One certificate per service serves two roles: its server identity, and its client identity when it calls another
service (gateway -> workers, decode -> prefill). With a CA bundle (`--tls-ca`) a service verifies the servers
it calls, and a *worker* also requires every caller to present a certificate signed by that CA: workers take
calls only from other services. The gateway's public port verifies no client certificate; an API key guards it
instead (`authorization: Bearer <key>` metadata, or the OpenAI API's header). Health checks stay open so
orchestrators can probe without credentials.
"""

from __future__ import annotations

import hmac
import os
from dataclasses import dataclass
from pathlib import Path

import grpc

OPEN_METHODS = ("/grpc.health.v1.Health/", "/grpc.reflection.")


@dataclass(frozen=True)
class TLSConfig:
    cert: str | None = None  # PEM certificate chain of this service
    key: str | None = None  # its private key
    ca: str | None = None  # PEM bundle of the CA(s) that sign the other services' certificates
    # the name peers' certificates are checked against instead of the address dialled: workers found through
    # DNS are dialled by IP (Kubernetes pod IPs change), so one shared name in the certificates stands for them
    server_name: str | None = None

    def channel_options(self) -> list[tuple[str, str]]:
        return [("grpc.ssl_target_name_override", self.server_name)] if self.server_name else []

    @property
    def enabled(self) -> bool:
        return bool(self.cert and self.key)

    def check(self) -> None:
        """ValueError naming what is missing or unreadable."""
        if bool(self.cert) != bool(self.key):
            raise ValueError("TLS needs both --tls-cert and --tls-key")
        for name, path in (("--tls-cert", self.cert), ("--tls-key", self.key), ("--tls-ca", self.ca)):
            if path and not Path(path).is_file():
                raise ValueError(f"{name} {path}: no such file")

    def _read(self, path: str | None) -> bytes | None:
        return Path(path).read_bytes() if path else None

    def server_credentials(self, require_client_cert: bool) -> grpc.ServerCredentials | None:
        if not self.enabled:
            return None
        client_ca = self._read(self.ca) if require_client_cert else None
        return grpc.ssl_server_credentials(
            [(self._read(self.key), self._read(self.cert))],
            root_certificates=client_ca,
            require_client_auth=client_ca is not None,
        )

    def channel_credentials(self) -> grpc.ChannelCredentials | None:
        """Credentials to call another service: verify it with the CA, present this service's certificate."""
        if not (self.ca or self.enabled):
            return None
        return grpc.ssl_channel_credentials(
            root_certificates=self._read(self.ca),
            private_key=self._read(self.key) if self.enabled else None,
            certificate_chain=self._read(self.cert) if self.enabled else None,
        )


def api_key_from_env() -> str | None:
    return os.environ.get("PDSERVE_API_KEY") or None


def key_matches(presented: str | None, key: str) -> bool:
    """`presented` is an `authorization` value ("Bearer <key>") or the bare key; compared in constant time."""
    if not presented:
        return False
    token = presented[7:] if presented[:7].lower() == "bearer " else presented
    return hmac.compare_digest(token.strip().encode(), key.encode())


class ApiKeyInterceptor(grpc.aio.ServerInterceptor):
    """Refuses every RPC but health and reflection without `authorization: Bearer <key>` (UNAUTHENTICATED)."""

    def __init__(self, key: str) -> None:
        self.key = key

    async def intercept_service(self, continuation, details: grpc.HandlerCallDetails):
        handler = await continuation(details)
        if handler is None or details.method.startswith(OPEN_METHODS):
            return handler
        presented = dict(details.invocation_metadata or ()).get("authorization")
        if key_matches(presented, self.key):
            return handler
        message = "missing or wrong API key: send metadata 'authorization: Bearer <key>'"

        async def deny(request, context):
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

        async def deny_stream(request, context):
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)
            yield  # pragma: no cover - makes this an async generator, as streaming handlers are

        kind = (
            grpc.unary_stream_rpc_method_handler
            if handler.unary_stream
            else grpc.stream_stream_rpc_method_handler
            if handler.stream_stream
            else grpc.stream_unary_rpc_method_handler
            if handler.stream_unary
            else grpc.unary_unary_rpc_method_handler
        )
        fn = deny_stream if (handler.unary_stream or handler.stream_stream) else deny
        return kind(
            fn, request_deserializer=handler.request_deserializer, response_serializer=handler.response_serializer
        )
