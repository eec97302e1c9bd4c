"""Images -> the pixel arrays and placeholder counts a vision-language model reads (issue 59, item 3).

Our own preprocessing, equal to transformers' image processors, in numpy and Pillow only: transformers' default
processors run on torch and torchvision, which Grain's data workers should not import (and which a CPU host may
lack). Each scheme is a small dataclass built from the checkpoint's `preprocessor_config.json` and one pure
function from a Pillow image to numpy arrays:

    qwen_vl     Qwen2-VL / Qwen3-VL / Qwen3.5: smart_resize to a multiple of patch x merge within min/max pixels,
                bicubic, rescale and normalise, patches of C x T x p x p (the one frame repeated over T),
                grid (t, h, w) and t*h*w / merge**2 placeholders
    gemma4      Gemma 4: the largest multiple of pooling x patch keeping the aspect ratio within max_soft_tokens x
                pooling**2 patches, bicubic, rescale only, patches of p x p x C padded to the budget, positions,
                h*w / pooling**2 soft tokens
    images_llama4.py  Llama 4's tiles (the best-fit canvas, padding, a global thumbnail)

towers.py picks a model's scheme from its tower's config (for_tower).

The steps match transformers' PIL backend (`Qwen2VLImageProcessorPil`, `Gemma4ImageProcessorPil`) bit for bit in
float32: an image becomes RGB (transparency composited onto white), is resized as uint8 by Pillow, rescaled in
float64 then cast to float32, and normalised in float32. tests/data/test_images.py compares them. transformers'
default (torchvision) backends differ from their own PIL backends where a side is upscaled (torch's bicubic is not
Pillow's), on the same shapes, grids and token counts; the test measures by how much when torchvision is installed.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from maxtrain.data.errors import DataError
from maxtrain.errors import require

BICUBIC, BILINEAR = 3, 2  # Pillow's resampling filter numbers (what preprocessor_config.json's "resample" holds)
RESCALE = 1 / 255


def pillow():
    """The PIL.Image module, or MissingPackage naming the extra that installs it."""
    return require("PIL.Image", "image preprocessing", "pip install 'maxtrain[vision]'")


def rgb(image) -> np.ndarray:
    """A Pillow image (or a uint8 array [H, W], [H, W, 3] or [H, W, 4]) as uint8 RGB [H, W, 3]; transparency is
    composited onto white, as transformers' convert_to_rgb does."""
    image_lib = pillow()
    if isinstance(image, np.ndarray):
        if image.dtype != np.uint8 or image.ndim not in (2, 3) or (image.ndim == 3 and image.shape[2] not in (3, 4)):
            raise DataError(f"an image array must be uint8 [H, W], [H, W, 3] or [H, W, 4], got {image.dtype} "
                            f"{list(image.shape)}; convert it to 8-bit grayscale, RGB or RGBA first")
        image = image_lib.fromarray(image)
    if not isinstance(image, image_lib.Image):
        raise DataError(f"an image must be a PIL.Image.Image or a uint8 numpy array, got {type(image).__name__}")
    try:
        if "A" in image.getbands() or image.info.get("transparency") is not None:
            white = image_lib.new("RGBA", image.size, (255, 255, 255, 255))
            image = image_lib.alpha_composite(white, image.convert("RGBA"))
        image = image.convert("RGB")
    except (ValueError, OSError) as e:
        raise DataError(f"an image of mode {image.mode} cannot be converted to RGB ({e}); save it as 8-bit RGB, "
                        "RGBA or grayscale (L)") from None
    return np.asarray(image, dtype=np.uint8)


def resize(pixels: np.ndarray, height: int, width: int, resample: int) -> np.ndarray:
    """uint8 [H, W, 3] resized by Pillow to [height, width, 3] with filter `resample` (BICUBIC, BILINEAR)."""
    return np.asarray(pillow().fromarray(pixels).resize((width, height), resample=resample), dtype=np.uint8)


def rescale_normalize(pixels: np.ndarray, rescale: float, mean=None, std=None) -> np.ndarray:
    """uint8 [H, W, C] -> float32 [C, H, W]: x * rescale (in float64, then float32), then (x - mean) / std in float32
    when mean and std are given (transformers' numpy rescale and normalize, in their order and precisions)."""
    x = (pixels.astype(np.float64) * rescale).astype(np.float32)
    if mean is not None:
        x = (x - np.asarray(mean, dtype=np.float32)) / np.asarray(std, dtype=np.float32)
    return np.ascontiguousarray(x.transpose(2, 0, 1))


def positive(name: str, value, source: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise DataError(f"{source}: {name} must be a positive integer, got {value!r}; fix it in the checkpoint's "
                        "preprocessor_config.json")
    return value


def channels(name: str, value, source: str) -> tuple[float, float, float]:
    if not isinstance(value, (list, tuple)) or len(value) != 3 or not all(isinstance(v, (int, float)) for v in value):
        raise DataError(f"{source}: {name} must be 3 numbers (one per RGB channel), got {value!r}; fix it in the "
                        "checkpoint's preprocessor_config.json")
    if name == "image_std" and any(v <= 0 for v in value):
        raise DataError(f"{source}: image_std must be positive, got {value!r}; fix it in preprocessor_config.json")
    return tuple(float(v) for v in value)


def resample_filter(value, source: str) -> int:
    value = int(value)
    if value not in (BICUBIC, BILINEAR):
        raise DataError(f"{source}: resample={value} is not supported (3 = bicubic, 2 = bilinear)")
    return value


# --- Qwen2-VL, Qwen3-VL, Qwen3.5 ------------------------------------------------------------------------------------

MAX_ASPECT_RATIO = 200


def smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """(h, w), both multiples of `factor`, near (height, width) with the aspect ratio kept and h*w within
    [min_pixels, max_pixels] (Qwen2-VL's rule: round to the factor; if over max_pixels scale down and floor, if
    under min_pixels scale up and ceil; Python's round, so halves go to the even multiple)."""
    if height <= 0 or width <= 0:
        raise DataError(f"an image of {height}x{width} pixels is empty; drop it from the data")
    if max(height, width) / min(height, width) > MAX_ASPECT_RATIO:
        raise DataError(f"an image of {height}x{width} pixels has an aspect ratio over {MAX_ASPECT_RATIO} (the "
                        f"most Qwen's vision encoder takes); crop or pad it, or drop it from the data")
    h = round(height / factor) * factor
    w = round(width / factor) * factor
    if h * w > max_pixels:
        beta = math.sqrt(height * width / max_pixels)
        h = max(factor, math.floor(height / beta / factor) * factor)
        w = max(factor, math.floor(width / beta / factor) * factor)
    elif h * w < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h = math.ceil(height * beta / factor) * factor
        w = math.ceil(width * beta / factor) * factor
    return h, w


@dataclasses.dataclass(frozen=True)
class QwenVisionPreprocess:
    """Qwen2-VL's image preprocessing. The defaults are transformers' (Qwen2-VL's: a key missing from a config means
    them); Qwen3-VL and Qwen3.5 checkpoints set patch_size 16 and their own pixel range and mean/std (QWEN3_VL)."""
    patch_size: int = 14
    temporal_patch_size: int = 2
    merge_size: int = 2
    min_pixels: int = 56 * 56
    max_pixels: int = 28 * 28 * 1280
    image_mean: tuple = (0.48145466, 0.4578275, 0.40821073)  # OpenAI CLIP's, transformers' default
    image_std: tuple = (0.26862954, 0.26130258, 0.27577711)
    rescale_factor: float = RESCALE
    do_normalize: bool = True
    resample: int = BICUBIC
    source: str = "QwenVisionPreprocess"

    def __post_init__(self):
        for name in ("patch_size", "temporal_patch_size", "merge_size", "min_pixels", "max_pixels"):
            positive(name, getattr(self, name), self.source)
        if self.min_pixels > self.max_pixels:
            raise DataError(f"{self.source}: min_pixels={self.min_pixels} is over max_pixels={self.max_pixels}; "
                            "make min_pixels (size.shortest_edge) at most max_pixels (size.longest_edge)")
        if self.max_pixels < self.factor ** 2:
            raise DataError(f"{self.source}: max_pixels={self.max_pixels} is under one merged patch "
                            f"({self.factor}x{self.factor}); raise it")
        channels("image_mean", self.image_mean, self.source)
        channels("image_std", self.image_std, self.source)
        resample_filter(self.resample, self.source)

    @property
    def factor(self) -> int:
        return self.patch_size * self.merge_size

    @classmethod
    def from_config(cls, config: dict, source: str = "preprocessor_config.json") -> "QwenVisionPreprocess":
        """From the dict transformers writes (`size: {shortest_edge, longest_edge}` or the older
        `min_pixels`/`max_pixels`, patch_size, temporal_patch_size, merge_size, image_mean, image_std, ...)."""
        size = config.get("size") or {}
        kwargs = dict(min_pixels=config.get("min_pixels", size.get("shortest_edge", cls.min_pixels)),
                      max_pixels=config.get("max_pixels", size.get("longest_edge", cls.max_pixels)))
        kwargs.update({k: config[k] for k in ("patch_size", "temporal_patch_size", "merge_size") if k in config})
        kwargs.update(common_keys(config, cls, source))
        return cls(source=source, **kwargs)


# The keys of Qwen3-VL's preprocessor_config.json (patch 16, merge 2, 64k to 16M pixels, mean and std 0.5)
QWEN3_VL = dict(patch_size=16, temporal_patch_size=2, merge_size=2, size={"shortest_edge": 65536,
                "longest_edge": 16777216}, image_mean=[0.5, 0.5, 0.5], image_std=[0.5, 0.5, 0.5])


def common_keys(config: dict, cls, source: str) -> dict:
    """The rescale/normalise/resample keys every scheme shares, with the class' defaults."""
    kwargs = {}
    for name in ("image_mean", "image_std"):
        if name in config:
            kwargs[name] = channels(name, config[name], source)
    if config.get("do_rescale", True) is False:
        raise DataError(f"{source}: do_rescale=false is not supported (pixels are always rescaled); remove it")
    if "rescale_factor" in config:
        kwargs["rescale_factor"] = float(config["rescale_factor"])
    if "do_normalize" in config:
        kwargs["do_normalize"] = bool(config["do_normalize"])
    if "resample" in config:
        kwargs["resample"] = resample_filter(config["resample"], source)
    return kwargs


@dataclasses.dataclass
class QwenImage:
    pixel_values: np.ndarray  # float32 [grid_t * grid_h * grid_w, C * temporal_patch_size * patch_size**2]
    grid_thw: tuple           # (t, h, w) in patches
    num_tokens: int           # placeholders in the text: t * h * w / merge_size**2


def qwen_num_tokens(height: int, width: int, spec: QwenVisionPreprocess) -> int:
    """The number of image placeholder tokens an image of height x width pixels gets."""
    h, w = smart_resize(height, width, spec.factor, spec.min_pixels, spec.max_pixels)
    return (h // spec.patch_size) * (w // spec.patch_size) // spec.merge_size ** 2


def qwen_patches(x: np.ndarray, patch_size: int, merge_size: int, temporal_patch_size: int) -> np.ndarray:
    """float [C, H, W] -> [H/p * W/p, C * T * p * p], patches in merge-block order (each merge x merge block of
    patches together, blocks row by row), each patch's values channel, frame, row, column (the frame repeated)."""
    c, height, width = x.shape
    gh, gw, m, p = height // patch_size, width // patch_size, merge_size, patch_size
    blocks = x.reshape(c, gh // m, m, p, gw // m, m, p).transpose(1, 4, 2, 5, 0, 3, 6)
    frames = np.broadcast_to(blocks[:, :, :, :, :, None], (*blocks.shape[:5], temporal_patch_size, p, p))
    return frames.reshape(gh * gw, c * temporal_patch_size * p * p)


def qwen_vl(image, spec: QwenVisionPreprocess) -> QwenImage:
    """One image -> Qwen-VL's pixel_values, image_grid_thw row and placeholder count."""
    pixels = rgb(image)
    h, w = smart_resize(pixels.shape[0], pixels.shape[1], spec.factor, spec.min_pixels, spec.max_pixels)
    pixels = resize(pixels, h, w, spec.resample)
    x = rescale_normalize(pixels, spec.rescale_factor, *((spec.image_mean, spec.image_std) if spec.do_normalize
                                                          else ()))
    grid = (1, h // spec.patch_size, w // spec.patch_size)
    patches = qwen_patches(x, spec.patch_size, spec.merge_size, spec.temporal_patch_size)
    return QwenImage(patches, grid, grid[0] * grid[1] * grid[2] // spec.merge_size ** 2)


# --- Gemma 4 ------------------------------------------------------------------------------------------------------

GEMMA4_SOFT_TOKENS = (70, 140, 280, 560, 1120)


@dataclasses.dataclass(frozen=True)
class Gemma4VisionPreprocess:
    """Gemma 4's image preprocessing: pixels in [0, 1] (no normalisation), at most max_soft_tokens tokens."""
    patch_size: int = 16
    max_soft_tokens: int = 280
    pooling_kernel_size: int = 3
    rescale_factor: float = RESCALE
    do_normalize: bool = False
    image_mean: tuple = (0.0, 0.0, 0.0)
    image_std: tuple = (1.0, 1.0, 1.0)
    resample: int = BICUBIC
    source: str = "Gemma4VisionPreprocess"

    def __post_init__(self):
        for name in ("patch_size", "max_soft_tokens", "pooling_kernel_size"):
            positive(name, getattr(self, name), self.source)
        if self.max_soft_tokens not in GEMMA4_SOFT_TOKENS:
            raise DataError(f"{self.source}: max_soft_tokens={self.max_soft_tokens} is not one Gemma 4 was trained "
                            f"with; choose one of {GEMMA4_SOFT_TOKENS}")
        channels("image_mean", self.image_mean, self.source)
        channels("image_std", self.image_std, self.source)
        resample_filter(self.resample, self.source)

    @property
    def max_patches(self) -> int:
        return self.max_soft_tokens * self.pooling_kernel_size ** 2

    @classmethod
    def from_config(cls, config: dict, source: str = "preprocessor_config.json") -> "Gemma4VisionPreprocess":
        kwargs = {k: config[k] for k in ("patch_size", "max_soft_tokens", "pooling_kernel_size") if k in config}
        return cls(source=source, **kwargs, **common_keys(config, cls, source))


def gemma4_size(height: int, width: int, spec: Gemma4VisionPreprocess) -> tuple[int, int]:
    """The largest (h, w), multiples of pooling x patch, near the aspect ratio of height x width with at most
    max_patches patches; a side that would round to 0 becomes one unit, the other floor(ratio) units (capped)."""
    unit = spec.pooling_kernel_size * spec.patch_size
    scale = math.sqrt(spec.max_patches * spec.patch_size ** 2 / (height * width))
    h = int(math.floor(scale * height / unit)) * unit
    w = int(math.floor(scale * width / unit)) * unit
    if h == 0 and w == 0:
        raise DataError(f"an image of {height}x{width} pixels resizes to 0x0 for Gemma 4; drop it from the data")
    longest = spec.max_patches // spec.pooling_kernel_size ** 2 * unit
    if h == 0:
        h, w = unit, min(int(math.floor(width / height)) * unit, longest)
    elif w == 0:
        h, w = min(int(math.floor(height / width)) * unit, longest), unit
    if h * w > spec.max_patches * spec.patch_size ** 2:
        raise DataError(f"an image of {height}x{width} pixels is too elongated for Gemma 4 ({h}x{w} is over "
                        f"{spec.max_patches} patches); crop or pad it, or drop it from the data")
    return h, w


@dataclasses.dataclass
class Gemma4Image:
    pixel_values: np.ndarray  # float32 [max_patches, p * p * C], rows past the image's patches are 0
    position_ids: np.ndarray  # int [max_patches, 2]: (column, row) of each patch, -1 for the padding rows
    num_tokens: int           # soft tokens: patches / pooling_kernel_size**2


def gemma4(image, spec: Gemma4VisionPreprocess) -> Gemma4Image:
    """One image -> Gemma 4's padded patches, their positions and the soft-token count."""
    pixels = rgb(image)
    h, w = gemma4_size(pixels.shape[0], pixels.shape[1], spec)
    if (h, w) != pixels.shape[:2]:
        pixels = resize(pixels, h, w, spec.resample)
    x = rescale_normalize(pixels, spec.rescale_factor, *((spec.image_mean, spec.image_std) if spec.do_normalize
                                                          else ()))
    p, c = spec.patch_size, x.shape[0]
    rows, columns = h // p, w // p
    patches = x.reshape(c, rows, p, columns, p).transpose(1, 3, 2, 4, 0).reshape(rows * columns, p * p * c)
    column, row = np.meshgrid(np.arange(columns), np.arange(rows), indexing="xy")
    positions = np.stack([column, row], axis=-1).reshape(rows * columns, 2)
    pad = spec.max_patches - rows * columns
    patches = np.pad(patches, [(0, pad), (0, 0)])
    positions = np.pad(positions, [(0, pad), (0, 0)], constant_values=-1)
    return Gemma4Image(patches, positions, rows * columns // spec.pooling_kernel_size ** 2)
