"""Calibration data: the batches a model sees while its activation ranges are measured.

    a folder of .npy / .npz files   one batch per file: .npz keyed by input name, .npy for a model
                                    with one input
    a folder of images              .jpg/.jpeg/.png/.bmp, preprocessed as declared ("imagenet":
                                    shorter side 256, centre crop 224, RGB in [0, 1], ImageNet mean/std,
                                    NCHW float32), one image per batch
    a Python iterable               of {input name: array} (the API)
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

from kiln.errors import KilnError

IMAGE_SUFFIXES = {".jpg", ".jpeg", ".png", ".bmp"}
PREPROCESSING = ("imagenet",)
_MEAN = np.array([0.485, 0.456, 0.406], np.float32)
_STD = np.array([0.229, 0.224, 0.225], np.float32)

Batch = dict[str, np.ndarray]


def imagenet(image: np.ndarray, size: int = 224) -> np.ndarray:
    """HWC uint8 (or float in [0, 1]) image -> [1, 3, size, size] float32, as torchvision's ImageNet models
    are fed: shorter side scaled to size * 256/224, centre crop, mean/std normalised."""
    from skimage.transform import resize  # scikit-image: only when images are given

    if image.ndim == 2:
        image = np.stack([image] * 3, axis=-1)
    image = image[..., :3]
    pixels = image.astype(np.float32) / (255.0 if image.dtype == np.uint8 else 1.0)
    h, w = pixels.shape[:2]
    short = round(size * 256 / 224)
    scale = short / min(h, w)
    pixels = resize(pixels, (max(short, round(h * scale)), max(short, round(w * scale))), anti_aliasing=True)
    h, w = pixels.shape[:2]
    top, left = (h - size) // 2, (w - size) // 2
    pixels = pixels[top:top + size, left:left + size]
    pixels = (pixels - _MEAN) / _STD
    return np.ascontiguousarray(pixels.transpose(2, 0, 1)[None].astype(np.float32))


def batches(source: Any, input_names: list[str], *, preprocessing: str = "imagenet",
            limit: int | None = None) -> Iterator[Batch]:
    """Calibration batches from a folder (arrays or images) or an iterable; at most `limit`."""
    if isinstance(source, (str, Path)):
        items: Iterable[Batch] = _folder(Path(source), input_names, preprocessing)
    elif isinstance(source, dict):
        items = [source]
    else:
        items = source
    for k, batch in enumerate(items):
        if limit is not None and k >= limit:
            return
        if not isinstance(batch, dict):
            if len(input_names) != 1:
                raise KilnError(f"calibration batch {k}: a bare array, but the model has inputs {input_names}; "
                                "give {name: array} dicts")
            batch = {input_names[0]: batch}
        missing = [n for n in input_names if n not in batch]
        if missing:
            raise KilnError(f"calibration batch {k} lacks input(s) {missing}; the model's inputs are {input_names}")
        yield {n: np.asarray(batch[n]) for n in input_names}


def _folder(folder: Path, input_names: list[str], preprocessing: str) -> Iterator[Batch]:
    if not folder.is_dir():
        raise KilnError(f"calibration data {folder}: no such folder")
    files = sorted(p for p in folder.iterdir() if p.is_file())
    arrays = [p for p in files if p.suffix in (".npy", ".npz")]
    images = [p for p in files if p.suffix.lower() in IMAGE_SUFFIXES]
    if not arrays and not images:
        raise KilnError(f"calibration data {folder}: no .npy, .npz or image files in it")
    for path in arrays:
        if path.suffix == ".npz":
            with np.load(path, allow_pickle=False) as npz:
                yield {k: npz[k] for k in npz.files}
        else:
            yield np.load(path, allow_pickle=False)
    if images:
        if preprocessing not in PREPROCESSING:
            raise KilnError(f"image preprocessing {preprocessing!r}: kiln knows {list(PREPROCESSING)}; "
                            "or give the preprocessed arrays as .npy/.npz files")
        if len(input_names) != 1:
            raise KilnError(f"images calibrate a model with one input; this one has {input_names}")
        from skimage.io import imread

        for path in images:
            yield {input_names[0]: imagenet(imread(path))}


# scikit-image's bundled photographs (others, e.g. eagle, would be downloaded: never here)
PHOTOS = ("astronaut", "chelsea", "coffee", "rocket", "cat", "camera", "hubble_deep_field", "immunohistochemistry",
          "retina", "colorwheel", "brick", "grass", "gravel", "clock", "coins", "moon")


def photo_variants(per_photo: int = 7, seed: int = 0) -> list[np.ndarray]:
    """Crops (a random 50-100% of each side, so also rescalings once resized to 224) and horizontal flips
    of scikit-image's photographs, preprocessed as `imagenet`: the image set of kiln's accuracy
    measurements (issue 12: >= 100 images; per_photo 7 gives 112)."""
    import skimage.data

    rng = np.random.default_rng(seed)
    out = []
    for name in PHOTOS:
        image = getattr(skimage.data, name)()
        h, w = image.shape[:2]
        for k in range(per_photo):
            s = rng.uniform(0.5, 1.0)
            ch, cw = int(h * s), int(w * s)
            y, x = rng.integers(0, h - ch + 1), rng.integers(0, w - cw + 1)
            crop = image[y:y + ch, x:x + cw]
            if k % 2:
                crop = crop[:, ::-1]
            out.append(imagenet(np.ascontiguousarray(crop)))
    return out
