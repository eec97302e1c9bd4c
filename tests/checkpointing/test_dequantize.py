"""Released quantised weights, dequantised on import: DeepSeek's fp8 with 128x128 block scales and gpt-oss's
MXFP4 experts, each against a plain numpy dequantisation written from the formats' definitions, on synthetic
tensors; and a safetensors file read through the importer's hook (a tiny Llama stored in fp8 blocks)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import jax
import ml_dtypes
import numpy as np
import pytest

from ckpt_helpers import REPO
from maxtrain import config as config_lib
from maxtrain.models.model import Model
from maxtrain.models import model_keys
from maxtrain.models.params import is_spec
from maxtrain.checkpointing import convert, dequantize, safetensors_files
from maxtrain.checkpointing import files as checkpoint_files


def random_fp8(rng, shape) -> np.ndarray:
    """Every e4m3 bit pattern but NaN (0x7F, 0xFF), drawn uniformly."""
    bits = rng.integers(0, 256, shape, dtype=np.uint8)
    bits[(bits & 0x7F) == 0x7F] = 0x3C
    return bits.view(ml_dtypes.float8_e4m3fn)


def e4m3_value(bits: int) -> float:
    """One float8 e4m3fn value from its bits: sign, 4 exponent bits (bias 7), 3 mantissa bits; subnormal at 0."""
    sign, exponent, mantissa = bits >> 7, (bits >> 3) & 0xF, bits & 0x7
    magnitude = mantissa / 8 * 2.0 ** -6 if exponent == 0 else (1 + mantissa / 8) * 2.0 ** (exponent - 7)
    return -magnitude if sign else magnitude


def e2m1_value(nibble: int) -> float:
    """One FP4 E2M1 value: sign, 2 exponent bits (bias 1), 1 mantissa bit; subnormal at 0."""
    sign, exponent, mantissa = nibble >> 3, (nibble >> 1) & 0x3, nibble & 0x1
    magnitude = mantissa * 0.5 if exponent == 0 else (1 + mantissa / 2) * 2.0 ** (exponent - 1)
    return -magnitude if sign else magnitude


def reference_fp8(weight: np.ndarray, scale_inv: np.ndarray, block=(128, 128)) -> np.ndarray:
    values = np.vectorize(e4m3_value)(weight.view(np.uint8).astype(np.int64))
    rows, cols = np.indices(weight.shape[-2:])
    return (values * scale_inv[..., rows // block[0], cols // block[1]]).astype(np.float32)


def reference_mxfp4(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    *lead, groups, width = blocks.shape
    out = np.zeros((*lead, groups, 2 * width))
    for index in np.ndindex(*lead, groups):
        for k in range(width):
            byte = int(blocks[index][k])
            out[index][2 * k] = e2m1_value(byte & 0xF)  # low nibble first
            out[index][2 * k + 1] = e2m1_value(byte >> 4)
        out[index] *= 2.0 ** (int(scales[index]) - 127)
    return out.reshape(*lead, groups * 2 * width).astype(np.float32)


@pytest.mark.parametrize("shape", [(300, 200), (2, 130, 257), (256, 128), (5, 7)])
def test_fp8_blocks_match_the_definition_also_on_partial_tiles(shape):
    rng = np.random.default_rng(sum(shape))
    weight = random_fp8(rng, shape)
    grid = (*shape[:-2], -(-shape[-2] // 128), -(-shape[-1] // 128))
    scale_inv = rng.uniform(1e-4, 3.0, grid).astype(np.float32)
    ours = dequantize.dequantize_fp8_blocks(weight, scale_inv)
    assert ours.dtype == np.float32
    np.testing.assert_array_equal(ours, reference_fp8(weight, scale_inv))
    with pytest.raises(safetensors_files.FormatError, match=r"weight_scale_inv has shape .* needs"):
        dequantize.dequantize_fp8_blocks(weight, np.ones((*grid[:-1], grid[-1] + 1), np.float32), name="weight")


def test_mxfp4_matches_the_definition():
    rng = np.random.default_rng(0)
    blocks = rng.integers(0, 256, (2, 3, 4, 16), dtype=np.uint8)  # [experts, rows, groups, 16 bytes]
    scales = rng.integers(127 - 20, 127 + 20, (2, 3, 4), dtype=np.uint8)
    ours = dequantize.dequantize_mxfp4(blocks, scales)
    assert ours.shape == (2, 3, 128) and ours.dtype == np.float32
    np.testing.assert_array_equal(ours, reference_mxfp4(blocks, scales))
    with pytest.raises(safetensors_files.FormatError, match="are not MXFP4"):
        dequantize.dequantize_mxfp4(blocks[..., :8], scales)


def test_quantised_pairs_read_through_the_import_hook(tmp_path):
    """A safetensors file of fp8 pairs, an MXFP4 pair and plain tensors, read back through the hook: one tensor
    per pair under the unquantised name; then a tiny Llama stored with fp8 block weights imports as its
    dequantised weights."""
    rng = np.random.default_rng(1)
    stored = {"a.weight": random_fp8(rng, (130, 70)), "a.weight_scale_inv": rng.uniform(0.1, 2, (2, 1)).astype(np.float32),
              "experts.gate_up_proj_blocks": rng.integers(0, 256, (2, 6, 2, 16), dtype=np.uint8),
              "experts.gate_up_proj_scales": rng.integers(120, 134, (2, 6, 2), dtype=np.uint8),
              "experts.gate_up_proj_bias": rng.normal(size=(2, 6)).astype(np.float32),
              "norm.weight": rng.normal(size=(70,)).astype(ml_dtypes.bfloat16), "layer_scales": np.ones(3, np.float32)}
    safetensors_files.write(str(tmp_path / "model.safetensors"), stored)
    read = dequantize.Dequantized(safetensors_files.read_model_dir(str(tmp_path)))
    assert sorted(read) == ["a.weight", "experts.gate_up_proj", "experts.gate_up_proj_bias", "layer_scales",
                            "norm.weight"]
    assert read.quantized() == {"a.weight": "fp8", "experts.gate_up_proj": "mxfp4"}
    np.testing.assert_array_equal(read["a.weight"], reference_fp8(stored["a.weight"], stored["a.weight_scale_inv"]))
    gate_up = reference_mxfp4(stored["experts.gate_up_proj_blocks"], stored["experts.gate_up_proj_scales"])
    np.testing.assert_array_equal(read["experts.gate_up_proj"], np.swapaxes(gate_up, 1, 2))  # [E, in 64, out 6]
    assert read["norm.weight"].tobytes() == stored["norm.weight"].tobytes() and "a.weight_scale_inv" not in read

    # A Llama whose projections are stored as fp8 in 64x32 blocks, as its config.json's quantization_config says
    # (the embedding and norms stay as they are).
    config = config_lib.load_config([str(REPO / "configs" / "base.yml"), "base_emb_dim=160", "base_num_query_heads=2",
                                     "base_num_kv_heads=1", "head_dim=32", "base_mlp_dim=136",
                                     "base_num_decoder_layers=1", "vocab_size=256"])
    keys = {k: getattr(config, k) for k in model_keys.MODEL_KEYS}
    params = jax.tree.map(lambda s: rng.normal(size=s.shape).astype(np.float32), Model.bind(convert.spec_config(keys)).param_specs, is_leaf=is_spec)
    hf, quantised = convert.to_hf(params, keys, np.float32), {}
    for name, w in hf.items():
        if name.endswith("proj.weight"):
            scale_inv = rng.uniform(0.05, 0.2, (-(-w.shape[0] // 64), -(-w.shape[1] // 32))).astype(np.float32)
            quantised[name] = random_fp8(rng, w.shape)
            quantised[name + "_scale_inv"] = scale_inv
            hf[name] = reference_fp8(quantised[name], scale_inv, block=(64, 32))
        else:
            quantised[name] = w
    blocks = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [64, 32]}
    assert "note: dequantised 7 fp8 tensors" in import_and_compare(tmp_path / "fp8_llama", keys, quantised, hf,
                                                                    quantization_config=blocks)
    with pytest.raises(safetensors_files.FormatError, match=r"weight_block_size is \[64\]; fp8 block scales need"):
        dequantize.fp8_block({"quantization_config": {"weight_block_size": [64]}})


def import_and_compare(hf_dir, keys, quantised, dequantised, **config_extra) -> list[str]:
    """Writes `quantised` as a Hugging Face model, imports it, checks the import equals `dequantised`
    (the same tensors, dequantised by the reference) converted to maxtrain; returns the import's notes."""
    hf_dir.mkdir()
    safetensors_files.write(str(hf_dir / "model.safetensors"), quantised)
    (hf_dir / "config.json").write_text(json.dumps({**convert.hf_config(keys, None, "float32"), **config_extra}))
    notes = []
    out = hf_dir.parent / (hf_dir.name + "_out")
    convert.import_hf(str(hf_dir), str(out), log=notes.append)
    imported = checkpoint_files.read_params(str(out))
    jax.tree.map(np.testing.assert_array_equal, jax.tree.map(np.asarray, imported), convert.to_maxtrain(dequantised, keys))
    return notes


def test_a_gpt_oss_checkpoint_with_mxfp4_experts_imports_as_its_dequantised_weights(tmp_path):
    """gpt-oss as released: the experts' gate_up_proj and down_proj stored as MXFP4 blocks and scales, with the
    layout transformers reads ([E, out, in / 32, 16] blocks of the [E, in, out] weight); the import equals the
    import of the same model written with the dequantised weights."""
    rng = np.random.default_rng(2)
    config = config_lib.load_config([str(REPO / "configs" / "base.yml"), "decoder_block=gpt_oss", "num_experts=4",
                                     "num_experts_per_tok=2", "base_emb_dim=64", "base_num_query_heads=2",
                                     "base_num_kv_heads=1", "head_dim=16", "base_mlp_dim=32",
                                     "base_num_decoder_layers=2", "vocab_size=128", "sliding_window_size=8"])
    keys = {k: getattr(config, k) for k in model_keys.MODEL_KEYS}
    params = jax.tree.map(lambda s: rng.normal(size=s.shape).astype(np.float32), Model.bind(convert.spec_config(keys)).param_specs, is_leaf=is_spec)
    hf, quantised = convert.to_hf(params, keys, np.float32), {}
    for name, w in hf.items():
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            experts, n_in, n_out = w.shape
            blocks = rng.integers(0, 256, (experts, n_out, n_in // 32, 16), dtype=np.uint8)
            scales = rng.integers(122, 130, (experts, n_out, n_in // 32), dtype=np.uint8)
            quantised[name + "_blocks"], quantised[name + "_scales"] = blocks, scales
            hf[name] = np.swapaxes(reference_mxfp4(blocks, scales), 1, 2)
        else:
            quantised[name] = w
    assert sum(n.endswith("_blocks") for n in quantised) == 4  # 2 layers x (gate_up, down)
    assert "note: dequantised 4 mxfp4 tensors" in import_and_compare(tmp_path / "mxfp4_gpt_oss", keys, quantised, hf)


# --------------------------------------------------------------------------------------------
# Nothing quantised is imported as its raw values
# --------------------------------------------------------------------------------------------

FP8 = ml_dtypes.float8_e4m3fn


def fp8_weight(shape=(4, 6)) -> np.ndarray:
    return np.full(shape, 2.0, np.float32).astype(FP8)


def scale(shape=(1, 1)) -> np.ndarray:
    return np.full(shape, 0.01, np.float32)


BROKEN = {  # id -> (files {file: tensors}, config.json's quantization_config, what the message must say)
    "fp8-weight-without-scale": ({"model.safetensors": {"a.weight": fp8_weight(), "b.weight": scale((6,))}}, None,
                                 r"model.safetensors: a.weight is stored as float8_e4m3fn but has no scale \(expected "
                                 r"a.weight_scale_inv beside it\).*copy the checkpoint's files again"),
    "e5m2-weight-without-scale": ({"model.safetensors": {"a.weight": fp8_weight().astype(ml_dtypes.float8_e5m2)}},
                                  {"quant_method": "fp8"},
                                  r"a.weight is stored as float8_e5m2 \(config.json: quantization_config.quant_method="
                                  r"fp8\) but has no scale"),
    "scale-without-weight": ({"model-00001-of-00002.safetensors": {"b.weight": scale((6,))},
                              "model-00002-of-00002.safetensors": {"a.weight_scale_inv": scale()}}, None,
                             r"model-00002-of-00002.safetensors: a.weight_scale_inv is a block scale of a.weight, "
                             r"which no file of the checkpoint holds"),
    "scale-does-not-tile": ({"model.safetensors": {"a.weight": fp8_weight((130, 6)), "a.weight_scale_inv": scale()}},
                            None, r"model.safetensors: a.weight_scale_inv has shape \[1, 1\], but a.weight \[130, 6\] "
                                  r"in 128x128 blocks needs \[2, 1\]; set config.json's quantization_config."
                                  r"weight_block_size"),
    "scale-of-a-dequantized-weight": ({"model.safetensors": {"a.weight": np.ones((4, 6), ml_dtypes.bfloat16),
                                                             "a.weight_scale_inv": scale()}}, None,
                                      r"a.weight is bfloat16, not float8, yet a.weight_scale_inv scales it"),
    "mxfp4-blocks-without-scales": ({"model.safetensors": {"e.down_proj_blocks": np.zeros((2, 1, 16), np.uint8)}},
                                    {"quant_method": "mxfp4"},
                                    r"e.down_proj_blocks \(MXFP4\) has no scales: no file of the checkpoint holds "
                                    r"e.down_proj_scales"),
    "mxfp4-scales-without-blocks": ({"model.safetensors": {"e.down_proj_scales": np.zeros((2, 1), np.uint8)}}, None,
                                    r"e.down_proj_scales \(uint8\) is the MXFP4 scale of e.down_proj_blocks, which no "
                                    r"file"),
    "mxfp4-scales-do-not-tile": ({"model.safetensors": {"e.down_proj_blocks": np.zeros((2, 1, 16), np.uint8),
                                                        "e.down_proj_scales": np.zeros((2, 2), np.uint8)}}, None,
                                 r"e.down_proj_blocks uint8\[2, 1, 16\] and e.down_proj_scales uint8\[2, 2\] are not "
                                 r"MXFP4"),
    "int8-where-quantization-is-declared": ({"model.safetensors": {"a.weight": np.ones((4, 6), np.int8)}},
                                            {"quant_method": "bitsandbytes", "load_in_8bit": True},
                                            r"a.weight is stored as int8 \(config.json: quantization_config."
                                            r"quant_method=bitsandbytes\) but has no scale"),
    "packed-int4-of-another-scheme": ({"model.safetensors": {"a.qweight": np.ones((4, 6), np.int32),
                                                             "a.scales": np.ones((1, 6), np.float16)}},
                                      {"quant_method": "gptq", "bits": 4},
                                      r"a.qweight is stored as int32 \(config.json: quantization_config.quant_method="
                                      r"gptq\) with a.scales: a quantisation scheme maxtrain does not dequantise"),
    "a-layer-cast-without-its-scale": ({"model.safetensors": {
        "m.layers.0.up.weight": fp8_weight(), "m.layers.0.up.weight_scale_inv": scale(),
        "m.layers.1.up.weight": np.ones((4, 6), ml_dtypes.bfloat16)}}, None,
        r"m.layers.1.up.weight is stored as bfloat16 without scales, but m.layers.0.up.weight of another layer is "
        r"quantised"),
    "declared-but-nothing-quantised": ({"model.safetensors": {"a.weight": np.ones((4, 6), ml_dtypes.bfloat16)}},
                                       {"quant_method": "fp8", "weight_block_size": [128, 128]},
                                       r"config.json declares quantization_config \(quant_method=fp8\), but no tensor "
                                       r"of the checkpoint is quantised .* remove quantization_config"),
    "fp8-with-per-channel-scales": ({"model.safetensors": {"a.weight": fp8_weight(), "a.weight_scale": scale((4, 1))}},
                                    {"quant_method": "compressed-tensors"},
                                    r"a.weight is stored as float8_e4m3fn .* with a.weight_scale: a quantisation "
                                    r"scheme maxtrain does not dequantise"),
}


def write_checkpoint(directory, files: dict, quantization: dict | None = None) -> str:
    directory.mkdir()
    for name, tensors in files.items():
        safetensors_files.write(str(directory / name), tensors)
    if len(files) > 1:
        (directory / "model.safetensors.index.json").write_text(json.dumps(
            {"weight_map": {t: name for name, tensors in files.items() for t in tensors}}))
    llama = {"model_type": "llama", "hidden_size": 32, "intermediate_size": 64, "num_attention_heads": 2,
             "num_key_value_heads": 2, "num_hidden_layers": 1, "vocab_size": 64, "rms_norm_eps": 1e-5}
    (directory / "config.json").write_text(json.dumps({**llama, **({"quantization_config": quantization}
                                                                    if quantization else {})}))
    return str(directory)


@pytest.mark.parametrize("case", BROKEN, ids=list(BROKEN))
def test_a_quantised_tensor_is_never_read_without_its_scale(case, tmp_path):
    """Each is refused when the checkpoint is opened, before any tensor is read, naming the tensor and its file."""
    files, quantization, expected = BROKEN[case]
    hf_dir = write_checkpoint(tmp_path / "hf", files, quantization)
    origins = {}
    stored = safetensors_files.read_model_dir(hf_dir, origins)
    with pytest.raises(safetensors_files.FormatError, match=expected) as caught:
        dequantize.Dequantized(stored, (128, 128), dequantize.declared_method({"quantization_config": quantization}),
                               origins)
    assert "\n" not in str(caught.value)
    assert str(tmp_path / "hf") in str(caught.value) or case == "declared-but-nothing-quantised"


def test_an_export_of_an_imported_quantised_model_declares_no_quantisation():
    """Its weights are written dequantized: config.json must not say otherwise (transformers would read them as
    quantised, and an import would refuse them)."""
    original = {"model_type": "llama", "hidden_size": 32, "intermediate_size": 64, "num_attention_heads": 2,
                "num_key_value_heads": 2, "num_hidden_layers": 1, "vocab_size": 64, "rms_norm_eps": 1e-5,
                "quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128]}}
    exported = convert.hf_config(convert.model_keys(original), original, "bfloat16")
    assert "quantization_config" not in exported and exported["hidden_size"] == 32


def test_the_import_refuses_a_quantised_tensor_without_its_scale_and_writes_nothing(tmp_path):
    """Through the command: one line, exit status 2, no output directory; an int8 tensor of a checkpoint that
    declares no quantisation is refused where it would be read as a float weight."""
    embedding = {"model.embed_tokens.weight": fp8_weight((64, 32))}
    hf_dir = write_checkpoint(tmp_path / "hf", {"model.safetensors": embedding})
    done = subprocess.run([sys.executable, str(REPO / "scripts" / "convert_hf.py"), "import", hf_dir,
                           str(tmp_path / "out")], capture_output=True, text=True, timeout=600,
                          env={**os.environ, "PYTHONPATH": str(REPO), "JAX_PLATFORMS": "cpu"})
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2 and len(lines) == 1 and lines[0].startswith("convert_hf: error: "), done.stderr[-3000:]
    assert not (tmp_path / "out").exists()

    keys = convert.model_keys(convert.read_hf_config(hf_dir))
    tensors = convert.to_hf(jax.tree.map(lambda s: np.zeros(s.shape, np.float32), Model.bind(convert.spec_config(keys)).param_specs, is_leaf=is_spec), keys, np.float32)
    tensors["model.layers.0.mlp.up_proj.weight"] = tensors["model.layers.0.mlp.up_proj.weight"].astype(np.int8)
    with pytest.raises(convert.ConversionError, match=r"model.layers.0.mlp.up_proj.weight is stored as int8, not as "
                                                      r"float weights"):
        convert.to_maxtrain(tensors, keys)
