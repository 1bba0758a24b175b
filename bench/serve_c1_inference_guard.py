"""A/B in one process: kiln serve's gRPC request at concurrency 1 (bench/serve_overhead.py --inproc's transport
step: kiln's HTTP/2 transport fed a ModelInfer call's frames, the empty model answered inline, no socket), CPU time
of the loop thread per request, with the CPU engine path entering inference mode through torch.inference_mode() (A)
or its C guard alone (B, kiln/runtime/cpu_paths.py's inference_mode), alternated round by round.

    python bench/serve_c1_inference_guard.py [REQUESTS_PER_ROUND 5000] [ROUNDS 15]
"""
import asyncio, os, statistics, sys, tempfile, time
from pathlib import Path
import torch
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import serve_overhead as so
from serve_overhead_client import grpc_request_bytes
from kiln.runtime import cpu_paths

def main(n: int, rounds: int):
    from kiln.serve.core import ServerCore
    from kiln.serve.grpc_h2 import GrpcServer
    from kiln.serve.grpc_server import SERVICE, InferenceServicer, method_handlers
    from kiln.serve.h2_frames import PREFACE, SETTINGS, WINDOW_UPDATE, frame
    from kiln.serve.repository import ModelRepository
    from kiln.serve.server import run as run_on_serve_loop
    tmp = Path(tempfile.mkdtemp())
    so._write_repository(tmp, sys.executable, Path(__file__).resolve().parent.parent)
    data = grpc_request_bytes("empty")
    arms = {"A torch.inference_mode()": torch.inference_mode, "B C guard": cpu_paths.inference_mode}

    async def run():
        core = ServerCore(ModelRepository(tmp))
        await core.start()
        handlers = method_handlers(InferenceServicer(core))
        connection = GrpcServer(SERVICE, handlers, 1 << 26)._connection()
        transport = so._Transport()
        connection.connection_made(transport)
        connection.data_received(PREFACE + frame(SETTINGS, 0, 0))
        stream = 1
        window = frame(WINDOW_UPDATE, 0, 0, (1 << 12).to_bytes(4, "big"))
        async def step():
            nonlocal stream
            connection.data_received(so._call_frames(stream, data) + window)
            stream += 2
            answered = transport.answers()
            while answered < 1:
                await asyncio.sleep(0)
                answered += transport.answers()
        for _ in range(500):
            await step(); await asyncio.sleep(0)
        results = {k: [] for k in arms}
        loads = [os.getloadavg()[0]]
        for r in range(rounds):
            for name, fn in arms.items():
                cpu_paths.inference_mode = fn
                for _ in range(100):
                    await step(); await asyncio.sleep(0)
                t0 = time.thread_time()
                for _ in range(n):
                    await step(); await asyncio.sleep(0)
                results[name].append((time.thread_time() - t0) / n * 1e6)
        loads.append(os.getloadavg()[0])
        for name, xs in results.items():
            print(f"{name:26s} median {statistics.median(xs):6.1f} us/req  min {min(xs):6.1f}  rounds " + " ".join(f"{x:.1f}" for x in xs))
        a, b = (statistics.median(v) for v in results.values())
        ratios = [x / y for x, y in zip(*results.values())]
        print(f"A/B ratio, median over rounds {statistics.median(ratios):.3f}; load {loads[0]:.2f} -> {loads[1]:.2f}")
        await core.close()
    run_on_serve_loop(run())

if __name__ == "__main__":
    print(f"CPU: {so._cpu_model()}", flush=True)
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 5000, int(sys.argv[2]) if len(sys.argv) > 2 else 15)
