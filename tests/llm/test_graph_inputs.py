"""The decode graph's inputs (kiln/llm/cuda_graphs.py), on the CPU: DecodeGraphs.stage keeps block-table rows
between steps and writes only what changed; every step it must leave what a fresh per-row fill writes
(token ids, positions, slots, sequence lengths, each row's blocks, the null block for padding rows), through
requests finishing, arriving, moving rows and coming back after preemption with other blocks. And the engine
with its decode steps through DecodeGraphs (each "replay" runs the captured forward eagerly, the Triton decode
kernel under the interpreter) generates what the plain engine does."""

import random

import numpy as np
import pytest
import torch

from kiln.llm.cuda_graphs import DecodeGraphs
from kiln.llm.sampling import Sampler
from kiln.llm.scheduler import ScheduledRequest


def fresh_fill(items, bucket, block_size, width):
    """The plain fill the staging replaced: zeroed buffers, then each row written in full."""
    ints = np.zeros((4, bucket), dtype=np.int64)
    ints[3] = 1
    tables = np.zeros((bucket, width), dtype=np.int32)
    for i, item in enumerate(items):
        pos, blocks = item.start_position, item.block_ids
        ints[:, i] = item.token_ids[0], pos, blocks[pos // block_size] * block_size + pos % block_size, pos + 1
        tables[i, :len(blocks)] = blocks
    return ints, tables


@pytest.mark.parametrize("seed", range(4))
def test_stage_writes_what_a_fresh_fill_writes(seed):
    rng = random.Random(seed)
    block_size, max_model_len, max_batch = 4, 64, 12
    graphs = DecodeGraphs(None, None, Sampler(50, torch.device("cpu")), block_size, max_model_len, max_batch,
                          torch.device("cpu"))
    free = list(range(1, 300))
    rng.shuffle(free)
    running = []  # [position, blocks]
    for step in range(120):
        for entry in list(running):
            if rng.random() < 0.06 or entry[0] >= max_model_len - 2:
                running.remove(entry)  # finished (or cancelled): its blocks go back, to be reused
                free[:0] = entry[1]
            elif rng.random() < 0.03:  # preempted and back: the same length, other blocks
                free[:0], entry[1] = entry[1], [free.pop() for _ in entry[1]]
        while len(running) < max_batch and rng.random() < 0.4:
            position = rng.randrange(0, 30)
            running.insert(rng.randrange(len(running) + 1), [position, [free.pop() for _ in
                                                                         range(position // block_size + 1)]])
        if not running:
            continue
        items = []
        for entry in running:
            position, blocks = entry
            if position // block_size >= len(blocks):
                blocks.append(free.pop())
            items.append(ScheduledRequest(None, [rng.randrange(50)], position, list(blocks)))
            entry[0] += 1
        bucket = graphs.stage(items)
        assert bucket == graphs.bucket(len(items))
        ints, tables = fresh_fill(items, bucket, block_size, graphs.width)
        np.testing.assert_array_equal(graphs.host_ints.numpy()[:, :bucket], ints, err_msg=f"step {step}")
        staged = graphs.host_tables.numpy()
        for i, item in enumerate(items):  # past its own blocks a row is never read (the kernel stops at seq_len)
            np.testing.assert_array_equal(staged[i, :len(item.block_ids)], item.block_ids, err_msg=f"step {step}")
        assert (staged[len(items):bucket, 0] == 0).all()  # padding rows read the null block


class EagerReplay:
    """A stand-in for a captured graph: replay runs the bucket's forward eagerly on the static buffers."""

    def __init__(self, graphs, bucket):
        self.graphs, self.bucket = graphs, bucket

    def replay(self):
        self.graphs.logits[self.bucket], self.graphs.greedy_ids[self.bucket] = self.graphs._forward(self.bucket)


@pytest.mark.slow
def test_engine_through_decode_graph_inputs_generates_what_the_plain_engine_does(hf_models):
    pytest.importorskip("triton")
    from kiln.llm import LLM, SamplingParams

    folder, _ = hf_models("llama")
    prompts = ["Hello world", "Paged attention reads keys and values from blocks", "a", "In-flight batching",
               "The quick brown fox", "Ü 日本語"]
    params = [SamplingParams(max_tokens=4 + 3 * i, temperature=0, ignore_eos=True) for i in range(len(prompts))]
    # 3 seats for 6 requests: rows finish, arrive and move; 14 usable blocks of 4 tokens: preemption
    options = dict(block_size=4, num_kv_blocks=15, max_num_seqs=3, max_model_len=48, attention_backend="triton")
    expected = [o.outputs[0].token_ids for o in LLM(folder, **options).generate(prompts, params)]
    llm = LLM(folder, **options)
    runner = llm.engine.runner
    graphs = DecodeGraphs(runner.model, runner.kv_caches, runner.sampler, 4, 48, 3, torch.device("cpu"))
    for bucket in graphs.buckets:
        graphs.forward_graphs[bucket] = EagerReplay(graphs, bucket)
    runner.graphs = graphs
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == expected
    assert runner.num_graph_steps >= 10 and llm.engine.stats.num_preemptions > 0
