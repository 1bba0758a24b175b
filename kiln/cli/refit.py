"""kiln refit: new weights into an engine without rebuilding it.

    kiln refit model.kiln --weights new.safetensors [--onnx model.onnx] [-o refit.kiln]
    kiln refit model.kiln --weights new.onnx
    kiln refit int8.kiln --weights new.safetensors [--calib DIR]

The weights are named as the ONNX model's initializers (a torch state_dict saved with safetensors
names them so for models exported with torch.onnx.export(dynamo=True)); they are re-derived as the
builder derived the engine's (kiln/builder/refit.py), or refused with the reason. An int8/fp8 engine
of kiln's calibration keeps its calibrated activation ranges (said in the output) and derives its
weight scales, quantized weights and int32 biases from the new weights; --calib DIR measures the
activation ranges again on the new weights, as a fresh build with that data would. The engine is
written back in place unless -o names another file.
"""

from __future__ import annotations

import argparse

import kiln
from kiln.cli.common import console


def add_parser(verbs) -> None:
    p = verbs.add_parser("refit", help="replace an engine's weights without rebuilding it",
                         description="Replace an engine's weights without rebuilding: BatchNorm folding, transposed "
                                     "and merged weights, half precision and (int8/fp8 engines) per-channel weight "
                                     "scales, quantized weights and int32 biases are re-derived as the builder did, "
                                     "or the refit is refused with the reason. An int8/fp8 engine keeps its calibrated "
                                     "activation ranges unless --calib gives data to measure them again. See "
                                     "docs/frontdoors.md.")
    p.add_argument("engine", help="the .kiln engine")
    p.add_argument("--weights", required=True, metavar="FILE",
                   help="new weights: .safetensors named as the ONNX initializers, or a whole .onnx model")
    p.add_argument("--onnx", metavar="MODEL.onnx",
                   help="the ONNX model the engine was built from (default: the path recorded in the engine)")
    p.add_argument("--calib", metavar="DIR",
                   help="int8/fp8 engines: calibration data (a folder of .npy/.npz or images, as kiln build --calib) "
                        "to measure the activation ranges again on the new weights (default: keep the calibrated "
                        "ones)")
    p.add_argument("-o", "--output", metavar="FILE", help="write the refit engine here (default: in place)")
    p.set_defaults(func=cmd_refit)


def cmd_refit(args: argparse.Namespace) -> int:
    engine = kiln.load(args.engine)
    report = engine.refit(args.weights, onnx=args.onnx, recalibrate=args.calib)
    output = args.output or args.engine
    engine.save(output)
    out = console()
    out.print(f"refit {args.engine} from {report.source} (through {report.model}): {len(report.changed)} engine "
              f"weight(s) changed, {report.unchanged} unchanged; wrote {output}")
    if report.activation_scales:
        out.print(f"activation scales: {report.activation_scales}")
    for key in report.changed[:20]:
        out.print(f"  {key}")
    if len(report.changed) > 20:
        out.print(f"  ... {len(report.changed) - 20} more")
    return 0
