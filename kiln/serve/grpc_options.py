"""kiln serve's gRPC production options, named as tritonserver names its flags: TLS and mutual TLS, the
compression of inference responses, HTTP/2 keepalive and the policing of clients' pings.

One GrpcOptions serves both transports: grpc.aio gets server credentials and channel arguments (the ones
tritonserver's own gRPC server sets from these flags); kiln's transport (kiln/serve/grpc_h2.py) gets an
ssl.SSLContext (ALPN h2, as gRPC clients require) and reads the rest itself (kiln/serve/h2_keepalive.py,
kiln/serve/grpc_compression.py).

    --grpc-use-ssl, --grpc-server-cert, --grpc-server-key      TLS
    --grpc-use-ssl-mutual, --grpc-root-cert                    mutual TLS: clients show a certificate the root signed
    --grpc-infer-response-compression-level none|low|med|high  gRPC's levels: low gzip, med/high deflate
                                                               (of what the client accepts; requests are
                                                               decompressed whatever the level)
    --grpc-keepalive-time MS, --grpc-keepalive-timeout MS      the server PINGs a connection every MS; no ACK in
                                                               the timeout closes it
    --grpc-keepalive-permit-without-calls                      ... also with no call open (and clients may ping then)
    --grpc-http2-max-pings-without-data N                      server PINGs between two data/header frames (0: any)
    --grpc-http2-min-recv-ping-interval-without-data MS        a client PING sooner than this after the last is a strike
    --grpc-http2-max-ping-strikes N                            past N strikes: GOAWAY ENHANCE_YOUR_CALM too_many_pings
                                                               (0: no limit)

The defaults are tritonserver's (and gRPC core's): keepalive 2 h, timeout 20 s, 2 pings without data, client
pings at most every 5 min without data, 2 strikes.
"""

from __future__ import annotations

import ssl
from dataclasses import dataclass, fields
from pathlib import Path

import grpc

COMPRESSION_LEVELS = ("none", "low", "med", "high")
# gRPC core's grpc_compression_level values (grpc/impl/compression_types.h)
GRPC_COMPRESSION_LEVEL = {"none": 0, "low": 1, "med": 2, "high": 3}
MAX_INT32 = (1 << 31) - 1


class GrpcOptionError(ValueError):
    """A gRPC option's value cannot be served; the message names the flag, the value and what to give."""


@dataclass(frozen=True)
class GrpcOptions:
    use_ssl: bool = False
    server_cert: str | None = None  # PEM: the server's certificate (chain)
    server_key: str | None = None  # PEM: its private key
    root_cert: str | None = None  # PEM: the CA that signs clients' certificates (mutual TLS)
    use_ssl_mutual: bool = False  # implies use_ssl, as in tritonserver
    infer_response_compression_level: str = "none"
    keepalive_time_ms: int = 7_200_000
    keepalive_timeout_ms: int = 20_000
    keepalive_permit_without_calls: bool = False
    http2_max_pings_without_data: int = 2
    http2_min_recv_ping_interval_without_data_ms: int = 300_000
    http2_max_ping_strikes: int = 2

    @property
    def tls(self) -> bool:
        return self.use_ssl or self.use_ssl_mutual

    def check(self) -> None:
        """GrpcOptionError naming the first flag whose value cannot be served."""
        if self.infer_response_compression_level not in COMPRESSION_LEVELS:
            raise GrpcOptionError(f"{flag('infer_response_compression_level')} "
                                  f"{self.infer_response_compression_level!r}: give one of "
                                  f"{', '.join(COMPRESSION_LEVELS)}")
        for name, least in (("keepalive_time_ms", 1), ("keepalive_timeout_ms", 1),
                            ("http2_max_pings_without_data", 0), ("http2_min_recv_ping_interval_without_data_ms", 0),
                            ("http2_max_ping_strikes", 0)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or not least <= value <= MAX_INT32:
                unit = " milliseconds" if name.endswith("_ms") else ""
                raise GrpcOptionError(f"{flag(name)} {value!r}: give an integer from {least} to {MAX_INT32}{unit}")
        if not self.tls:
            given = [flag(name) for name in ("server_cert", "server_key", "root_cert") if getattr(self, name)]
            if given:
                raise GrpcOptionError(f"{', '.join(given)} given without --grpc-use-ssl (or --grpc-use-ssl-mutual): "
                                      "add it, or drop the certificate flags")
            return
        needed = ["server_cert", "server_key"] + (["root_cert"] if self.use_ssl_mutual else [])
        missing = [flag(name) for name in needed if not getattr(self, name)]
        if missing:
            why = "--grpc-use-ssl-mutual" if self.use_ssl_mutual else "--grpc-use-ssl"
            raise GrpcOptionError(f"{why} needs {' and '.join(missing)} (PEM files)")
        for name in needed:
            path = Path(getattr(self, name))
            if not path.is_file():
                raise GrpcOptionError(f"{flag(name)} {str(path)!r}: no such file")
        self.ssl_context()  # a key that does not match its certificate, a file that is not PEM: said now

    def ssl_context(self) -> ssl.SSLContext | None:
        """kiln's transport's TLS: the server's certificate and key, ALPN h2 (gRPC clients refuse a server that
        does not select it), and with mutual TLS a client certificate signed by root_cert required."""
        if not self.tls:
            return None
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.minimum_version = ssl.TLSVersion.TLSv1_2  # RFC 9113 section 9.2: HTTP/2 over TLS 1.2 or later
        try:
            context.load_cert_chain(self.server_cert, self.server_key)
        except (ssl.SSLError, OSError) as e:
            raise GrpcOptionError(f"{flag('server_cert')} {self.server_cert!r} with {flag('server_key')} "
                                  f"{self.server_key!r}: {e} (PEM files of a certificate and its own key)") from None
        context.set_alpn_protocols(["h2"])
        if self.use_ssl_mutual:
            try:
                context.load_verify_locations(cafile=self.root_cert)
            except (ssl.SSLError, OSError) as e:
                raise GrpcOptionError(f"{flag('root_cert')} {self.root_cert!r}: {e} (a PEM CA certificate)") from None
            context.verify_mode = ssl.CERT_REQUIRED
        return context

    def server_credentials(self):
        """grpc.aio's TLS (None: plaintext)."""
        if not self.tls:
            return None
        key, cert = Path(self.server_key).read_bytes(), Path(self.server_cert).read_bytes()
        root = Path(self.root_cert).read_bytes() if self.use_ssl_mutual else None
        return grpc.ssl_server_credentials([(key, cert)], root_certificates=root,
                                           require_client_auth=self.use_ssl_mutual)

    def channel_args(self) -> list[tuple[str, int]]:
        """grpc.aio's server arguments for these options, as tritonserver's gRPC server sets them, and ping_timeout
        so that keepalive_timeout holds; only those that differ from gRPC core's defaults (which are tritonserver's
        defaults too), so that a server with default options is configured as one without."""
        args = []
        if self.infer_response_compression_level != "none":
            level = GRPC_COMPRESSION_LEVEL[self.infer_response_compression_level]
            args.append(("grpc.default_compression_level", level))
        defaults = GrpcOptions()
        for name, arg in (("keepalive_time_ms", "grpc.keepalive_time_ms"),
                          ("keepalive_timeout_ms", "grpc.keepalive_timeout_ms"),
                          ("keepalive_permit_without_calls", "grpc.keepalive_permit_without_calls"),
                          ("http2_max_pings_without_data", "grpc.http2.max_pings_without_data"),
                          ("http2_min_recv_ping_interval_without_data_ms",
                           "grpc.http2.min_ping_interval_without_data_ms"),
                          ("http2_max_ping_strikes", "grpc.http2.max_ping_strikes")):
            value = getattr(self, name)
            if value != getattr(defaults, name):
                args.append((arg, int(value)))
        if self.keepalive_timeout_ms != defaults.keepalive_timeout_ms:
            # gRPC core 1.85 closes a connection on an unanswered PING after ping_timeout (a minute), whatever
            # keepalive_timeout says (measured: keepalive 0.2 s, timeout 0.5 s, still open 25 s later)
            args.append(("grpc.http2.ping_timeout_ms", self.keepalive_timeout_ms))
        return args


_FLAGS = {f.name: "--grpc-" + f.name.removesuffix("_ms").replace("_", "-") for f in fields(GrpcOptions)}


def flag(name: str) -> str:
    """The tritonserver flag of a GrpcOptions field: keepalive_time_ms -> --grpc-keepalive-time."""
    return _FLAGS[name]
