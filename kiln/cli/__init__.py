"""The `kiln` command line: build | run | bench | inspect | compare | refit | serve | perf.

    kiln build model.onnx -o model.kiln [--opt-level N] [--shapes x:1x3x224x224] [--verbose]
    kiln run model.kiln [--inputs in.npz] [--outputs out.npz] [--shapes ...]
    kiln bench model.kiln [--against onnxruntime] [--onnx model.onnx] [--warmup N]
               [--iterations N | --duration S] [--shapes ...]
    kiln inspect model.kiln [--json] [--why-not [MODEL.onnx]]
    kiln compare model.onnx [--precision P] [--mark-all]
    kiln refit model.kiln --weights new.safetensors|new.onnx [--onnx model.onnx] [-o out.kiln]
    kiln serve MODEL_REPOSITORY | --model model.onnx [--http-port 8000] [--grpc-port 8001] [--metrics-port 8002]
    kiln perf -m MODEL [-u URL] [-i http|grpc] [--concurrency-range 1:8:2]
    kiln llm serve|generate|bench HF_FOLDER ...   (an LLM runtime with an OpenAI-compatible server)

A kiln error prints one line-led message on stderr and exits 1, never a traceback. `run`,
`bench` and `inspect` load engines through the lean runtime: only `build` imports the ONNX
frontend and the passes (and `bench --against onnxruntime` imports onnxruntime).

This module holds the parser and main(); each verb is its own module (build.py, run.py,
bench.py, inspect.py, compare.py), and common.py the helpers they share.
"""

from __future__ import annotations

import argparse
import sys

import kiln
from kiln.cli.bench import cmd_bench
from kiln.cli.build import cmd_build
from kiln.cli.compare import cmd_compare
from kiln.cli.inspect import cmd_inspect
from kiln.cli.llm import add_parser as add_llm_parser
from kiln.cli.perf import add_parser as add_perf_parser
from kiln.cli.refit import add_parser as add_refit_parser
from kiln.cli.run import cmd_run
from kiln.cli.serve import add_parser as add_serve_parser
from kiln.errors import KilnError


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kiln", description="Build ONNX models into kiln engines, run, benchmark and inspect them.")
    parser.add_argument("--version", action="version", version=f"kiln {kiln.__version__}")
    verbs = parser.add_subparsers(dest="verb", metavar="{build,run,bench,inspect,compare,serve,perf,llm}", required=True)
    shapes_help = ("concrete input shapes NAME:DIMxDIM..., comma-separated or repeated "
                   "(symbolic dims default to the build shapes, else 1)")

    p = verbs.add_parser("build", help="import, check, optimise and plan an ONNX model; write the engine",
                         description="Import, check, optimise and plan an ONNX model, and write a .kiln engine.")
    p.add_argument("model", help="the .onnx model (external data files next to it)")
    p.add_argument("-o", "--output", help="engine file to write (default: the model's path with .kiln)")
    p.add_argument("--opt-level", type=int, default=2, choices=range(6), metavar="N",
                   help="0: import and run as is ... 5: every optimisation (default 2)")
    p.add_argument("--shapes", action="append", metavar="NAME:DIMS",
                   help="shapes to tune tactics and plan memory at: " + shapes_help)
    p.add_argument("--profile", action="append", metavar="NAME:MIN,OPT,MAX[;NAME:...]",
                   help="an optimization profile (repeat for several): each input's smallest, tuned and largest "
                        "shape, e.g. 'input_ids:1x1,8x128,32x512'; inputs sharing a symbolic dim follow the ones "
                        "given. Default: kiln picks one for symbolic dims (kiln inspect says which)")
    p.add_argument("--pad-dims", metavar="SYMBOL[,SYMBOL]",
                   help="symbolic dims where zero padding at the end is exact, besides batch and a sequence an "
                        "attention_mask input covers (e.g. 'seq' for a causal decoder): CUDA shape buckets pad them")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="target device (default cpu)")
    p.add_argument("--precision", default="fp32", choices=["fp32", "tf32", "fp16", "bf16", "int8", "fp8", "best"],
                   help="builder precision (default fp32)")
    p.add_argument("--calib", metavar="DIR", help="calibration data for --int8/--fp8: a folder of .npy/.npz batches "
                                                  "or of images (see --calib-preprocessing)")
    p.add_argument("--calibrator", default="entropy", choices=["entropy", "minmax", "percentile", "mse"],
                   help="how a tensor's range is chosen from its calibration values (default entropy)")
    p.add_argument("--calib-cache", metavar="FILE.json", help="measured ranges: read when it covers the model, "
                                                              "else written (a rebuild skips the data)")
    p.add_argument("--calib-preprocessing", default="imagenet", choices=["imagenet"],
                   help="how calibration images become inputs (default imagenet: 224 crop, mean/std)")
    p.add_argument("--quantization", default="auto", choices=["auto", "emulate"],
                   help="auto: quantize the layers an int8/fp8 kernel of the device runs (none yet: they stay "
                        "float, said in the build summary); emulate: quantize every Conv/Gemm/MatMul and compute "
                        "as its kernel would, to measure int8/fp8 accuracy on any machine")
    p.add_argument("--accuracy-target", type=float, metavar="T",
                   help="with --int8/--fp8, measured on the calibration data: the largest output error relative to "
                        "the output's scale (e.g. 0.02), or with --accuracy-metric top1 the share of inputs whose "
                        "top-1 class stays fp32's (e.g. 0.97); the fewest most sensitive layers stay float to meet "
                        "it, or go weight-only (int8/fp8 weights, float input) where that takes no more layers")
    p.add_argument("--no-weight-only", dest="accuracy_weight_only", action="store_false",
                   help="with --accuracy-target: keep layers float only, never weight-only (weights quantized, "
                        "input float; on the CPU the fp32 kernel, so a weight-only layer costs a float layer's time)")
    p.add_argument("--no-cost", dest="accuracy_by_cost", action="store_false",
                   help="with --accuracy-metric top1 on an int8 CPU build: move the fewest layers up from int8, not "
                        "the fewest milliseconds (each layer's int8, W8A16 and fp32 kernels timed)")
    p.add_argument("--int8-speed-check", dest="speed_check", choices=["auto", "on", "off"], default="auto",
                   help="int8 CPU builds: time the layers in this machine's fp32 and int8 engines and keep fp32 "
                        "those (or runs of those) whose int8 form is not faster, quantize steps included, then check "
                        "the engine against fp32's (auto: with --accuracy-target on a CPU without VNNI/AMX)")
    p.add_argument("--accuracy-margin", type=float, default=0.01,
                   help="with --accuracy-metric top1: the search aims this much above the target (its expected "
                        "agreement on the calibration data overestimates new data's; default 0.01)")
    p.add_argument("--accuracy-metric", choices=["error", "top1"], default="error",
                   help="what --accuracy-target bounds: error (default) or top1 (classifiers; layers ranked by "
                        "their softmax KL divergence from fp32)")
    p.add_argument("--smoothquant", type=float, metavar="ALPHA",
                   help="with --int8/--fp8: SmoothQuant, move activation outliers into the weights with strength "
                        "ALPHA in [0, 1] (0.5 is usual) for MatMul/Gemm inputs fed by a LayerNorm or a MatMul/Gemm; "
                        "the float model is unchanged (default off)")
    p.add_argument("--equalize", type=float, nargs="?", const=0.5, metavar="ALPHA",
                   help="with --int8/--fp8: cross-layer equalization, grow the narrow channels of every "
                        "Conv -> Relu/ReLU6 -> Conv activation towards the widest (strength ALPHA in (0, 1], "
                        "0.5 when given alone) before calibration; the float model is unchanged (default off)")
    p.add_argument("--gptq", action="store_true",
                   help="with --int8: round the weights by GPTQ against each layer's input statistics on the "
                        "calibration data instead of to nearest (scales unchanged; default off)")
    for flag in ("fp16", "bf16", "tf32", "best", "int8", "fp8"):  # trtexec's spelling: --fp16 is --precision fp16
        p.add_argument(f"--{flag}", dest="precision", action="store_const", const=flag,
                       help=f"same as --precision {flag}")
    p.add_argument("--pin-weight-only", action="append", metavar="LAYER",
                   help="with --int8/--fp8: quantize this layer's (ONNX node name) weights only, its input stays "
                        "float; repeatable")
    p.add_argument("--pin-w8a16", action="append", metavar="LAYER",
                   help="with --int8 on a CPU with VNNI: this Conv's weights int8 and its input at 16 bits (two int8 "
                        "convolutions on the input's bytes); repeatable")
    p.add_argument("--pin-fp32", action="append", metavar="LAYER",
                   help="keep this layer (ONNX node name) in fp32 in a half-precision engine; repeatable")
    p.add_argument("--timing-cache", metavar="FILE.json",
                   help="tactic timings to reuse and extend: a rebuild with it times nothing (kiln/tactics)")
    p.add_argument("--no-in-context", dest="in_context", action="store_false",
                   help="CPU: keep the GEMM and conv tactics chosen alone, without timing close rivals again in the "
                        "network (kiln/builder/in_context.py; the timing cache keeps that choice too)")
    p.add_argument("--compile-workers", type=int, metavar="N",
                   help="CUDA: processes compiling the candidates' Triton kernels while the tactic search runs "
                        "(default: the cores less one; 0: each kernel compiles on its first launch)")
    p.add_argument("--refittable", action="store_true",
                   help="keep every weight refittable (kiln refit): none stored once for being equal to another, "
                        "so an engine built from freshly initialised weights takes trained ones")
    p.add_argument("--remove-padding", action="store_true",
                   help="padding-free encoder: the layers after the attention_mask's attention run on the real "
                        "tokens only; outputs at padding positions are zeros (refused, with the reason, when the "
                        "model has no padding mask or a layer there mixes tokens)")
    p.add_argument("-v", "--verbose", action="store_true", help="print each build stage and its time")
    p.set_defaults(func=cmd_build)

    p = verbs.add_parser("run", help="run an engine once and print its outputs",
                         description="Run an engine once on given or random inputs and print its outputs.")
    p.add_argument("engine", help="the .kiln engine")
    p.add_argument("--inputs", metavar="IN.npz", help="input arrays by name (default: random of the right dtype/shape)")
    p.add_argument("--outputs", metavar="OUT.npz", help="write the outputs here")
    p.add_argument("--save-inputs", metavar="IN.npz", help="write the inputs used (e.g. the random ones) here")
    p.add_argument("--shapes", action="append", metavar="NAME:DIMS", help="random input shapes: " + shapes_help)
    p.add_argument("--seed", type=int, default=0, help="seed of the random inputs (default 0)")
    p.set_defaults(func=cmd_run)

    p = verbs.add_parser("bench", help="time an engine (optionally side by side with onnxruntime)",
                         description="Warm up, then time an engine: latency min/mean/median/p90/p95/p99 and qps.")
    p.add_argument("engine", help="the .kiln engine")
    p.add_argument("--against", choices=["onnxruntime"], help="also time this runtime on the same inputs")
    p.add_argument("--onnx", metavar="MODEL.onnx",
                   help="the ONNX model for --against (default: the source path recorded in the engine)")
    p.add_argument("--warmup", type=int, default=5, metavar="N", help="untimed runs first (default 5)")
    how_long = p.add_mutually_exclusive_group()
    how_long.add_argument("--iterations", type=int, metavar="N", help="timed runs (default: >= 10 runs and 3 s)")
    how_long.add_argument("--duration", type=float, metavar="S", help="time runs for S seconds")
    p.add_argument("--inputs", metavar="IN.npz", help="input arrays by name (default: random)")
    p.add_argument("--shapes", action="append", metavar="NAME:DIMS", help="random input shapes: " + shapes_help)
    p.add_argument("--seed", type=int, default=0, help="seed of the random inputs (default 0)")
    p.add_argument("--json", metavar="OUT.json", help="also write the statistics as JSON")
    stream = p.add_mutually_exclusive_group()
    stream.add_argument("--random-shapes", metavar="NAME:MINxMIN..MAXxMAX",
                        help="replay a stream of random shapes (e.g. input_ids:1x1..32x512; inputs sharing a "
                             "symbol follow) and report p50/p99 with first calls, captures and memory")
    stream.add_argument("--shapes-from", metavar="FILE", help="replay the shapes in FILE (NAME:DIMS[,...] a line)")
    p.add_argument("--requests", type=int, default=200, metavar="N", help="requests in a --random-shapes stream")
    p.add_argument("--no-overhead", action="store_true", help="skip the dispatch overhead estimate")
    p.add_argument("--dump-profile", action="store_true", help="also print each layer's median time (eager)")
    p.set_defaults(func=cmd_bench)

    p = verbs.add_parser("inspect", help="show an engine's header, bindings, layers and memory",
                         description="Show an engine's header, bindings, layers, weights and activation memory.")
    p.add_argument("engine", help="the .kiln engine")
    p.add_argument("--json", action="store_true", help="print the header and layer list as JSON")
    p.add_argument("--why-not", nargs="?", const="source", metavar="MODEL.onnx",
                   help="also list candidate fusions that did not fire and why (default: the engine's source model)")
    p.set_defaults(func=cmd_inspect)

    p = verbs.add_parser("compare", help="compare a build of a model against onnxruntime fp32 (Polygraphy-like)",
                         description="Build the model, run it and onnxruntime fp32 on the same inputs, and report "
                                     "per-output error statistics; --mark-all compares every layer and names the "
                                     "first one outside tolerance. Exit status 2 when outside tolerance.")
    p.add_argument("model", help="the .onnx model")
    p.add_argument("--precision", default="fp32", choices=["fp32", "tf32", "fp16", "bf16", "int8", "fp8"])
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--opt-level", type=int, default=2, choices=range(6), metavar="N")
    p.add_argument("--mark-all", action="store_true", help="compare every intermediate value; name the first bad layer")
    p.add_argument("--per-layer", action="store_true",
                   help="compare every intermediate value and rank the layers by error relative to their scale "
                        "(which layers an int8/fp8 engine loses the most in)")
    p.add_argument("--calib", metavar="DIR", help="calibration data for --precision int8/fp8 (emulated)")
    p.add_argument("--calibrator", default="entropy", choices=["entropy", "minmax", "percentile", "mse"])
    p.add_argument("--rtol", type=float, help="relative tolerance (default by precision)")
    p.add_argument("--atol", type=float, help="absolute tolerance (default by precision)")
    p.add_argument("--inputs", metavar="IN.npz", help="input arrays by name (default: random)")
    p.add_argument("--shapes", action="append", metavar="NAME:DIMS", help="random input shapes: " + shapes_help)
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=cmd_compare)

    add_refit_parser(verbs)  # kiln/cli/refit.py
    add_serve_parser(verbs)  # kiln/cli/serve.py
    add_perf_parser(verbs)  # kiln/cli/perf.py
    add_llm_parser(verbs)  # kiln/cli/llm.py
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        return args.func(args)
    except KilnError as e:
        print(f"kiln {args.verb}: error: {e}", file=sys.stderr)
        return 1
    except OSError as e:  # unwritable output folder, full disk, unreadable file
        print(f"kiln {args.verb}: error: {e.strerror or e}: {e.filename or ''}".rstrip(": "), file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"kiln {args.verb}: interrupted", file=sys.stderr)
        return 130
