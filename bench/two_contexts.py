"""Two execution contexts of one CPU engine running at once, on two threads (what `kiln serve` does with
instance_group count 2): each row of their answers against the same request run alone on a third context.

    python bench/two_contexts.py bert_base     # issue 14: 4.4 and 4.0 off (values up to 5.3), 2026-12-05 (5 min build)
    python bench/two_contexts.py bert_tiny     # exact

The same engine on one thread, merged batches of 1..16 rows and a context warmed up as the server's (0.5 s), is
bit-exact: the wrong answers of kiln serve's BERT-base rows (bench/results/servewrong-2026-12-05b.md) come from the
contexts' concurrency, not from the batcher's merge and split.
"""

import sys
import threading
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import kiln  # noqa: E402
from kiln import zoo  # noqa: E402

SEQ, ROUNDS = 128, 4


def main(name: str) -> None:
    exported = zoo.export(name, dynamic=True, batch=2)
    engine = kiln.build(str(exported.path), device="cpu", precision="fp32", tuning_runs=1,
                        profiles=[{"input_ids": f"1x{SEQ},64x{SEQ},64x{SEQ}"}])
    output = engine.outputs[0].name
    rng = np.random.default_rng(0)
    ids = [rng.integers(0, 100, (1, SEQ)).astype(np.int64) for _ in range(16)]

    def feeds(rows):
        return {"input_ids": np.concatenate(rows), "attention_mask": np.ones((len(rows), SEQ), np.int64)}

    alone_context = engine.create_execution_context()
    alone = [alone_context.run(feeds([i]))[output][0] for i in ids]
    largest = max(float(np.abs(a).max()) for a in alone)
    worst = {}

    def serve(k: int, context) -> None:
        for _ in range(ROUNDS):
            for size in (1, 3, 5, 2, 7, 4):
                got = context.run(feeds(ids[k:k + size]))[output]
                worst[k] = max(worst.get(k, 0.0), *(float(np.abs(got[r] - alone[k + r]).max()) for r in range(size)))

    threads = [threading.Thread(target=serve, args=(k, engine.create_execution_context())) for k in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    print(f"| model | largest value | context 0: max off | context 1: max off |\n|---|---|---|---|\n"
          f"| {name} | {largest:.3g} | {worst[0]:.3g} | {worst[1]:.3g} |")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "bert_base")
