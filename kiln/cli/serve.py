"""kiln serve: a Triton-compatible server (HTTP, gRPC, metrics) for a model repository or one model.

    kiln serve MODEL_REPOSITORY [--http-port 8000] [--grpc-port 8001] [--metrics-port 8002]
    kiln serve --model model.onnx|model.kiln [--name NAME]
    kiln serve REPO --grpc-use-ssl --grpc-server-cert server.crt --grpc-server-key server.key \
        [--grpc-use-ssl-mutual --grpc-root-cert ca.crt] [--grpc-infer-response-compression-level low] \
        [--grpc-keepalive-time MS ...]      (tritonserver's gRPC flags: kiln/serve/grpc_options.py)
    kiln serve --ray MODEL_REPOSITORY [--ray-address ADDR] [--replicas N | --autoscale MIN-MAX]

Prints one line per endpoint once it serves (the ports actually bound: 0 asks for free ones),
then runs until SIGINT/SIGTERM and shuts down gracefully (every request in flight answered).
With --ray the models run as Ray Serve deployments on a Ray cluster (kiln/serve/ray/), HTTP only.
"""

from __future__ import annotations

import argparse
import logging
import sys

from kiln.errors import KilnError


def add_parser(verbs) -> None:
    p = verbs.add_parser("serve", help="serve models over Triton's HTTP/gRPC protocol (KServe v2)",
                         description="Serve a model repository (<repo>/<model>/<version>/model.kiln or model.onnx, "
                                     "config.pbtxt or config.json per model) or one model file over HTTP and gRPC, "
                                     "with dynamic batching and Prometheus metrics; tritonclient works unchanged. "
                                     "See docs/serving.md.")
    p.add_argument("repository", nargs="?", help="the model repository folder")
    p.add_argument("--model", metavar="FILE", help="serve this one .onnx or .kiln file (config inferred from it)")
    p.add_argument("--name", metavar="NAME", help="the --model's name (default: the file name without suffix)")
    p.add_argument("--host", default="127.0.0.1",
                   help="address to listen on (default 127.0.0.1; 0.0.0.0 serves every interface)")
    p.add_argument("--http-port", type=int, default=8000, help="HTTP port (default 8000; 0: a free one; -1: none)")
    p.add_argument("--grpc-port", type=int, help="gRPC port (default 8001; 0: a free one; -1: none)")
    p.add_argument("--grpc-transport", choices=["kiln", "grpcio"], default="kiln",
                   help="kiln: kiln's own HTTP/2 transport on the event loop (default; ~5x less server CPU a call); "
                        "grpcio: grpc.aio's server; both serve the same calls")
    _add_grpc_arguments(p)
    p.add_argument("--metrics-port", type=int,
                   help="Prometheus /metrics port (default 8002; -1: only on the HTTP port)")
    p.add_argument("--model-control-mode", choices=["none", "explicit"], default="none",
                   help="none: load every model at start (default); explicit: only --load-model ones, the rest "
                        "through the repository API")
    p.add_argument("--load-model", action="append", metavar="NAME", help="with explicit mode: load this at start")
    p.add_argument("--max-queue-size", type=int, default=1024, metavar="N",
                   help="requests queued per model before 429 / RESOURCE_EXHAUSTED, where its config sets none "
                        "(default 1024)")
    p.add_argument("--warm-up", default="0.5", metavar="true|false|SECONDS",
                   help="CPU models: each instance binds its profile's input shapes at load, for at most SECONDS, "
                        "before the model is ready, so no request pays a new shape's binding (a model's config "
                        "overrides it: parameters warm_up) (default %(default)s s; true: that cap; bench/results/"
                        "serve-warmup-2026-12-04c.md)")
    p.add_argument("--batch-buckets", default="half", choices=["pow2", "half"],  # config.BATCH_BUCKETS_DEFAULT
                   help="the batch sizes a bucketed (CUDA) instance pads a call to and captures graphs at, where a "
                        "model's config sets no batch_buckets parameter: pow2 (1, 2, 4, 8, 16, ...) or half (also 12, "
                        "24, 48, ...: a 1.5x step from 8; less padding, more graphs; where they would pass the "
                        "graphs a context keeps, pow2) (default %(default)s)")
    p.add_argument("--cuda-sync", default="spin", choices=["spin", "pinned", "blocking", "staged"],
                   help="how CUDA instances wait for their streams, where a model's config sets no cuda_sync parameter: "
                        "spin (CUDA's default schedule: a waiting thread polls, a core while it waits), pinned (spin's "
                        "wait, the outputs copied into pinned host memory on the stream), blocking (pinned's copies, "
                        "then it sleeps on an event until the GPU signals) or staged (spin's numpy calls, their copies "
                        "through pinned buffers of the context, one wait per call) (default %(default)s; "
                        "kiln/serve/instances.py)")
    p.add_argument("--max-request-mb", type=float, default=64, metavar="MB", help="largest request body (default 64)")
    p.add_argument("--shutdown-timeout", type=float, default=30, metavar="S",
                   help="seconds requests in flight get to finish at shutdown (default 30)")
    p.add_argument("--log-level", default="warning", choices=["debug", "info", "warning", "error"])
    p.add_argument("--staging-mib", type=int, default=64, metavar="MIB",
                   help="with --frontends: MiB of shared memory per front end through which large input tensors "
                        "reach the engine process (0: over its socket) (default 64)")
    p.add_argument("--frontends", type=int, default=0, metavar="N",
                   help="run HTTP and gRPC in N front-end processes on the same ports, sending the tensors to this "
                        "process's batchers (past one event loop; docs/serving.md); default 0: all in this process")
    ray = p.add_argument_group("Ray Serve (--ray: the models as Ray Serve deployments across a Ray cluster; "
                               "HTTP only, on Ray Serve's proxy; needs the ray extra)")
    ray.add_argument("--ray", action="store_true", help="serve through Ray Serve: one deployment per model")
    ray.add_argument("--ray-address", metavar="ADDR",
                     help="the Ray cluster (auto: the one this machine belongs to; ray://host:10001; local: a new "
                          "one); default: RAY_ADDRESS, else a new local one")
    ray.add_argument("--replicas", type=int, default=1, metavar="N", help="replicas per model (default 1)")
    ray.add_argument("--autoscale", metavar="MIN-MAX",
                     help="scale each model's replicas between MIN and MAX on ongoing requests (instead of --replicas)")
    ray.add_argument("--target-ongoing-requests", type=float, metavar="N",
                     help="with --autoscale: ongoing requests per replica to scale towards (default: half of "
                          "the replica's maximum)")
    ray.add_argument("--upscale-delay", type=float, metavar="S",
                     help="with --autoscale: seconds the load stays above target before replicas are added "
                          "(default: Ray's, 30)")
    ray.add_argument("--downscale-delay", type=float, metavar="S",
                     help="with --autoscale: seconds the load stays below target before replicas are removed "
                          "(default: Ray's, 600)")
    ray.add_argument("--look-back-period", type=float, metavar="S",
                     help="with --autoscale: seconds over which the ongoing requests are averaged (default: Ray's, 30)")
    ray.add_argument("--autoscale-metrics-interval", type=float, metavar="S",
                     help="with --autoscale: how often the load is reported to Ray's autoscaler (default: Ray's 10 s; "
                          "half the look-back period where that is 20 s or less); a model's config may set each of "
                          "these as a parameter ray_upscale_delay_s etc. (docs/serving.md)")
    ray.add_argument("--replica-cpus", type=float, default=1, metavar="N",
                     help="CPUs each replica reserves (default 1); a KIND_GPU model's replica also reserves one GPU")
    ray.add_argument("--max-replicas-per-node", type=int, metavar="N",
                     help="at most N replicas of a model per node (1: every replica on its own node)")
    ray.add_argument("--proxy-location", default="EveryNode", choices=["EveryNode", "HeadOnly"],
                     help="where Ray Serve runs HTTP proxies (default EveryNode: every node with a replica)")
    p.set_defaults(func=cmd_serve)


def _boolean(value: str) -> bool:
    """tritonserver's boolean flag values (--grpc-use-ssl=true); the flag alone means true."""
    lowered = value.lower()
    if lowered in ("true", "1", "on", "yes"):
        return True
    if lowered in ("false", "0", "off", "no"):
        return False
    raise argparse.ArgumentTypeError(f"{value!r} is not a boolean: give true or false (or write the flag as "
                                     "--flag=true, or after the model repository)")


def _add_grpc_arguments(p: argparse.ArgumentParser) -> None:
    """tritonserver's gRPC flags, with its names and defaults, for either --grpc-transport."""
    g = p.add_argument_group("gRPC TLS, compression and keepalive (tritonserver's flags; both transports)")
    for name, what in (("--grpc-use-ssl", "serve gRPC over TLS (needs --grpc-server-cert and --grpc-server-key)"),
                       ("--grpc-use-ssl-mutual", "mutual TLS: clients must show a certificate --grpc-root-cert "
                                                 "signed (implies --grpc-use-ssl)")):
        g.add_argument(name, type=_boolean, nargs="?", const=True, default=False, metavar="BOOL", help=what)
    g.add_argument("--grpc-server-cert", metavar="PEM", help="the server's certificate (chain), PEM")
    g.add_argument("--grpc-server-key", metavar="PEM", help="the server's private key, PEM")
    g.add_argument("--grpc-root-cert", metavar="PEM", help="the CA certificate clients' certificates are checked "
                                                          "against (mutual TLS), PEM")
    g.add_argument("--grpc-infer-response-compression-level", choices=["none", "low", "med", "high"], default="none",
                   help="compress inference responses for clients that accept it (gRPC's levels: low gzip, med/high "
                        "deflate); compressed requests are read at any level (default none)")
    for name, default, what in (
            ("--grpc-keepalive-time", 7_200_000, "ms between the server's keepalive PINGs on a connection"),
            ("--grpc-keepalive-timeout", 20_000, "ms a keepalive PING may wait for its ACK before the connection is "
                                                 "closed"),
            ("--grpc-http2-max-pings-without-data", 2, "keepalive PINGs the server sends between two data frames "
                                                       "(0: no limit)"),
            ("--grpc-http2-min-recv-ping-interval-without-data", 300_000, "ms a client must leave between PINGs "
                                                                          "while no data is sent; sooner is a strike"),
            ("--grpc-http2-max-ping-strikes", 2, "strikes before GOAWAY ENHANCE_YOUR_CALM too_many_pings (0: no "
                                                 "limit)")):
        g.add_argument(name, type=int, default=default, metavar="MS" if "time" in name or "interval" in name else "N",
                       help=f"{what} (default {default})")
    g.add_argument("--grpc-keepalive-permit-without-calls", type=_boolean, nargs="?", const=True, default=False,
                   metavar="BOOL", help="send keepalive PINGs, and allow clients' PINGs, with no call open "
                                        "(default false)")


def _grpc_options(args: argparse.Namespace):
    """The --grpc-* flags as GrpcOptions, checked: KilnError naming the flag that cannot be served."""
    from kiln.serve.grpc_options import GrpcOptionError, GrpcOptions

    options = GrpcOptions(
        use_ssl=args.grpc_use_ssl, server_cert=args.grpc_server_cert, server_key=args.grpc_server_key,
        root_cert=args.grpc_root_cert, use_ssl_mutual=args.grpc_use_ssl_mutual,
        infer_response_compression_level=args.grpc_infer_response_compression_level,
        keepalive_time_ms=args.grpc_keepalive_time, keepalive_timeout_ms=args.grpc_keepalive_timeout,
        keepalive_permit_without_calls=args.grpc_keepalive_permit_without_calls,
        http2_max_pings_without_data=args.grpc_http2_max_pings_without_data,
        http2_min_recv_ping_interval_without_data_ms=args.grpc_http2_min_recv_ping_interval_without_data,
        http2_max_ping_strikes=args.grpc_http2_max_ping_strikes)
    try:
        options.check()
    except GrpcOptionError as e:
        raise KilnError(str(e)) from None
    return options


def cmd_serve(args: argparse.Namespace) -> int:
    try:
        from kiln.serve import ServeOptions, Server
        from kiln.serve.server import run
    except ImportError as e:
        raise KilnError(f"kiln serve needs the serve extra ({e.name} is missing): pip install 'kiln[serve]'") from None
    if (args.repository is None) == (args.model is None):
        raise KilnError("give a model repository folder or --model FILE (one of them)")
    if args.model_control_mode == "none" and args.load_model:
        raise KilnError("--load-model needs --model-control-mode explicit")
    from kiln.serve.config import parse_warm_up

    try:
        parse_warm_up(args.warm_up, "--warm-up")
    except ValueError as e:
        raise KilnError(str(e)) from None

    if args.ray:
        return _serve_ray(args)
    if args.grpc_port is None:
        args.grpc_port = 8001
    if args.metrics_port is None:
        args.metrics_port = 8002

    def port(value: int) -> int | None:
        return None if value < 0 else value

    options = ServeOptions(
        repository=args.repository, model=args.model, model_name=args.name, host=args.host,
        http_port=port(args.http_port), grpc_port=port(args.grpc_port), metrics_port=port(args.metrics_port),
        grpc_transport=args.grpc_transport, grpc=_grpc_options(args),
        load_models=(args.load_model or []) if args.model_control_mode == "explicit" else None,
        max_queue_size=args.max_queue_size, max_request_bytes=int(args.max_request_mb * (1 << 20)),
        warm_up=args.warm_up, cuda_sync=args.cuda_sync, batch_buckets=args.batch_buckets,
        shutdown_timeout=args.shutdown_timeout, log_level=args.log_level, frontends=args.frontends,
        staging_bytes=args.staging_mib << 20)
    if args.staging_mib < 0:
        raise KilnError(f"--staging-mib {args.staging_mib}: give 0 (no staging) or more MiB")
    if args.frontends < 0:
        raise KilnError(f"--frontends {args.frontends}: give 0 (one process) or more front-end processes")
    logging.basicConfig(level=args.log_level.upper(), format="kiln serve: %(message)s")

    def started(server: Server) -> None:
        for row in server.core.index():
            state = row["state"] + (f" ({row['reason']})" if row["reason"] else "")
            print(f"kiln serve: model {row['name']} version {row['version'] or '-'}: {state}", flush=True)
        ports = server.ports
        for what, value in (("HTTP", ports.http), ("gRPC", ports.grpc), ("metrics", ports.metrics)):
            if value is not None:
                print(f"kiln serve: {what} on {args.host}:{value}", flush=True)
        print("kiln serve: ready", flush=True)

    try:
        run(Server(options).serve_forever(started))  # on uvloop where installed
    except OSError as e:
        print(f"kiln serve: error: {e}", file=sys.stderr)
        return 1
    print("kiln serve: stopped", flush=True)
    return 0


def _serve_ray(args: argparse.Namespace) -> int:
    try:
        from kiln.serve.ray import RayOptions, ReplicaOptions, run
        from kiln.serve.ray.app import parse_autoscale
    except ImportError as e:
        raise KilnError(f"kiln serve --ray needs the ray and serve extras ({e.name} is missing): "
                        "pip install 'kiln[serve,ray]'") from None
    if args.frontends:
        raise KilnError("--frontends is for kiln serve's own server; under --ray, Ray Serve's proxies are the front ends")
    grpc_options = _grpc_options(args)
    if grpc_options != type(grpc_options)():
        raise KilnError("--ray serves HTTP only (Ray Serve's proxy): drop the --grpc-* TLS, compression and "
                        "keepalive flags")
    if args.grpc_port not in (None, -1) or args.metrics_port not in (None, -1):
        raise KilnError("--ray serves HTTP only (Ray Serve's proxy): drop --grpc-port/--metrics-port; Ray exports "
                        "its own metrics")
    if args.model_control_mode != "none" or args.load_model:
        raise KilnError("--ray loads every model of the repository (one deployment each); explicit model control "
                        "is not served")
    if args.http_port <= 0:
        raise KilnError(f"--ray needs a fixed --http-port (given {args.http_port}): Ray Serve's proxies bind it "
                        "on every node")
    if args.autoscale and args.replicas != 1:
        raise KilnError("give --replicas or --autoscale, not both")
    timing = {"upscale_delay_s": args.upscale_delay, "downscale_delay_s": args.downscale_delay,
              "look_back_period_s": args.look_back_period, "metrics_interval_s": args.autoscale_metrics_interval}
    given = [flag for flag, value in (("--target-ongoing-requests", args.target_ongoing_requests),
                                      ("--upscale-delay", args.upscale_delay),
                                      ("--downscale-delay", args.downscale_delay),
                                      ("--look-back-period", args.look_back_period),
                                      ("--autoscale-metrics-interval", args.autoscale_metrics_interval))
             if value is not None]
    if given and not args.autoscale:
        raise KilnError(f"{', '.join(given)}: settings of autoscaling; give --autoscale MIN-MAX too")
    replicas = ReplicaOptions(num_replicas=args.replicas, num_cpus=args.replica_cpus,
                              autoscaling=parse_autoscale(args.autoscale) if args.autoscale else None,
                              target_ongoing_requests=args.target_ongoing_requests,
                              max_replicas_per_node=args.max_replicas_per_node, **timing)
    options = RayOptions(repository=args.repository, model=args.model, model_name=args.name, replicas=replicas,
                         max_queue_size=args.max_queue_size, max_request_bytes=int(args.max_request_mb * (1 << 20)),
                         shutdown_timeout=args.shutdown_timeout, address=args.ray_address, host=args.host,
                         http_port=args.http_port, proxy_location=args.proxy_location, log_level=args.log_level)
    logging.basicConfig(level=args.log_level.upper(), format="kiln serve: %(message)s")

    def started(index: list[dict]) -> None:
        for row in index:
            state = row["state"] + (f" ({row['reason']})" if row["reason"] else "")
            print(f"kiln serve: model {row['name']} version {row['version'] or '-'}: {state}", flush=True)
        print(f"kiln serve: HTTP on {args.host}:{args.http_port} (Ray Serve)", flush=True)
        print("kiln serve: ready", flush=True)

    run(options, started)
    print("kiln serve: stopped", flush=True)
    return 0
