"""`python -m kiln.demo`: a real ImageNet classifier through kiln, start to finish.

Exports torchvision's MobileNetV2 with its ImageNet weights to ONNX (cached), builds a kiln engine,
saves it and loads it back through the lean runtime, classifies scikit-image's photographs, then
times kiln next to onnxruntime and torch eager on the same model (batch 1, fp32).
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from importlib import resources
from pathlib import Path

import numpy as np

PHOTOS = {  # skimage.data name -> what is in the picture
    "chelsea": "a tabby cat",
    "coffee": "a cup of coffee",
    "astronaut": "an astronaut (Eileen Collins)",
    "rocket": "a rocket on its launch pad",
    "stereo_motorcycle": "a motorcycle",
}


def imagenet_classes() -> list[str]:
    """The 1000 ImageNet-1k class names, in the standard index order (kiln/data/imagenet_classes.txt)."""
    text = resources.files("kiln.data").joinpath("imagenet_classes.txt").read_text(encoding="utf-8")
    classes = text.splitlines()
    if len(classes) != 1000:
        raise RuntimeError(f"kiln/data/imagenet_classes.txt has {len(classes)} lines, expected 1000")
    return classes


def softmax(logits: np.ndarray) -> np.ndarray:
    e = np.exp(logits - logits.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def photo(name: str) -> np.ndarray:
    import skimage.data

    image = getattr(skimage.data, name)()
    return image[0] if isinstance(image, tuple) else image  # stereo_motorcycle: (left, right, disparity)


def classify(engine, classes: list[str], top: int) -> None:
    from kiln import zoo

    print(f"\nClassifying scikit-image photographs (top-{top}, softmax probabilities):")
    for name, caption in PHOTOS.items():
        picture = photo(name)  # [H, W, 3] uint8
        image = zoo.mobilenet.preprocess(picture)  # [1, 3, 224, 224]
        logits = engine.run({"pixel_values": image})[engine.output_names[0]]  # [1, 1000]
        probs = softmax(logits[0])
        order = np.argsort(-probs)[:top]
        print(f"  {name} ({caption}, {picture.shape[1]}x{picture.shape[0]}):")
        for rank, k in enumerate(order, 1):
            marker = "top-1" if rank == 1 else f"    {rank}"
            print(f"    {marker}  {probs[k]:6.1%}  {classes[k]}  [{k}]")


def bench(engine, onnx_path: Path, threads: int, iterations: int, warmup: int, budget_s: float) -> None:
    from kiln import zoo
    from kiln.zoo.timing import peer_runners, time_runners

    feeds = {"pixel_values": zoo.mobilenet.preprocess(photo("chelsea"))}
    runners = peer_runners("mobilenet_v2", onnx_path, feeds, threads=threads, engine=engine)
    print(f"\nBenchmark: MobileNetV2, batch 1, 3x224x224, fp32, CPU, {threads} thread(s) each; "
          f"up to {iterations} timed rounds ({budget_s:.0f}s at most) after {warmup} warm-up, "
          "each runtime timed in its own block")
    results = time_runners(runners, iterations=iterations, warmup=warmup, budget_s=budget_s)
    labels = {"onnxruntime": "onnxruntime (all graph optimisations)"}
    width = max(len(labels.get(n, n)) for n in results)
    kiln_median = results["kiln"].median_ms
    print(f"  {'runtime':<{width}}  {'median ms':>9}  {'p90 ms':>7}  {'runs':>5}  {'time / kiln':>11}")
    for name, r in results.items():
        print(f"  {labels.get(name, name):<{width}}  {r.median_ms:9.2f}  {r.p90_ms:7.2f}  {r.runs:5d}  "
              f"{r.median_ms / kiln_median:10.2f}x")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m kiln.demo",
        description="Build, save, load and run a real MobileNetV2 engine; classify photos; bench it.")
    parser.add_argument("--threads", type=int, default=min(os.cpu_count() or 1, 2),
                        help="CPU threads for every runtime in the benchmark (default: 2, or fewer cores)")
    parser.add_argument("--iterations", type=int, default=100, help="timed runs per runtime (default 100)")
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--budget", type=float, default=30.0,
                        help="seconds of timed rounds at most (at least 10 rounds are made)")
    parser.add_argument("--top", type=int, default=5, help="labels shown per photo (default 5)")
    parser.add_argument("--no-bench", action="store_true", help="classify only, skip the benchmark")
    args = parser.parse_args(argv)

    import torch

    import kiln
    from kiln import zoo

    torch.set_num_threads(args.threads)
    print(f"kiln {kiln.__version__} demo: MobileNetV2 (torchvision ImageNet weights), fp32 on CPU")
    start = time.perf_counter()
    exported = zoo.export("mobilenet_v2")
    print(f"  ONNX model   {exported.path} ({time.perf_counter() - start:.1f}s; "
          f"exported with torch.onnx dynamo in {exported.meta['export_seconds']}s, cached)")

    start = time.perf_counter()
    built = kiln.build(str(exported.path))
    print(f"  built        {built} in {time.perf_counter() - start:.2f}s")
    with tempfile.TemporaryDirectory(prefix="kiln-demo-") as folder:
        engine_path = Path(folder) / "mobilenet_v2.kiln"
        built.save(engine_path)
        size_mb = engine_path.stat().st_size / 2**20
        start = time.perf_counter()
        engine = kiln.load(engine_path)  # the lean runtime: no ONNX, no builder
        load_ms = 1e3 * (time.perf_counter() - start)
        print(f"  saved+loaded {engine_path.name} ({size_mb:.1f} MiB), load {load_ms:.0f} ms")

    classify(engine, imagenet_classes(), args.top)
    if not args.no_bench:
        bench(engine, exported.path, args.threads, args.iterations, args.warmup, args.budget)


if __name__ == "__main__":
    main()
