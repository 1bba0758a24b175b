"""`kiln compare`: build a model and compare it with onnxruntime fp32 (kiln/tools/accuracy.py)."""

from __future__ import annotations

import argparse

import numpy as np

from kiln.cli.common import parse_shapes


def cmd_compare(args: argparse.Namespace) -> int:
    from kiln.tools.accuracy import compare

    feeds = dict(np.load(args.inputs)) if args.inputs else None
    options = {}
    if args.precision in ("int8", "fp8"):  # quantized: compared as its kernels would compute (emulated)
        options = {"calibration": args.calib, "calibrator": args.calibrator, "quantization": "emulate"}
    report = compare(args.model, precision=args.precision, device=args.device, opt_level=args.opt_level,
                     inputs=feeds, shapes=parse_shapes(args.shapes), rtol=args.rtol, atol=args.atol,
                     mark_all=args.mark_all or args.per_layer, seed=args.seed, build_options=options)
    print(report.render(by_scale=args.per_layer))
    return 0 if report.passed else 2
