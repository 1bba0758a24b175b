"""Engines and ONNX files for bench/pool_2threads.py: llama_tiny (dynamic, profile 1x1 / 8x64 / 8x64), bert_tiny
(batch 1, seq 128) and all-MiniLM-L6-v2 (real weights, batch 1, seq 128), built at 2 threads into --out.

    python bench/pool_2threads_prep.py --out /tmp/pool2t
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import kiln  # noqa: E402  before torch: kiln chooses OpenMP's wait policy
import numpy as np  # noqa: E402
import torch  # noqa: E402

from kiln import zoo  # noqa: E402
from kiln.builder.config import BuildConfig  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", default="/tmp/pool2t")
    ap.add_argument("--only", default="llama,bert,minilm")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(2)
    only = args.only.split(",")
    if "llama" in only:
        path = zoo.export("llama_tiny", batch=2, seq=8, dynamic=True).path
        shutil.copy(path, out / "llama.onnx")
        config = BuildConfig(profiles=[{"input_ids": "1x1,8x64,8x64"}])
        kiln.build(str(path), config).save(str(out / "llama.kiln"))
    if "bert" in only:
        exported = zoo.export("bert_tiny", batch=1, seq=128)
        shutil.copy(exported.path, out / "bert.onnx")
        np.savez(out / "bert.npz", **zoo.random_inputs("bert_tiny", exported, seed=1))
        kiln.build(str(exported.path)).save(str(out / "bert.kiln"))
    if "minilm" in only:
        from kiln.zoo import sentence
        from kiln.zoo.export import export_module, offline
        with offline():
            feeds = sentence.tokenize(sentence.SENTENCES[:1], 128)
            export_module(sentence.pretrained(), feeds, out)
        (out / "model.onnx").rename(out / "minilm.onnx")
        np.savez(out / "minilm.npz", **feeds)
        kiln.build(str(out / "minilm.onnx")).save(str(out / "minilm.kiln"))


if __name__ == "__main__":
    main()
