"""Detection: NonMaxSuppression, RoiAlign; and ImageDecoder (through Pillow, when installed)."""

from __future__ import annotations

import io
import math

import numpy as np
import torch

from kiln.ops._util import scalar, to_numpy
from kiln.ops.registry import register


def _corners(boxes: torch.Tensor, center_point_box: int) -> torch.Tensor:
    """[N, 4] boxes -> (y1, x1, y2, x2) with y1 <= y2, x1 <= x2."""
    if center_point_box:  # [x_center, y_center, width, height]
        xc, yc, w, h = boxes.unbind(-1)
        return torch.stack([yc - h / 2, xc - w / 2, yc + h / 2, xc + w / 2], dim=-1)
    y1, x1, y2, x2 = boxes.unbind(-1)  # corners, possibly flipped
    return torch.stack([torch.minimum(y1, y2), torch.minimum(x1, x2),
                        torch.maximum(y1, y2), torch.maximum(x1, x2)], dim=-1)


def _iou(boxes: torch.Tensor) -> torch.Tensor:
    """[N, 4] corner boxes -> [N, N] intersection over union."""
    y1, x1, y2, x2 = boxes.unbind(-1)
    area = (y2 - y1) * (x2 - x1)
    height = (torch.minimum(y2[:, None], y2[None]) - torch.maximum(y1[:, None], y1[None])).clamp_min(0)
    width = (torch.minimum(x2[:, None], x2[None]) - torch.maximum(x1[:, None], x1[None])).clamp_min(0)
    inter = height * width
    union = area[:, None] + area[None] - inter
    return torch.where(union > 0, inter / union, torch.zeros_like(inter))


@register("NonMaxSuppression", min_opset=10)
def non_max_suppression(ctx, boxes, scores, max_output_boxes_per_class=None, iou_threshold=None,
                        score_threshold=None, *, center_point_box=0):
    """boxes [B, N, 4], scores [B, C, N] -> selected [K, 3] (batch, class, box) int64.

    Per batch and class: drop scores not above score_threshold, then greedily keep the best
    box and drop the others overlapping it by more than iou_threshold.
    """
    limit = int(scalar(max_output_boxes_per_class)) if max_output_boxes_per_class is not None else 0
    iou_limit = float(scalar(iou_threshold)) if iou_threshold is not None else 0.0
    floor = float(scalar(score_threshold)) if score_threshold is not None else None
    selected: list[tuple[int, int, int]] = []
    if limit > 0:
        for b in range(boxes.shape[0]):
            corners = _corners(boxes[b].double(), center_point_box)
            overlap = _iou(corners).cpu()
            for c in range(scores.shape[1]):
                s = scores[b, c].double().cpu()
                order = torch.argsort(s, descending=True, stable=True).tolist()
                if floor is not None:
                    order = [i for i in order if s[i] > floor]
                kept: list[int] = []
                for i in order:
                    if len(kept) >= limit:
                        break
                    if all(overlap[i, k] <= iou_limit for k in kept):
                        kept.append(i)
                selected += [(b, c, i) for i in kept]
    out = torch.tensor(selected, dtype=torch.int64, device=boxes.device)
    return out.reshape(-1, 3)


@register("RoiAlign", min_opset=10)
def roi_align(ctx, X, rois, batch_indices, *, coordinate_transformation_mode="half_pixel",
              mode="avg", output_height=1, output_width=1, sampling_ratio=0, spatial_scale=1.0):
    """X [N, C, H, W], rois [R, 4] (x1, y1, x2, y2) -> [R, C, output_height, output_width].

    Each output bin averages (or, for "max", takes the largest of) a grid of bilinear samples;
    opset 10 has no coordinate_transformation_mode and behaves as "output_half_pixel".
    """
    if ctx.opset < 16:
        coordinate_transformation_mode = "output_half_pixel"
    half_pixel = coordinate_transformation_mode == "half_pixel"
    height, width = X.shape[2], X.shape[3]
    out = X.new_zeros((rois.shape[0], X.shape[1], output_height, output_width))
    offset = 0.5 if half_pixel else 0.0
    for r, (roi, b) in enumerate(zip(rois.tolist(), batch_indices.reshape(-1).tolist())):
        x1, y1, x2, y2 = (v * spatial_scale - offset for v in roi)
        roi_w, roi_h = x2 - x1, y2 - y1
        if not half_pixel:
            roi_w, roi_h = max(roi_w, 1.0), max(roi_h, 1.0)
        bin_h, bin_w = roi_h / output_height, roi_w / output_width
        grid_h = sampling_ratio if sampling_ratio > 0 else math.ceil(roi_h / output_height)
        grid_w = sampling_ratio if sampling_ratio > 0 else math.ceil(roi_w / output_width)
        ys = _sample_axis(y1, bin_h, output_height, grid_h, height, X.device)  # [out_h·grid_h]
        xs = _sample_axis(x1, bin_w, output_width, grid_w, width, X.device)
        feature = X[int(b)].to(torch.float64)  # [C, H, W]
        (y_lo, y_hi, wy_lo, wy_hi, y_ok), (x_lo, x_hi, wx_lo, wx_hi, x_ok) = ys, xs
        valid = (y_ok[:, None] & x_ok[None, :]).to(feature.dtype)  # [Sy, Sx]
        terms = [
            (wy[:, None] * wx[None, :] * valid) * feature[:, yi][:, :, xi]
            for yi, wy in ((y_lo, wy_lo), (y_hi, wy_hi))
            for xi, wx in ((x_lo, wx_lo), (x_hi, wx_hi))
        ]  # each [C, Sy, Sx]
        channels = X.shape[1]
        if mode == "avg":
            samples = sum(terms).reshape(channels, output_height, grid_h, output_width, grid_w)
            pooled = samples.sum(dim=(2, 4)) / max(grid_h * grid_w, 1)
        elif mode == "max":
            samples = torch.stack(terms).amax(0).reshape(channels, output_height, grid_h, output_width, grid_w)
            pooled = samples.amax(dim=(2, 4))
        else:
            raise ValueError(f"RoiAlign: unknown mode {mode!r}")
        out[r] = pooled.to(out.dtype)
    return out


def _sample_axis(start: float, bin_size: float, bins: int, grid: int, size: int, device):
    """Bilinear sample positions along one axis: (low, high, low weight, high weight, valid)."""
    i = torch.arange(bins * grid, dtype=torch.float64, device=device)
    pos = start + (i // grid) * bin_size + ((i % grid) + 0.5) * bin_size / grid
    valid = (pos >= -1.0) & (pos <= size)
    pos = pos.clamp_min(0)
    low = pos.floor().long()
    at_edge = low >= size - 1
    low = torch.where(at_edge, torch.full_like(low, size - 1), low)
    high = torch.where(at_edge, low, low + 1)
    pos = torch.where(at_edge, low.double(), pos)
    frac = pos - low
    return low, high, 1 - frac, frac, valid


@register("ImageDecoder", min_opset=20)
def image_decoder(ctx, encoded_stream, *, pixel_format="RGB"):
    """Encoded bytes (uint8 [N]) -> [H, W, 3] (RGB or BGR) or [H, W, 1] (Grayscale) uint8."""
    try:
        from PIL import Image  # optional: only models that decode images need Pillow
    except ImportError as e:
        raise RuntimeError("ImageDecoder needs Pillow: pip install pillow") from e
    image = Image.open(io.BytesIO(to_numpy(encoded_stream).tobytes()))
    if pixel_format == "Grayscale":
        decoded = np.asarray(image.convert("L"))[:, :, None]
    elif pixel_format in ("RGB", "BGR"):
        decoded = np.asarray(image.convert("RGB"))
        if pixel_format == "BGR":
            decoded = decoded[:, :, ::-1]
    else:
        raise ValueError(f"ImageDecoder: unknown pixel_format {pixel_format!r}")
    return torch.from_numpy(np.ascontiguousarray(decoded))
