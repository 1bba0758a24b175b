"""Per convolution layer (ResNet-50's shapes, smaller images): the primitive made for N images against N / b runs of the
one made for b (kiln/kernels/cpu/onednn_chunks.py's runs, each bound at its span), interleaved, medians of
the calling thread's CPU time (one thread: a loaded machine's preemption left out).

    python bench/batch_chunks_layers.py [spatial=28] [threads=1]
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from kiln.kernels.cpu import native_loop, onednn  # noqa: E402
from kiln.kernels.cpu import onednn_primitives as P  # noqa: E402


def main() -> None:
    hw = int(sys.argv[1]) if len(sys.argv) > 1 else 28
    torch.set_num_threads(int(sys.argv[2]) if len(sys.argv) > 2 else 1)
    torch.manual_seed(0)
    # (in channels, out channels, kernel, stride, spatial): ResNet-50's kinds of layer at an image of 4 * hw
    layers = [(64, 64, 3, 1, hw), (64, 256, 1, 1, hw), (256, 64, 1, 1, hw), (128, 128, 3, 2, hw),
              (256, 256, 3, 1, hw // 4), (512, 512, 3, 1, hw // 8), (2048, 512, 1, 1, hw // 8),
              (512, 2048, 1, 1, hw // 8), (3, 64, 7, 2, hw * 4)]
    relu = onednn.eltwise_for("Relu", 0.0, 0.0)
    load = open("/proc/loadavg").read().split()[0]
    print(f"# load {load}, {torch.get_num_threads()} thread(s); ratio = runs / whole")
    print("| N | layer | whole (ms) | runs of 1 | runs of 2 |\n|---|---|---|---|---|")
    for n in (8, 32):
        for c, o, k, s, size in layers:
            w, b = torch.randn(o, c, k, k), torch.randn(o)

            def conv(images: int) -> P.Conv2d:
                return P.Conv2d(w, b, [images, c, size, size], [s, s], [k // 2] * 4, [1, 1], 1, relu, False, False)

            x = torch.randn(n, c, size, size).contiguous(memory_format=torch.channels_last)
            whole = conv(n)
            y = torch.empty(whole.output_size).contiguous(memory_format=torch.channels_last)
            per_in, per_out = x[0].numel() * 4, y[0].numel() * 4
            kept = [whole.bind(x.data_ptr(), y.data_ptr())]  # a Bound owns the arrays its calls point at: kept
            calls = {"whole": kept[0].calls()}
            for part in (1, 2):
                p = conv(part)
                bound = [p.bind(x.data_ptr() + i * per_in, y.data_ptr() + i * per_out) for i in range(0, n, part)]
                kept.append(bound)
                calls[part] = [call for one in bound for call in one.calls()]
            times: dict = {key: [] for key in calls}
            for _ in range(21):
                for key, made in calls.items():
                    start = time.thread_time()  # 1 thread: the work, without preemption (2+: use perf_counter)
                    native_loop.run_calls(made)
                    times[key].append(time.thread_time() - start)
            med = {key: statistics.median(v) for key, v in times.items()}
            print(f"| {n} | {c}->{o} k{k} s{s} {size}px | {med['whole'] * 1e3:.2f} | {med[1] / med['whole']:.2f} | "
                  f"{med[2] / med['whole']:.2f} |")


if __name__ == "__main__":
    main()
