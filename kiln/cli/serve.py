"""kiln serve: a Triton-compatible server (HTTP, gRPC, metrics) for a model repository or one model.

    kiln serve MODEL_REPOSITORY [--http-port 8000] [--grpc-port 8001] [--metrics-port 8002]
    kiln serve --model model.onnx|model.kiln [--name NAME]

Prints one line per endpoint once it serves (the ports actually bound: 0 asks for free ones),
then runs until SIGINT/SIGTERM and shuts down gracefully (every request in flight answered).
"""

from __future__ import annotations

import argparse
import asyncio
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
    p.add_argument("--grpc-port", type=int, default=8001, help="gRPC port (default 8001; 0: a free one; -1: none)")
    p.add_argument("--metrics-port", type=int, default=8002,
                   help="Prometheus /metrics port (default 8002; -1: only on the HTTP port)")
    p.add_argument("--model-control-mode", choices=["none", "explicit"], default="none",
                   help="none: load every model at start (default); explicit: only --load-model ones, the rest "
                        "through the repository API")
    p.add_argument("--load-model", action="append", metavar="NAME", help="with explicit mode: load this at start")
    p.add_argument("--max-queue-size", type=int, default=1024, metavar="N",
                   help="requests queued per model before 429 / RESOURCE_EXHAUSTED, where its config sets none "
                        "(default 1024)")
    p.add_argument("--max-request-mb", type=float, default=64, metavar="MB", help="largest request body (default 64)")
    p.add_argument("--shutdown-timeout", type=float, default=30, metavar="S",
                   help="seconds requests in flight get to finish at shutdown (default 30)")
    p.add_argument("--log-level", default="warning", choices=["debug", "info", "warning", "error"])
    p.set_defaults(func=cmd_serve)


def cmd_serve(args: argparse.Namespace) -> int:
    try:
        from kiln.serve import ServeOptions, Server
    except ImportError as e:
        raise KilnError(f"kiln serve needs the serve extra ({e.name} is missing): pip install 'kiln[serve]'") from None
    if (args.repository is None) == (args.model is None):
        raise KilnError("give a model repository folder or --model FILE (one of them)")
    if args.model_control_mode == "none" and args.load_model:
        raise KilnError("--load-model needs --model-control-mode explicit")

    def port(value: int) -> int | None:
        return None if value < 0 else value

    options = ServeOptions(
        repository=args.repository, model=args.model, model_name=args.name, host=args.host,
        http_port=port(args.http_port), grpc_port=port(args.grpc_port), metrics_port=port(args.metrics_port),
        load_models=(args.load_model or []) if args.model_control_mode == "explicit" else None,
        max_queue_size=args.max_queue_size, max_request_bytes=int(args.max_request_mb * (1 << 20)),
        shutdown_timeout=args.shutdown_timeout, log_level=args.log_level)
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
        asyncio.run(Server(options).serve_forever(started))
    except OSError as e:
        print(f"kiln serve: error: {e}", file=sys.stderr)
        return 1
    print("kiln serve: stopped", flush=True)
    return 0
