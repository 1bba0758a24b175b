"""A DCN-v2-style click-through-rate model (Wang et al. 2021) in plain torch, Criteo-shaped inputs.

    dense:  [B, D]  float  (counts, normalised)
    sparse: [B, F]  int64  (one categorical id per field, each field its own table of `vocab` rows)

Each field's id is looked up in its own embedding table (one Gather per field in ONNX, as
torchrec-less user code exports), concatenated with the dense features into x0, then

    cross network:  x_{l+1} = x0 * (W_l x_l + b_l) + x_l        (the DCN-v2 full-rank cross layer)
    deep network:   MLP(x0)
    head:           Linear([x_L, MLP(x0)]) -> click logit [B, 1]
"""

from __future__ import annotations

import torch
from torch import nn


class CrossLayer(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.linear = nn.Linear(width, width)

    def forward(self, x0: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return x0 * self.linear(x) + x  # [B, W]


class DCN(nn.Module):
    def __init__(self, dense: int = 13, fields: int = 26, vocab: int = 1000, dim: int = 16,
                 cross_layers: int = 3, mlp: tuple[int, ...] = (256, 128)):
        super().__init__()
        self.embeddings = nn.ModuleList(nn.Embedding(vocab, dim) for _ in range(fields))
        width = dense + fields * dim
        self.cross = nn.ModuleList(CrossLayer(width) for _ in range(cross_layers))
        deep: list[nn.Module] = []
        for inp, out in zip((width, *mlp), mlp):
            deep += [nn.Linear(inp, out), nn.ReLU()]
        self.deep = nn.Sequential(*deep)
        self.head = nn.Linear(width + mlp[-1], 1)

    def forward(self, dense: torch.Tensor, sparse: torch.Tensor) -> torch.Tensor:
        embedded = [table(sparse[:, i]) for i, table in enumerate(self.embeddings)]  # F x [B, dim]
        x0 = torch.cat([dense, *embedded], dim=1)  # [B, D + F*dim]
        x = x0
        for layer in self.cross:
            x = layer(x0, x)  # [B, W]
        return self.head(torch.cat([x, self.deep(x0)], dim=1))  # [B, 1]


def dcn(seed: int, **config) -> DCN:
    """torch's default init: N(0, 1) embeddings and uniform(±1/sqrt(fan_in)) layers keep the cross
    network's products O(1) (the cross terms neither vanish nor blow up over a few layers)."""
    torch.manual_seed(seed)
    return DCN(**config).eval()
