"""ai.onnx.ml: LabelEncoder, TreeEnsemble, ArrayFeatureExtractor, Binarizer."""

from __future__ import annotations

import math

import numpy as np
import torch

from kiln.ops._util import from_numpy, ints, to_numpy
from kiln.ops.registry import register

ML = "ai.onnx.ml"


@register("Binarizer", domain=ML)
def binarizer(ctx, X, *, threshold=0.0):
    return torch.where(X > threshold, torch.ones_like(X), torch.zeros_like(X))


@register("ArrayFeatureExtractor", domain=ML)
def array_feature_extractor(ctx, X, Y):
    """Select columns Y of the last axis of X; a 1-D X gives [1, len(Y)]."""
    index = ints(Y)
    if isinstance(X, np.ndarray):
        out = np.take(X, index, axis=-1)
        return out.reshape(1, -1) if X.ndim == 1 else out
    out = X[..., torch.tensor(index, dtype=torch.int64, device=X.device)]
    return out.reshape(1, -1) if X.dim() == 1 else out


def _plain_list(values) -> list:
    if values is None:
        return []
    if isinstance(values, torch.Tensor):
        return values.reshape(-1).tolist()
    return np.asarray(values).reshape(-1).tolist()


@register("LabelEncoder", domain=ML)
def label_encoder(ctx, X, *, classes_strings=None, default_float=-0.0, default_int64=-1,
                  default_string="_Unused", default_tensor=None, keys_floats=None,
                  keys_int64s=None, keys_strings=None, keys_tensor=None, values_floats=None,
                  values_int64s=None, values_strings=None, values_tensor=None):
    """Map each element through keys -> values; unknown keys take the default.

    Opset 1 maps between strings and their index in classes_strings instead.
    """
    x = to_numpy(X)
    items = x.reshape(-1).tolist()
    if classes_strings is not None:  # opset 1
        if x.dtype == object:
            table = {s: i for i, s in enumerate(classes_strings)}
            out = np.array([table.get(s, default_int64) for s in items], dtype=np.int64)
        else:
            out = np.array([classes_strings[i] if 0 <= i < len(classes_strings) else default_string
                            for i in items], dtype=object)
        return from_numpy(out.reshape(x.shape))
    keys = keys_strings or keys_int64s or keys_floats or _plain_list(keys_tensor)
    if values_tensor is not None:
        values = _plain_list(values_tensor)
        out_dtype = to_numpy(values_tensor).dtype
        default = _plain_list(default_tensor)[0] if default_tensor is not None else None
        if default is None:
            default = "_Unused" if out_dtype == object else (-1 if out_dtype.kind in "iu" else -0.0)
    elif values_strings:
        values, out_dtype, default = values_strings, np.dtype(object), default_string
    elif values_int64s:
        values, out_dtype, default = values_int64s, np.dtype(np.int64), default_int64
    else:
        values, out_dtype, default = values_floats or [], np.dtype(np.float32), default_float
    table = dict(zip(keys, values))
    if x.dtype.kind == "f":
        # NaN keys match NaN inputs (a dict lookup alone would not)
        nan_value = next((v for k, v in table.items() if isinstance(k, float) and math.isnan(k)),
                         default)
        mapped = [nan_value if v != v else table.get(v, default) for v in items]
    else:
        mapped = [table.get(v, default) for v in items]
    out = np.array(mapped, dtype=out_dtype).reshape(x.shape)
    result = from_numpy(out)
    if isinstance(result, torch.Tensor) and isinstance(X, torch.Tensor):
        result = result.to(X.device)
    return result


_LEQ, _LT, _GTE, _GT, _EQ, _NEQ, _MEMBER = range(7)


@register("TreeEnsemble", domain=ML, min_opset=5)
def tree_ensemble(ctx, X, *, aggregate_function=1, leaf_targetids, leaf_weights,
                  membership_values=None, n_targets=None, nodes_falseleafs, nodes_falsenodeids,
                  nodes_featureids, nodes_hitrates=None, nodes_missing_value_tracks_true=None,
                  nodes_modes, nodes_splits, nodes_trueleafs, nodes_truenodeids,
                  post_transform=0, tree_roots):
    """All samples walk all trees at once, one tree level per step.

    X [N, F] -> [N, n_targets]; per tree the reached leaf adds (weight, target), then the
    aggregate (0 average, 1 sum, 2 min, 3 max) and the post transform.
    """
    device = X.device
    x = X.reshape(X.shape[0], -1)
    long = lambda v: torch.tensor(ints(v), dtype=torch.int64, device=device)  # noqa: E731
    feature, true_id, false_id = long(nodes_featureids), long(nodes_truenodeids), long(nodes_falsenodeids)
    true_leaf, false_leaf = long(nodes_trueleafs).bool(), long(nodes_falseleafs).bool()
    modes = long(nodes_modes)
    splits = torch.as_tensor(_plain_list(nodes_splits), dtype=x.dtype, device=device)
    tracks = nodes_missing_value_tracks_true or [0] * len(modes)
    missing_true = torch.tensor([bool(v) for v in tracks], device=device)
    members = _membership_table(membership_values, ints(nodes_modes), x.dtype, device)

    roots = long(tree_roots)
    index = roots.expand(x.shape[0], -1).clone()  # [N, T] node (or leaf) index
    at_leaf = (true_leaf[roots] & false_leaf[roots] & (true_id[roots] == false_id[roots]))
    at_leaf = at_leaf.expand_as(index).clone()
    rows = torch.arange(x.shape[0], device=device).unsqueeze(1)
    while not bool(at_leaf.all()):
        node = torch.where(at_leaf, torch.zeros_like(index), index)
        value = x[rows, feature[node]]  # [N, T]
        split, mode = splits[node], modes[node]
        comparisons = torch.stack([value <= split, value < split, value >= split, value > split,
                                   value == split, value != split,
                                   (value.unsqueeze(-1) == members[node]).any(-1)])
        goes_true = comparisons.gather(0, mode.unsqueeze(0)).squeeze(0)
        goes_true = goes_true | (torch.isnan(value) & missing_true[node])
        next_index = torch.where(goes_true, true_id[node], false_id[node])
        next_leaf = torch.where(goes_true, true_leaf[node], false_leaf[node])
        index = torch.where(at_leaf, index, next_index)
        at_leaf = at_leaf | next_leaf

    weights = torch.as_tensor(_plain_list(leaf_weights), dtype=x.dtype, device=device)[index]
    targets = long(leaf_targetids)[index]  # [N, T]
    n_out = n_targets or int(targets.max()) + 1
    if aggregate_function in (0, 1):
        out = torch.zeros((x.shape[0], n_out), dtype=x.dtype, device=device)
        out.scatter_add_(1, targets, weights)
        if aggregate_function == 0:
            out = out / roots.numel()
    else:
        info = torch.finfo(x.dtype)
        start = info.max if aggregate_function == 2 else info.min
        out = torch.full((x.shape[0], n_out), start, dtype=x.dtype, device=device)
        out.scatter_reduce_(1, targets, weights, reduce="amin" if aggregate_function == 2 else "amax")
    return _post_transform(out, post_transform)


def _membership_table(membership_values, modes: list[int], dtype, device) -> torch.Tensor:
    """[num_nodes, max_members] set members per MEMBER node, NaN padded (NaN never matches)."""
    sets: list[list[float]] = [[] for _ in modes]
    if membership_values is not None:
        flat = iter(_plain_list(membership_values))
        for n, mode in enumerate(modes):
            if mode == _MEMBER:
                for v in flat:
                    if v != v:  # NaN ends this node's set
                        break
                    sets[n].append(v)
    width = max((len(s) for s in sets), default=0) or 1
    table = torch.full((len(modes), width), float("nan"), dtype=dtype, device=device)
    for n, s in enumerate(sets):
        if s:
            table[n, : len(s)] = torch.tensor(s, dtype=dtype)
    return table


def _post_transform(scores: torch.Tensor, kind: int) -> torch.Tensor:
    if kind == 0:  # NONE
        return scores
    if kind == 1:  # SOFTMAX
        return torch.softmax(scores, dim=-1)
    if kind == 2:  # LOGISTIC
        return torch.sigmoid(scores)
    if kind == 3:  # SOFTMAX_ZERO: softmax over the non-zero entries, zeros stay zero
        nonzero = scores != 0
        exp = torch.where(nonzero, torch.exp(scores - scores.max(dim=-1, keepdim=True).values), 0)
        return exp / exp.sum(dim=-1, keepdim=True).clamp_min(torch.finfo(scores.dtype).tiny)
    if kind == 4:  # PROBIT
        return math.sqrt(2) * torch.erfinv(2 * scores - 1)
    raise ValueError(f"TreeEnsemble: unknown post_transform {kind}")
