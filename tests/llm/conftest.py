"""Checkpoints written once per test session (tests/llm/checkpoints.py) and oracles from transformers."""

import pytest
import torch

from tests.llm import checkpoints


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """These models are tiny: on a shared 2-core machine OpenMP's threads mostly wait for each other
    (a decode step measured 30x slower with 2 threads than with 1 under load)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def hf_models(tmp_path_factory):
    """name -> (folder, transformers model); written lazily, once."""
    made = {}
    recipes = {
        "llama": lambda f: checkpoints.llama(f),
        "llama_tied_sharded": lambda f: checkpoints.llama(f, seed=1, tie_word_embeddings=True, shard=True),
        "llama3_rope": lambda f: checkpoints.llama(f, seed=2, rope_scaling={
            "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 32}),
        "linear_rope": lambda f: checkpoints.llama(f, seed=3, rope_scaling={"rope_type": "linear", "factor": 2.0}),
        "yarn_rope": lambda f: checkpoints.llama(f, seed=4, rope_scaling={
            "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}),
        "qwen2": lambda f: checkpoints.qwen2(f, seed=5),
        "mistral": lambda f: checkpoints.mistral(f, seed=6),
        "gpt2": lambda f: checkpoints.gpt2(f, seed=7),
    }

    def get(name):
        if name not in made:
            made[name] = recipes[name](tmp_path_factory.mktemp(name))
        return made[name]

    get.names = list(recipes)
    return get


def hf_greedy(model, prompt: list[int], max_tokens: int) -> tuple[list[int], list[torch.Tensor]]:
    """Greedy tokens by full forwards (no cache: the plainest oracle) and each step's fp32 logits."""
    ids, logits = list(prompt), []
    with torch.no_grad():
        for _ in range(max_tokens):
            row = model(torch.tensor([ids])).logits[0, -1].float()
            logits.append(row)
            ids.append(int(row.argmax()))
    return ids[len(prompt):], logits
