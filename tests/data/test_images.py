"""Image preprocessing (maxtrain/data/images.py, images_llama4.py) against transformers' image processors.

Qwen-VL and Gemma 4 are compared with transformers' PIL backends (Qwen2VLImageProcessorPil,
Gemma4ImageProcessorPil), which they equal exactly; the processors are built from explicit tiny configs (no
downloads). Llama 4's processor needs torchvision (it has no PIL backend); without it only the token layout and the
canvas list are compared, with it the tiles too, within the tolerance measured for Pillow's bilinear filter
against torchvision's. The first tests need neither transformers nor torch.
"""

from __future__ import annotations

import itertools
import sys
import types

import numpy as np
import pytest

from maxtrain.data import DataError
from maxtrain.data import images
from maxtrain.data import images_llama4
from maxtrain.errors import MissingPackage

Image = pytest.importorskip("PIL.Image")

# (height, width): square, wide, tall, 4:3, under min_pixels, over max_pixels, odd sizes
SIZES = [(32, 32), (57, 300), (300, 57), (480, 640), (3, 5), (900, 1000), (65, 129)]


def noise(height, width, mode="RGB", seed=0):
    """A random image of the mode (RGBA with varied alpha, L grayscale, P with a transparent index)."""
    r = np.random.RandomState(seed + height * 7 + width)
    if mode == "L":
        return Image.fromarray(r.randint(0, 256, (height, width), dtype=np.uint8), mode="L")
    if mode == "RGBA":
        return Image.fromarray(r.randint(0, 256, (height, width, 4), dtype=np.uint8), mode="RGBA")
    image = Image.fromarray(r.randint(0, 256, (height, width, 3), dtype=np.uint8), mode="RGB")
    if mode == "P":
        image = image.convert("P")
        image.info["transparency"] = 0
    return image


# --- without transformers --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("factor,min_pixels,max_pixels", [(28, 56 * 56, 28 * 28 * 1280), (32, 32 * 32 * 4, 65536)])
def test_smart_resize_keeps_the_aspect_ratio_within_the_pixel_budget(factor, min_pixels, max_pixels):
    for height, width in itertools.product([1, 7, 31, 32, 57, 100, 480, 640, 999, 2048, 4000], repeat=2):
        if max(height, width) / min(height, width) > 10:
            continue
        h, w = images.smart_resize(height, width, factor, min_pixels, max_pixels)
        assert h % factor == 0 and w % factor == 0 and h > 0 and w > 0
        assert min_pixels <= h * w <= max_pixels, (height, width, h, w)
        # within one factor step of the aspect ratio, on each side
        assert (h - factor) / (w + factor) <= height / width <= (h + factor) / max(w - factor, 1), (height, width)


def test_smart_resize_known_values():
    assert images.smart_resize(480, 640, 28, 56 * 56, 28 * 28 * 1280) == (476, 644)  # rounded to 17 x 23 factors
    assert images.smart_resize(42, 42, 28, 0, 10**9) == (56, 56)  # 1.5 factors: Python's round, to even
    assert images.smart_resize(3, 5, 32, 4096, 65536) == (64, 96)  # under min_pixels: scaled up, ceiled
    assert images.smart_resize(900, 1000, 32, 4096, 65536) == (224, 256)  # over max_pixels: scaled down, floored
    with pytest.raises(DataError, match=r"1x1000 pixels has an aspect ratio over 200 .*crop or pad it"):
        images.smart_resize(1, 1000, 32, 4096, 65536)


def test_qwen_patches_are_in_merge_block_order():
    """Patch k of a 4x4 grid (merge 2): the 2x2 blocks row by row, inside a block its patches row by row; each
    row is channel, frame (the one frame twice), then the patch's pixels."""
    c, p, m, t = 3, 2, 2, 2
    x = np.arange(c * 8 * 8, dtype=np.float32).reshape(c, 8, 8)
    patches = images.qwen_patches(x, p, m, t)
    assert patches.shape == (16, c * t * p * p)
    order = [(0, 0), (0, 1), (1, 0), (1, 1), (0, 2), (0, 3), (1, 2), (1, 3), (2, 0), (2, 1), (3, 0), (3, 1)]
    for k, (row, column) in enumerate(order):
        patch = x[:, row * p:(row + 1) * p, column * p:(column + 1) * p]
        expected = np.stack([patch, patch], axis=1).reshape(-1)  # [C, T, p, p]
        np.testing.assert_array_equal(patches[k], expected, err_msg=f"patch {k}")


def test_qwen_one_image_end_to_end_numbers():
    spec = images.QwenVisionPreprocess(patch_size=16, min_pixels=32 * 32, max_pixels=64 * 64, image_mean=(0.5,) * 3,
                                       image_std=(0.5,) * 3)
    out = images.qwen_vl(Image.new("RGB", (64, 32), (255, 0, 128)), spec)  # PIL's size is (width, height)
    assert out.grid_thw == (1, 2, 4) and out.num_tokens == 2 and out.pixel_values.shape == (8, 3 * 2 * 16 * 16)
    red, green, blue = out.pixel_values[0].reshape(3, -1)
    np.testing.assert_allclose([red.max(), green.max(), blue.max()], [1.0, -1.0, (128 / 255 - 0.5) / 0.5], atol=1e-6)
    assert images.qwen_num_tokens(32, 64, spec) == 2


def test_transparency_is_composited_onto_white_and_gray_repeated():
    clear = Image.new("RGBA", (2, 2), (10, 20, 30, 0))
    np.testing.assert_array_equal(images.rgb(clear), np.full((2, 2, 3), 255, np.uint8))
    np.testing.assert_array_equal(images.rgb(Image.new("L", (2, 2), 7)), np.full((2, 2, 3), 7, np.uint8))
    with pytest.raises(DataError, match=r"mode La cannot be converted to RGB .*save it as 8-bit RGB"):
        images.rgb(Image.new("La", (2, 2)))
    with pytest.raises(DataError, match=r"must be uint8 \[H, W\], .* got float32 \[2, 2, 3\]; convert it"):
        images.rgb(np.zeros((2, 2, 3), np.float32))


@pytest.mark.parametrize("make,message", [
    (lambda: images.QwenVisionPreprocess.from_config({"size": {"shortest_edge": 9000, "longest_edge": 4000}}),
     r"min_pixels=9000 is over max_pixels=4000; make min_pixels \(size.shortest_edge\) at most"),
    (lambda: images.QwenVisionPreprocess.from_config({"patch_size": 0}),
     r"preprocessor_config.json: patch_size must be a positive integer, got 0; fix it"),
    (lambda: images.QwenVisionPreprocess.from_config({"image_std": [0.5, 0, 0.5]}), r"image_std must be positive"),
    (lambda: images.QwenVisionPreprocess.from_config({"image_mean": [0.5]}), r"image_mean must be 3 numbers"),
    (lambda: images.QwenVisionPreprocess.from_config({"resample": 1}), r"resample=1 is not supported"),
    (lambda: images.Gemma4VisionPreprocess.from_config({"max_soft_tokens": 100}), r"choose one of \(70, 140"),
    (lambda: images_llama4.Llama4VisionPreprocess.from_config({"size": {"height": 336, "width": 224}}),
     r"size must be square"),
    (lambda: images_llama4.Llama4VisionPreprocess(tile_size=64), r"tile_size=64 is not a multiple of patch_size=14"),
])
def test_bad_config_values_name_the_fix(make, message):
    with pytest.raises(DataError, match=message):
        make()


def test_missing_pillow_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "PIL.Image", None)
    with pytest.raises(MissingPackage, match=r"^image preprocessing needs the PIL package: "
                                             r"pip install 'maxtrain\[vision\]'$"):
        images.rgb(np.zeros((2, 2), np.uint8))


def test_llama4_canvases_and_tokens():
    assert images_llama4.canvases(4, 1) == [(1, 4), (2, 2), (1, 1), (4, 1), (1, 3), (3, 1), (1, 2), (2, 1)]
    spec = images_llama4.Llama4VisionPreprocess()  # 336-pixel tiles, patches of 14, pixel shuffle 0.5: 144 a tile
    assert spec.tokens_per_tile == 144
    assert images_llama4.best_canvas(480, 640, spec) == (672, 672)  # 2x2 tiles: the smallest upscale
    assert images_llama4.best_canvas(200, 300, spec) == (336, 336)
    tokens = images_llama4.image_tokens(2, 3, 144)
    assert len(tokens) == 1 + 6 * 144 + 2 * 2 + 2 + 1 + 144 + 1
    assert tokens.count("<|tile_x_separator|>") == 4 and tokens.count("<|tile_y_separator|>") == 2
    assert images_llama4.image_tokens(1, 1, 3) == ["<|image_start|>", "<|image|>"] + ["<|patch|>"] * 3 + \
        ["<|image_end|>"]


def test_bfloat16_rounding_equals_ml_dtypes():
    ml_dtypes = pytest.importorskip("ml_dtypes")
    x = np.random.RandomState(0).randn(10000).astype(np.float32) * np.float32(3)
    x[:4] = [1 / 255, 0.5, -1.0, 1 + 2 ** -8]  # a tie: to even
    np.testing.assert_array_equal(images_llama4.bfloat16(x), x.astype(ml_dtypes.bfloat16).astype(np.float32))


# --- against transformers ------------------------------------------------------------------------------------------

QWEN_CONFIGS = {"qwen3_vl": {**images.QWEN3_VL, "size": {"shortest_edge": 32 * 32 * 4, "longest_edge": 32 * 32 * 64}},
                "qwen2_vl": dict(patch_size=14, min_pixels=56 * 56, max_pixels=28 * 28 * 100)}
MODES = [(size, "RGB") for size in SIZES] + [((57, 300), "L"), ((300, 57), "RGBA"), ((40, 70), "P")]


@pytest.mark.parametrize("name", list(QWEN_CONFIGS))
def test_qwen_equals_transformers_pil_processor(name):
    pytest.importorskip("transformers")
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
    from transformers.models.qwen2_vl.processing_qwen2_vl import Qwen2VLProcessor

    processor = Qwen2VLImageProcessorPil(**QWEN_CONFIGS[name])
    spec = images.QwenVisionPreprocess.from_config(processor.to_dict())
    assert images.QwenVisionPreprocess.from_config({}) == \
        images.QwenVisionPreprocess.from_config(Qwen2VLImageProcessorPil().to_dict())  # the same defaults
    size = processor.size
    assert (spec.patch_size, spec.min_pixels, spec.max_pixels) == (processor.patch_size, size["shortest_edge"],
                                                                   size["longest_edge"])
    text_side = types.SimpleNamespace(image_processor=processor, image_token="<|image_pad|>")
    for (height, width), mode in MODES:
        image = noise(height, width, mode)
        theirs = processor(image, return_tensors="np")
        ours = images.qwen_vl(image, spec)
        assert ours.pixel_values.dtype == np.float32 and ours.pixel_values.shape == theirs["pixel_values"].shape
        assert np.abs(ours.pixel_values - theirs["pixel_values"]).max() <= 1e-5, (height, width, mode)
        assert list(ours.grid_thw) == theirs["image_grid_thw"][0].tolist()
        placeholders = Qwen2VLProcessor.replace_image_token(text_side, theirs, 0)
        assert ours.num_tokens == placeholders.count("<|image_pad|>") == images.qwen_num_tokens(height, width, spec)
    with pytest.raises(ValueError, match="aspect ratio"):
        processor(noise(1, 1000), return_tensors="np")
    with pytest.raises(DataError, match="aspect ratio over 200"):
        images.qwen_vl(noise(1, 1000), spec)


@pytest.mark.parametrize("max_soft_tokens", [70, 280])
def test_gemma4_equals_transformers_pil_processor(max_soft_tokens):
    pytest.importorskip("transformers")
    from transformers.models.gemma4.image_processing_pil_gemma4 import Gemma4ImageProcessorPil
    from transformers.models.gemma4.processing_gemma4 import Gemma4Processor

    processor = Gemma4ImageProcessorPil(max_soft_tokens=max_soft_tokens)
    spec = images.Gemma4VisionPreprocess.from_config(processor.to_dict())
    text_side = types.SimpleNamespace(boi_token="<boi>", eoi_token="<eoi>", image_token="<img>")
    for (height, width), mode in MODES + [((1, 1000), "RGB"), ((96, 96), "RGB")]:  # 1x1000: one row; 96: no resize
        image = noise(height, width, mode)
        theirs = processor(image, return_tensors="np")
        ours = images.gemma4(image, spec)
        assert ours.pixel_values.shape == theirs["pixel_values"][0].shape
        assert np.abs(ours.pixel_values - theirs["pixel_values"][0]).max() <= 1e-5, (height, width, mode)
        np.testing.assert_array_equal(ours.position_ids, theirs["image_position_ids"][0])
        text = Gemma4Processor.replace_image_token(text_side, theirs, 0)
        assert ours.num_tokens == theirs["num_soft_tokens_per_image"][0] == text.count("<img>")


def test_llama4_tokens_equal_transformers_layout():
    pytest.importorskip("transformers")
    from transformers.models.llama4.processing_llama4 import Llama4Processor

    for rows, columns in [(1, 1), (1, 4), (3, 1), (2, 3)]:
        assert "".join(images_llama4.image_tokens(rows, columns, 5)) == \
            Llama4Processor._prompt_split_image(None, (rows, columns), 5)


# Pillow's bilinear filter against torchvision's antialiased uint8 one: measured at most 1 level of 255 apart on
# some pixels, which after (x/255 - 0.5)/0.5 in bfloat16 is at most 3/256 (and 0 where the image is not resized).
LLAMA4_TOLERANCE = 3 / 256


@pytest.mark.parametrize("max_tiles,tile_size", [(4, 56), (6, 28)])
def test_llama4_equals_transformers_processor(max_tiles, tile_size):
    pytest.importorskip("transformers")
    pytest.importorskip("torchvision")
    from transformers.models.llama4.image_processing_llama4 import Llama4ImageProcessor

    processor = Llama4ImageProcessor(size={"height": tile_size, "width": tile_size}, max_patches=max_tiles)
    spec = images_llama4.Llama4VisionPreprocess.from_config(processor.to_dict())
    for (height, width), mode in MODES + [((1000, 30), "RGB"), ((56, 112), "RGB"), ((112, 56), "RGB")]:
        image = noise(height, width, mode)
        theirs = processor(image, return_tensors="pt")
        ours = images_llama4.llama4(image, spec)
        assert ours.aspect_ratio == tuple(theirs["aspect_ratios"][0].tolist()), (height, width)
        expected = theirs["pixel_values"].float().numpy()
        assert ours.pixel_values.shape == expected.shape
        difference = np.abs(ours.pixel_values - expected)
        assert difference.max() <= LLAMA4_TOLERANCE, (height, width, mode, difference.max())


# transformers' default (torchvision) backends resize uint8 with torch: the same where Pillow's bicubic is the same
# (downscaling, antialiased, a = -0.5), but upscaling uses torch's bicubic (a = -0.75), which differs by up to ~0.26
# (normalised; up to ~22 levels of 255) on up to a third of the values where a side is upscaled. Measured, not matched.
@pytest.mark.parametrize("scheme", ["qwen3_vl", "qwen2_vl", "gemma4"])
def test_the_torch_backends_give_the_same_shapes_and_mostly_the_same_values(scheme):
    pytest.importorskip("transformers")
    pytest.importorskip("torchvision")
    from transformers.models.gemma4.image_processing_gemma4 import Gemma4ImageProcessor
    from transformers.models.qwen2_vl.image_processing_qwen2_vl import Qwen2VLImageProcessor

    if scheme == "gemma4":
        processor, spec = Gemma4ImageProcessor(max_soft_tokens=70), images.Gemma4VisionPreprocess(max_soft_tokens=70)
    else:
        processor = Qwen2VLImageProcessor(**QWEN_CONFIGS[scheme])
        spec = images.QwenVisionPreprocess.from_config(processor.to_dict())
    for (height, width), mode in MODES:
        image = noise(height, width, mode)
        theirs = processor(image, return_tensors="np")
        if scheme == "gemma4":
            ours, expected = images.gemma4(image, spec), theirs["pixel_values"][0]
            assert ours.num_tokens == theirs["num_soft_tokens_per_image"][0]
        else:
            ours, expected = images.qwen_vl(image, spec), theirs["pixel_values"]
            assert list(ours.grid_thw) == theirs["image_grid_thw"][0].tolist()
        difference = np.abs(ours.pixel_values - expected)
        assert difference.max() <= 0.3 and np.median(difference) <= 1e-6, (height, width, mode, difference.max())
