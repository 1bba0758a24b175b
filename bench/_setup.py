"""The dynamic-shape benches' common start: the zoo model exported with dynamic batch x sequence, a kiln CPU engine
over bench/dynamic.py's profile (1x1, opt, max) or loaded from a saved one, and onnxruntime's CPU session beside it
at the same thread count. Imported by bench/stream_cpu_time.py and (the profile) bench/stream_timeline.py; bench/ is
on sys.path (a script's folder). bench/first_calls.py still makes the same start in its main (owned elsewhere).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import kiln
from kiln import zoo


def dynamic_profile(max_batch: int, max_seq: int) -> dict[str, str]:
    """bench/dynamic.py's profile: min 1x1, opt min(8, max_batch) x min(128, max_seq), max max_batch x max_seq."""
    return {"input_ids": f"1x1,{min(8, max_batch)}x{min(128, max_seq)},{max_batch}x{max_seq}"}


@dataclass
class CpuPeers:
    """kiln's engine and onnxruntime's session of one exported model, side by side on the CPU."""
    model_path: Path
    engine: kiln.Engine
    session: object  # onnxruntime.InferenceSession (imported late: after torch's thread count is set)


def cpu_peers(model: str, engine_path: str | None, max_batch: int, max_seq: int, threads: int) -> CpuPeers:
    """Export `model` dynamic; load the engine at `engine_path` or build it fp32 over dynamic_profile; open
    onnxruntime's CPU session with `threads` intra-op threads and one inter-op thread."""
    import onnxruntime as ort

    exported = zoo.export(model, batch=2, seq=16, dynamic=True)
    if engine_path:
        engine = kiln.load(engine_path)
    else:
        engine = kiln.build(str(exported.path), device="cpu", precision="fp32",
                            profiles=[dynamic_profile(max_batch, max_seq)])
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    options.inter_op_num_threads = 1
    session = ort.InferenceSession(str(exported.path), options, providers=["CPUExecutionProvider"])
    return CpuPeers(Path(exported.path), engine, session)
