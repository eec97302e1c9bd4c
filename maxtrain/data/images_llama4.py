"""Llama 4's image tiles in numpy and Pillow (issue 59, item 3; images.py has the other schemes and says why).

An image is fitted without distortion onto the best canvas of tile x tile squares (at most max_tiles of them),
padded with black at the bottom and right, cut into tiles row by row, and, when there is more than one tile,
followed by the whole image squashed to one tile (the global thumbnail). transformers' `Llama4ImageProcessor`
has no PIL backend: it resizes with torchvision (bilinear, antialiased, on uint8) and rescales and normalises in
bfloat16. We resize with Pillow's bilinear filter and round to bfloat16 the way torch does, so the values are
bfloat16 numbers held in float32; tests/data/test_images.py measures how close that comes.

The text side: `<|image_start|>`, then per tile row the tiles' `<|patch|>` runs joined by `<|tile_x_separator|>`
and ended by `<|tile_y_separator|>` (only when there is more than one tile), then `<|image|>`, the thumbnail's
(or the single tile's) patches and `<|image_end|>`; each tile has (tile / patch_size)**2 / downsample patches.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from maxtrain.data.errors import DataError
from maxtrain.data import images


@dataclasses.dataclass(frozen=True)
class Llama4VisionPreprocess:
    """Llama 4's image preprocessing (transformers' defaults: 336-pixel tiles, at most 16, patches of 14)."""
    tile_size: int = 336
    max_tiles: int = 16              # transformers' `max_patches`
    resize_to_max_canvas: bool = False
    patch_size: int = 14             # the vision encoder's (processor_config / vision_config), for the token count
    pixel_shuffle_ratio: float = 0.5
    image_mean: tuple = (0.5, 0.5, 0.5)
    image_std: tuple = (0.5, 0.5, 0.5)
    rescale_factor: float = images.RESCALE
    do_normalize: bool = True
    resample: int = images.BILINEAR
    source: str = "Llama4VisionPreprocess"

    def __post_init__(self):
        for name in ("tile_size", "max_tiles", "patch_size"):
            images.positive(name, getattr(self, name), self.source)
        if not 0 < self.pixel_shuffle_ratio <= 1:
            raise DataError(f"{self.source}: pixel_shuffle_ratio must be in (0, 1], got {self.pixel_shuffle_ratio}")
        if self.tile_size % self.patch_size:
            raise DataError(f"{self.source}: tile_size={self.tile_size} is not a multiple of patch_size="
                            f"{self.patch_size}; use the checkpoint's own sizes")
        images.channels("image_mean", self.image_mean, self.source)
        images.channels("image_std", self.image_std, self.source)
        images.resample_filter(self.resample, self.source)

    @property
    def tokens_per_tile(self) -> int:
        downsample = int(round(1.0 / self.pixel_shuffle_ratio ** 2))
        return (self.tile_size // self.patch_size) ** 2 // downsample

    @classmethod
    def from_config(cls, config: dict, source: str = "preprocessor_config.json") -> "Llama4VisionPreprocess":
        """From the image processor's dict (`size: {height, width}`, max_patches, resize_to_max_canvas, ...);
        patch_size and pixel_shuffle_ratio are the processor's (processor_config.json), read here when present."""
        kwargs = {}
        size = config.get("size") or {}
        if size:
            if size.get("height") != size.get("width"):
                raise DataError(f"{source}: size must be square (height = width), got {size}")
            kwargs["tile_size"] = size["height"]
        for ours, theirs in (("max_tiles", "max_patches"), ("resize_to_max_canvas", "resize_to_max_canvas"),
                             ("patch_size", "patch_size"), ("pixel_shuffle_ratio", "pixel_shuffle_ratio")):
            if theirs in config:
                kwargs[ours] = config[theirs]
        return cls(source=source, **kwargs, **images.common_keys(config, cls, source))


def canvases(max_tiles: int, tile_size: int) -> list[tuple[int, int]]:
    """Every (height, width) of rows x columns tiles with at most max_tiles tiles, grouped by aspect ratio in the
    order the ratios first appear counting tiles down from max_tiles (transformers' order, which breaks ties)."""
    by_ratio: dict[float, list] = {}
    for count in range(max_tiles, 0, -1):
        for rows in sorted(d for d in range(1, count + 1) if count % d == 0):
            by_ratio.setdefault(rows / (count // rows), []).append((rows, count // rows))
    return [(rows * tile_size, columns * tile_size) for group in by_ratio.values() for rows, columns in group]


def best_canvas(height: int, width: int, spec: Llama4VisionPreprocess) -> tuple[int, int]:
    """The canvas the image is fitted onto: the smallest upscale >= 1 (the largest with resize_to_max_canvas),
    else the mildest downscale; among equal scales the smallest area (the first listed). Scales in float32."""
    options = np.asarray(canvases(spec.max_tiles, spec.tile_size), dtype=np.int64)
    scale_h = options[:, 0].astype(np.float32) / np.float32(height)
    scale_w = options[:, 1].astype(np.float32) / np.float32(width)
    scales = np.where(scale_h > scale_w, scale_w, scale_h)
    up = scales[scales >= 1]
    if up.size:
        chosen = up.max() if spec.resize_to_max_canvas else up.min()
    else:
        chosen = scales[scales < 1].max()
    candidates = options[scales == chosen]
    best = candidates[np.argmin(candidates[:, 0] * candidates[:, 1])]
    return int(best[0]), int(best[1])


def fitted_size(height: int, width: int, canvas: tuple[int, int], spec: Llama4VisionPreprocess) -> tuple[int, int]:
    """The size the image is resized to inside `canvas`: its aspect ratio kept, never upscaled past
    max(own side, tile_size) unless resize_to_max_canvas. Where transformers divides torch integers (the canvas'
    sides) the quotient is float32, elsewhere float64; so here."""
    def limit(side, canvas_side):
        if spec.resize_to_max_canvas:
            return np.int64(canvas_side)
        bound = max(side, spec.tile_size)
        return np.int64(canvas_side) if canvas_side < bound else bound  # python's min keeps the first of equals

    target_h, target_w = limit(height, canvas[0]), limit(width, canvas[1])

    def ratio(target, side):
        return np.float32(target) / np.float32(side) if isinstance(target, np.integer) else target / side

    scale_h, scale_w = ratio(target_h, height), ratio(target_w, width)
    if scale_w < scale_h:
        new_h, new_w = min(int(np.floor(height * scale_w)), int(target_h)), int(target_w)
    else:
        new_h, new_w = int(target_h), min(int(np.floor(width * scale_h)), int(target_w))
    return max(new_h, 1), max(new_w, 1)


def bfloat16(x: np.ndarray) -> np.ndarray:
    """float32 values rounded to the nearest bfloat16 (ties to even), returned as float32."""
    bits = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    rounded = (bits + np.uint32(0x7FFF) + ((bits >> 16) & np.uint32(1))) & np.uint32(0xFFFF0000)
    return rounded.view(np.float32)


def _rescale_normalize(pixels: np.ndarray, spec: Llama4VisionPreprocess) -> np.ndarray:
    """uint8 [H, W, C] -> [C, H, W]: with normalisation each step rounded to bfloat16 as transformers does
    (x * rescale, - mean, / std); without it x * rescale in float32."""
    x = pixels.transpose(2, 0, 1).astype(np.float32)
    if not spec.do_normalize:
        return x * np.float32(spec.rescale_factor)
    mean = bfloat16(np.asarray(spec.image_mean, np.float32))[:, None, None]
    std = bfloat16(np.asarray(spec.image_std, np.float32))[:, None, None]
    x = bfloat16(x * np.float32(spec.rescale_factor))
    return bfloat16(bfloat16(x - mean) / std)


@dataclasses.dataclass
class Llama4Image:
    pixel_values: np.ndarray  # float32 (bfloat16 values) [tiles (+1 thumbnail when tiles > 1), C, tile, tile]
    aspect_ratio: tuple       # (rows, columns) of tiles
    tokens: list              # the image's token strings, <|image_start|> ... <|image_end|>

    @property
    def num_tokens(self) -> int:
        return len(self.tokens)


def image_tokens(rows: int, columns: int, per_tile: int) -> list[str]:
    """Llama 4's token layout of an image of rows x columns tiles with `per_tile` patch tokens each."""
    tokens = ["<|image_start|>"]
    if rows * columns > 1:
        for _ in range(rows):
            for column in range(columns):
                tokens += ["<|patch|>"] * per_tile
                if column < columns - 1:
                    tokens.append("<|tile_x_separator|>")
            tokens.append("<|tile_y_separator|>")
    return tokens + ["<|image|>"] + ["<|patch|>"] * per_tile + ["<|image_end|>"]


def llama4(image, spec: Llama4VisionPreprocess) -> Llama4Image:
    """One image -> Llama 4's tiles (and thumbnail), its tile grid and its tokens."""
    pixels = images.rgb(image)
    height, width = pixels.shape[:2]
    canvas = best_canvas(height, width, spec)
    new_h, new_w = fitted_size(height, width, canvas, spec)
    fitted = images.resize(pixels, new_h, new_w, spec.resample)
    padded = np.zeros((*canvas, 3), np.uint8)
    padded[:new_h, :new_w] = fitted
    x = _rescale_normalize(padded, spec)
    rows, columns, t = canvas[0] // spec.tile_size, canvas[1] // spec.tile_size, spec.tile_size
    tiles = x.reshape(3, rows, t, columns, t).transpose(1, 3, 0, 2, 4).reshape(rows * columns, 3, t, t)
    if rows * columns > 1:
        thumbnail = _rescale_normalize(images.resize(pixels, t, t, spec.resample), spec)
        tiles = np.concatenate([tiles, thumbnail[None]])
    return Llama4Image(np.ascontiguousarray(tiles), (rows, columns), image_tokens(rows, columns, spec.tokens_per_tile))


# --- the tower's images in image conversations and image prompts (data/image_conversations.py) -------------------
#
# An image's tiles travel as patches, like the other towers' (so image_patches_per_row counts patches for every
# family): [tiles * s^2, C * p * p], each tile's s x s patches row-major, each patch channel-major (the order the
# encoder unfolds them in); `tiles_of` puts them back into the tiles [tiles, C, S, S] Vision.inputs takes.

PIECES = ("<|image_start|>", "<|image|>", "<|patch|>", "<|tile_x_separator|>", "<|tile_y_separator|>",
          "<|image_end|>")
MARKER = "<|image|>"  # what Llama 4's chat template writes for an image, and Llama4Processor expands


def patches_per_tile(spec: Llama4VisionPreprocess) -> int:
    return (spec.tile_size // spec.patch_size) ** 2


def patches_of(tiles: np.ndarray, spec: Llama4VisionPreprocess) -> np.ndarray:
    """[tiles, C, S, S] -> [tiles * s^2, C * p * p]."""
    t, c, s, p = tiles.shape[0], tiles.shape[1], spec.tile_size // spec.patch_size, spec.patch_size
    x = tiles.reshape(t, c, s, p, s, p).transpose(0, 2, 4, 1, 3, 5)
    return np.ascontiguousarray(x.reshape(t * s * s, c * p * p))


def tiles_of(patches: np.ndarray, spec: Llama4VisionPreprocess) -> np.ndarray:
    """patches_of undone: [tiles * s^2, C * p * p] -> [tiles, C, S, S]."""
    s, p = spec.tile_size // spec.patch_size, spec.patch_size
    patches = np.asarray(patches)
    c = patches.shape[1] // (p * p)
    x = patches.reshape(-1, s, s, c, p, p).transpose(0, 3, 1, 4, 2, 5)
    return np.ascontiguousarray(x.reshape(-1, c, s * p, s * p))


def tower_image(image, spec: Llama4VisionPreprocess):
    """towers.TowerImages' map: (patch arrays, grid (tiles, s, s), the <|patch|> count, the image's token texts)."""
    out = llama4(image, spec)
    tiles, side = out.pixel_values.shape[0], spec.tile_size // spec.patch_size
    return ({"pixel_values": patches_of(out.pixel_values, spec)}, (tiles, side, side),
            out.tokens.count("<|patch|>"), tuple(out.tokens))


def from_tower(vision_config: dict, processor: dict | None) -> Llama4VisionPreprocess:
    """The processor's spec (preprocessor_config.json's keys, else transformers' defaults) with the tower's own
    tile size, patch size and pixel shuffle; a processor whose tiles are not the tower's is refused."""
    keys = dict(processor or {})
    size = (keys.get("size") or {}).get("height")
    if size is not None and size != vision_config["image_size"]:
        raise DataError(f"preprocessor_config.json: size {keys['size']} makes tiles of {size} pixels but the tower "
                        f"reads tiles of image_size={vision_config['image_size']}; use the checkpoint's own "
                        "preprocessor_config.json")
    keys.update(size={"height": vision_config["image_size"], "width": vision_config["image_size"]},
                patch_size=vision_config["patch_size"], pixel_shuffle_ratio=vision_config["pixel_shuffle_ratio"])
    return Llama4VisionPreprocess.from_config(keys)
