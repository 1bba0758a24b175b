"""kiln perf: a perf_analyzer-like concurrency sweep against a running server (kiln serve or Triton).

    kiln perf -m MODEL [-u localhost:8000] [-i http|grpc] [--concurrency-range 1:8:2] [-b 1]
              [--shape NAME:DIMS] [--measurement-interval MS] [--processes N] [--client wire|tritonclient]
              [--streams N] [--json OUT.json] [--plot OUT.png]

Prints one row per concurrency level: inferences/s and latency p50/p90/p95/p99 (ms), errors, and with the
wire client (the default: kiln/serve/perf_wire.py) the answers checked against their own requests, the wrong
ones, and the client's CPU per request.
"""

from __future__ import annotations

import argparse
import asyncio
import json

from kiln.cli.common import console, text
from kiln.errors import KilnError


def _range(value: str) -> list[int]:
    parts = value.split(":")
    try:
        numbers = [int(p) for p in parts]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r}: expected START[:END[:STEP]] integers") from None
    if not 1 <= len(numbers) <= 3:
        raise argparse.ArgumentTypeError(f"{value!r}: expected START[:END[:STEP]]")
    start = numbers[0]
    end = numbers[1] if len(numbers) > 1 else start
    step = numbers[2] if len(numbers) > 2 else 1
    if start < 1 or end < start or step < 1:
        raise argparse.ArgumentTypeError(f"{value!r}: need 1 <= START <= END and STEP >= 1")
    return list(range(start, end + 1, step))


def _shape(value: str) -> tuple[str, list[int]]:
    name, _, dims = value.rpartition(":")
    try:
        return name, [int(d) for d in dims.split("x")] if dims else []
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r}: expected NAME:DIMxDIM") from None


def add_parser(verbs) -> None:
    p = verbs.add_parser("perf", help="measure a server's throughput and latency at several concurrencies",
                         description="A closed-loop load generator like Triton's perf_analyzer: at each concurrency "
                                     "level N, N clients keep one request outstanding for a measurement window; "
                                     "prints throughput and latency percentiles.")
    p.add_argument("-m", "--model", required=True, help="the model's name on the server")
    p.add_argument("-x", "--model-version", default="", help="its version (default: the server's choice)")
    p.add_argument("-u", "--url", default="", help="server address (default localhost:8000 http, localhost:8001 grpc)")
    p.add_argument("-i", "--protocol", choices=["http", "grpc"], default="http")
    p.add_argument("--concurrency-range", type=_range, default=[1], metavar="START:END:STEP",
                   help="concurrency levels (default 1); perf_analyzer's syntax, e.g. 1:64:2 is 1,3,5..")
    p.add_argument("--concurrency", type=int, nargs="+", metavar="N", help="explicit levels, e.g. 1 8 32 64")
    p.add_argument("-b", "--batch-size", type=int, default=1, help="rows per request (batched models; default 1)")
    p.add_argument("--shape", type=_shape, action="append", metavar="NAME:DIMS",
                   help="sizes of an input's variable dims past the batch axis, e.g. input_ids:128")
    p.add_argument("--measurement-interval", type=int, default=2000, metavar="MS",
                   help="measurement window per level in ms (default 2000)")
    p.add_argument("--warmup", type=float, default=0.5, metavar="S", help="warm-up seconds per level (default 0.5)")
    p.add_argument("--max-requests", type=int, metavar="N", help="stop a level after N answered requests")
    p.add_argument("--processes", type=int, default=1, metavar="N",
                   help="client processes sharing each level's concurrency (default 1; a fast server outruns one)")
    p.add_argument("--client", choices=["wire", "tritonclient"], default="wire",
                   help="wire (default): requests encoded once on raw sockets, every answer checked against its own "
                        "request, tens of us of client CPU a request; tritonclient: its asyncio clients (~0.7 ms)")
    p.add_argument("--streams", type=int, default=1, metavar="N",
                   help="wire client over gRPC: calls in flight on one HTTP/2 connection (default 1: a connection "
                        "per client)")
    p.add_argument("--json-data", action="store_true",
                   help="HTTP: send tensors as JSON (default binary; needs --client tritonclient)")
    p.add_argument("--json", metavar="OUT.json", help="also write the results as JSON")
    p.add_argument("--plot", metavar="OUT.png", help="also draw throughput against latency (Pillow)")
    p.set_defaults(func=cmd_perf)


def cmd_perf(args: argparse.Namespace) -> int:
    try:
        from kiln.serve.perf import PerfOptions, plot, sweep
    except ImportError as e:
        raise KilnError(f"kiln perf needs the serve extra ({e.name} is missing): pip install 'kiln[serve]'") from None
    if args.batch_size < 1:
        raise KilnError("--batch-size must be >= 1")
    options = PerfOptions(
        model=args.model, url=args.url, protocol=args.protocol, version=args.model_version,
        concurrency=args.concurrency or args.concurrency_range, batch_size=args.batch_size,
        shapes=dict(args.shape or []), binary=not args.json_data, warmup_s=args.warmup,
        window_s=args.measurement_interval / 1000, max_requests=args.max_requests, processes=max(1, args.processes),
        client=args.client, streams=max(1, args.streams))
    out = console()
    out.print(f"kiln perf: {args.model} over {args.protocol} at {options.address}, batch {args.batch_size}, "
              f"{args.measurement_interval} ms per level")
    wire = args.client == "wire"
    out.print(f"{'concurrency':>11} {'infer/s':>10} {'p50 ms':>8} {'p90 ms':>8} {'p95 ms':>8} {'p99 ms':>8} "
              f"{'requests':>9} {'errors':>7}" + (f" {'checked':>8} {'wrong':>6} {'client us/req':>13}" if wire else ""))

    def row(r) -> None:
        checks = f" {r.checked:>8} {r.wrong:>6} {r.client_cpu_s / max(r.requests, 1) * 1e6:>13.1f}" if wire else ""
        out.print(text(f"{r.concurrency:>11} {r.throughput:>10.1f} {r.percentile(50) / 1000:>8.3f} "
                       f"{r.percentile(90) / 1000:>8.3f} {r.percentile(95) / 1000:>8.3f} "
                       f"{r.percentile(99) / 1000:>8.3f} {r.requests:>9} {r.errors:>7}" + checks))
        if r.first_error:
            out.print(text(f"{'':>11} first error: {r.first_error}"))

    try:
        results = asyncio.run(sweep(options, row))
    except ConnectionError as e:
        raise KilnError(f"cannot reach {options.address}: {e}") from None
    except Exception as e:
        if type(e).__name__ == "InferenceServerException":  # tritonclient's; the server said why
            raise KilnError(f"the server at {options.address} answered: {e}") from None
        raise
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"model": args.model, "protocol": args.protocol, "url": options.address,
                       "results": [r.to_json() for r in results]}, f, indent=2)
    if args.plot:
        plot(results, args.plot, args.model)
    return 1 if any(r.errors or r.wrong for r in results) else 0
