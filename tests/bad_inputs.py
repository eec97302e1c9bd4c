"""The bad-input table: what a user can get wrong, per entry point, and what maxtrain must answer.

Each row names one bad input: the tool, its arguments (with {placeholders} for the files of a small
"world" built once: a trained run with checkpoints at steps 2 and 4, raw data, a tokenizer, a
prepared directory), an optional setup that breaks something in the row's own scratch directory,
the exit status expected and a regular expression the answer must match, naming the offending key,
file or value. For every row the runner also checks that nothing was printed as a traceback and
that no file of the world (the existing run, the data) changed.

    tests/test_bad_inputs.py          runs every row in-process through the entry points' own CLI
                                      wrapper (errors.run_cli), plus one real subprocess per tool
    python tests/bad_inputs.py [--python PY] [--repo DIR] [--json OUT]
                                      runs every row as a real command (any checkout, e.g. an older
                                      main for a before/after count) and prints one line per row and
                                      the counts: clear / unclear / silent / traceback

To add a row, append a Row to ROWS: a new id, the tool, argv, and what the answer must say.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import time
from typing import Callable

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# A ~50k-parameter model on the default corpus (0.3 MB), as tests/ckpt_helpers.py.
TINY = ["base_emb_dim=32", "base_num_query_heads=2", "base_num_kv_heads=2", "base_mlp_dim=64",
        "base_num_decoder_layers=2", "head_dim=16", "vocab_size=512", "max_target_length=32",
        "per_device_batch_size=1", "default_corpus_max_mb=0.3", "eval_interval=-1", "max_new_tokens=0",
        "enable_tensorboard=false", "log_period=1000"]

TOOLS = {  # tool -> (program name in its error lines, command after the python executable)
    "train": ("maxtrain", ["-m", "maxtrain.train"]),
    "decode": ("maxtrain.decode", ["-m", "maxtrain.decode"]),
    "viz": ("maxtrain.viz", ["-m", "maxtrain.viz"]),
    "inspect_data": ("maxtrain.inspect_data", ["-m", "maxtrain.inspect_data"]),
    "inspect": ("maxtrain.inspect_checkpoint", ["-m", "maxtrain.inspect_checkpoint"]),
    "prepare_data": ("prepare_data", ["scripts/prepare_data.py"]),
    "train_tokenizer": ("train_tokenizer", ["scripts/train_tokenizer.py"]),
    "convert_hf": ("convert_hf", ["scripts/convert_hf.py"]),
}


@dataclasses.dataclass
class Row:
    id: str
    tool: str
    args: list[str]                       # formatted with World.paths (and {scratch})
    expect: str                           # regex the answer (the error line, or the output for exit 0) matches
    code: int = 2
    setup: Callable | None = None         # setup(world, scratch) breaks something in the scratch directory
    tiny: bool = False                    # config tools: add the tiny model's overrides (rows that go past the config)


# --------------------------------------------------------------------------------------------
# The world every row starts from
# --------------------------------------------------------------------------------------------


class World:
    def __init__(self, root: str):
        self.root = root
        self.paths = {
            "base": os.path.join(REPO, "configs", "base.yml"), "root": root, "run": os.path.join(root, "run"),
            "ckpts": os.path.join(root, "run", "checkpoints"), "cache": os.path.join(root, "cache"),
            "data": os.path.join(root, "data"), "tok": os.path.join(root, "tok.model"),
            "prepared": os.path.join(root, "prepared"),
        }

    def fmt(self, text: str, scratch: str) -> str:
        return text.format(scratch=scratch, **self.paths)


def _write(path: str, data, mode: str = "w") -> str:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, mode) as f:
        f.write(data)
    return path


def _sample_text() -> str:
    """~150 KB of real text to train a tokenizer on: the standard library's json and email packages."""
    import email  # pylint: disable=import-outside-toplevel
    import json as json_module  # pylint: disable=import-outside-toplevel

    chunks = []
    for package in (json_module, email):
        root = os.path.dirname(package.__file__)
        for name in sorted(os.listdir(root)):
            if name.endswith(".py"):
                with open(os.path.join(root, name), encoding="utf-8") as f:
                    chunks.append(f.read())
    return "\n".join(chunks)[:150_000]


def build_world(root: str, python: str = sys.executable, repo: str = REPO, log=print) -> World:
    """Raw data, a tokenizer, a prepared directory and a trained run (checkpoints 2 and 4) under root."""
    world = World(root)
    world.paths["base"] = os.path.join(repo, "configs", "base.yml")
    p = world.paths
    text = _sample_text()
    docs = [text[i:i + 3000] for i in range(0, len(text), 3000)]
    _write(os.path.join(p["data"], "good.jsonl"), "".join(json.dumps({"text": d}) + "\n" for d in docs))
    _write(os.path.join(p["data"], "bad_json.jsonl"), "{not json\n" + json.dumps({"text": "fine"}) + "\n")
    _write(os.path.join(p["data"], "nonstring.jsonl"), json.dumps({"text": 42}) + "\n")
    _write(os.path.join(p["data"], "no_field.jsonl"), json.dumps({"body": "x"}) + "\n")
    _write(os.path.join(p["data"], "bad_utf8.jsonl"), b'{"text": "caf\xe9"}\n', "wb")
    _write(os.path.join(p["data"], "empty.jsonl"), "")
    _write(os.path.join(p["data"], "not.parquet"), "this is text, not parquet\n")
    _write(os.path.join(p["data"], "table.csv"), "text\nhello\n")
    _write(os.path.join(p["data"], "chars.txt"), "".join(chr(c) for c in range(0x4E00, 0x4E00 + 400)))
    import pyarrow as pa  # pylint: disable=import-outside-toplevel
    import pyarrow.parquet as pq  # pylint: disable=import-outside-toplevel

    pq.write_table(pa.table({"body": docs[:5]}), os.path.join(p["data"], "no_text_column.parquet"))
    pq.write_table(pa.table({"text": list(range(5))}), os.path.join(p["data"], "int_column.parquet"))
    _write(os.path.join(root, "garbage.model"), os.urandom(256), "wb")
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=8", "JAX_PLATFORMS": "cpu",
           "PYTHONUNBUFFERED": "1", "PYTHONPATH": repo}  # that checkout's maxtrain, whatever is installed

    def run(cmd):
        done = subprocess.run([python, *cmd], cwd=repo, env=env, capture_output=True, text=True, timeout=900)
        if done.returncode:
            raise RuntimeError(f"building the world failed: {cmd}\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
        return done

    t = time.time()
    run(["scripts/train_tokenizer.py", "--input", os.path.join(p["data"], "good.jsonl"), "--vocab-size", "400",
         "--output", p["tok"]])
    run(["scripts/prepare_data.py", "--input", os.path.join(p["data"], "good.jsonl"), "--tokenizer", p["tok"],
         "--output-dir", p["prepared"], "--workers", "1"])
    run(["-m", "maxtrain.train", p["base"], *TINY, f"base_output_directory={root}", "run_name=run",
         f"dataset_cache_dir={p['cache']}", "steps=4", "checkpoint_period=2", "max_num_checkpoints_to_keep=-1"])
    log(f"world built in {time.time() - t:.0f}s under {root}")
    return world


def tree_hash(root: str, skip: tuple[str, ...] = ()) -> str:
    h = hashlib.sha256()
    for directory, dirs, names in sorted(os.walk(root)):
        dirs[:] = sorted(d for d in dirs if os.path.join(directory, d) not in skip)
        for name in sorted(names):
            path = os.path.join(directory, name)
            h.update(os.path.relpath(path, root).encode())
            with open(path, "rb") as f:
                h.update(f.read())
    return h.hexdigest()


# --------------------------------------------------------------------------------------------
# Setups: each breaks something in the row's scratch directory
# --------------------------------------------------------------------------------------------


def copy_run(world: World, scratch: str) -> str:
    target = os.path.join(scratch, "run")
    shutil.copytree(world.paths["run"], target)
    return target


def array_file(step_dir: str) -> str:
    files = [os.path.join(d, n) for d, _, names in os.walk(os.path.join(step_dir, "state")) for n in names
             if f"{os.sep}d{os.sep}" in os.path.join(d, n)]
    return max(files, key=os.path.getsize)


def flip(path: str) -> None:
    with open(path, "r+b") as f:
        data = bytearray(f.read())
        data[len(data) // 2] ^= 0x01
        f.seek(0)
        f.write(data)


def flipped(world, scratch):
    flip(array_file(os.path.join(copy_run(world, scratch), "checkpoints", "4")))


def truncated(world, scratch):
    path = array_file(os.path.join(copy_run(world, scratch), "checkpoints", "4"))
    os.truncate(path, os.path.getsize(path) // 2)


def deleted(world, scratch):
    os.remove(array_file(os.path.join(copy_run(world, scratch), "checkpoints", "4")))


def garbage_metadata(world, scratch):
    _write(os.path.join(copy_run(world, scratch), "checkpoints", "4", "metadata", "metadata"), "{garbage")


def garbage_array_metadata(world, scratch):
    _write(os.path.join(copy_run(world, scratch), "checkpoints", "4", "state", "_METADATA"), "{garbage")


def garbage_checksums(world, scratch):
    _write(os.path.join(copy_run(world, scratch), "checkpoints", "4", "checksums", "process_0.json"), "[1")


def no_state(world, scratch):
    shutil.rmtree(os.path.join(copy_run(world, scratch), "checkpoints", "4", "state"))


def every_step_flipped(world, scratch):
    run = copy_run(world, scratch)
    for step in ("2", "4"):
        flip(array_file(os.path.join(run, "checkpoints", step)))


def empty_dir(world, scratch):
    os.makedirs(os.path.join(scratch, "nothing"), exist_ok=True)


def a_file(world, scratch):
    _write(os.path.join(scratch, "afile"), "x")


def yaml_file(text: str):
    def setup(world, scratch):
        _write(os.path.join(scratch, "my.yml"), text.format(base=world.paths["base"]))
    return setup


def hf_dir(config=None, files=None):
    """A Hugging Face directory with `config` as config.json (a dict, raw text, or None for none)."""
    def setup(world, scratch):
        d = os.path.join(scratch, "hf")
        os.makedirs(d, exist_ok=True)
        if isinstance(config, dict):
            _write(os.path.join(d, "config.json"), json.dumps(config))
        elif config == "dir":
            os.makedirs(os.path.join(d, "config.json"))
        elif isinstance(config, str):
            _write(os.path.join(d, "config.json"), config)
        for name, data in (files or {}).items():
            _write(os.path.join(d, name), data, "wb" if isinstance(data, bytes) else "w")
    return setup


def safetensors_bytes(tensors: dict[str, tuple[str, list, bytes]]) -> bytes:
    """A .safetensors file written by hand (any checkout can read the table): {name: (dtype, shape, raw bytes)}."""
    header, offset = {}, 0
    for name, (dtype, shape, raw) in tensors.items():
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + len(raw)]}
        offset += len(raw)
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    return len(text).to_bytes(8, "little") + text + b"".join(raw for _, _, raw in tensors.values())


def jsonl_file(rows: list[dict]):
    """A jsonl file {scratch}/rows.jsonl of `rows`, then good conversations (the bad row comes first)."""
    good = {"messages": [{"role": "user", "content": "1+1="}, {"role": "assistant", "content": "2"}]}

    def setup(world, scratch):
        _write(os.path.join(scratch, "rows.jsonl"), "".join(json.dumps(r) + "\n" for r in [*rows, *[good] * 4]))
    return setup


def _header(entries: dict, data: bytes = b"") -> bytes:
    """A safetensors file of a JSON header `entries` and the bytes `data`."""
    header = json.dumps(entries).encode()
    return len(header).to_bytes(8, "little") + header + data


def hf_model(config: dict, mutate: Callable | None = None):
    """A Hugging Face directory of `config` and its tensors (zeros), `mutate(tensors)` applied before writing."""
    def setup(world, scratch):
        import jax  # pylint: disable=import-outside-toplevel
        import numpy as np  # pylint: disable=import-outside-toplevel

        from maxtrain.models.model import Model  # pylint: disable=import-outside-toplevel
        from maxtrain.models.params import is_spec  # pylint: disable=import-outside-toplevel
        from maxtrain.checkpointing import convert, safetensors_files  # pylint: disable=import-outside-toplevel

        keys = convert.model_keys(config)
        specs = Model.bind(convert.spec_config(keys)).param_specs
        params = jax.tree.map(lambda s: np.zeros(s.shape, np.float32), specs, is_leaf=is_spec)
        tensors = convert.to_hf(params, keys, np.float32)
        if mutate:
            mutate(tensors)
        hf_dir(config)(world, scratch)
        safetensors_files.write(os.path.join(scratch, "hf", "model.safetensors"), tensors)
    return setup


def imported(config: dict, tokenizer: bool = False):
    """{scratch}/ds: scripts/convert_hf.py import of hf_model(config) (with a tokenizer.model of its own)."""
    def setup(world, scratch):
        from maxtrain.checkpointing import convert  # pylint: disable=import-outside-toplevel

        hf_model(config)(world, scratch)
        if tokenizer:
            _other_tokenizer(world, scratch)
            shutil.copyfile(os.path.join(scratch, "other.model"), os.path.join(scratch, "hf", "tokenizer.model"))
        convert.import_hf(os.path.join(scratch, "hf"), os.path.join(scratch, "ds"), log=lambda *_: None)
    return setup


LLAMA = {"model_type": "llama", "hidden_size": 32, "intermediate_size": 64, "num_attention_heads": 2,
         "num_key_value_heads": 2, "num_hidden_layers": 2, "vocab_size": 512, "max_position_embeddings": 64,
         "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": False, "hidden_act": "silu"}

DEEPSEEK = {**LLAMA, "model_type": "deepseek_v3", "num_attention_heads": 4, "num_key_value_heads": 4,
            "moe_intermediate_size": 16, "n_routed_experts": 8, "num_experts_per_tok": 2, "n_shared_experts": 1,
            "n_group": 4, "topk_group": 2, "first_k_dense_replace": 1, "q_lora_rank": 24, "kv_lora_rank": 16,
            "qk_nope_head_dim": 8, "qk_rope_head_dim": 4, "v_head_dim": 10}
OLMO3 = {**LLAMA, "model_type": "olmo3", "sliding_window": 8}

GLM4_MOE = {**LLAMA, "model_type": "glm4_moe", "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8,
            "moe_intermediate_size": 16, "n_routed_experts": 8, "num_experts_per_tok": 2, "n_shared_experts": 1,
            "first_k_dense_replace": 1, "partial_rotary_factor": 0.5, "use_qk_norm": True, "attention_bias": True}


# --------------------------------------------------------------------------------------------
# The table
# --------------------------------------------------------------------------------------------

B = "{base}"
G4 = [B, "decoder_block=gemma4_text", "sliding_window_size=8"]  # a tiny Gemma 4 (four sliding-window layers)
T, D, R, K = "train", "decode", "viz", "inspect"
ROWS = [
    # train: config keys and values
    Row("unknown-key", T, [B, "base_emb_dimm=64"], r"unknown config key 'base_emb_dimm': did you mean base_emb_dim\?"),
    Row("wrong-type-int", T, [B, "steps=abc"], r"steps='abc' has the wrong type; steps must be an integer"),
    Row("wrong-type-float", T, [B, "per_device_batch_size=0.5"], r"per_device_batch_size=0.5 has the wrong type"),
    Row("wrong-type-bool", T, [B, "scan_layers=maybe"], r"scan_layers='maybe' has the wrong type"),
    Row("steps-zero", T, [B, "steps=0"], r"steps=0 is not allowed: it must be >= 1"),
    Row("lr-nan", T, [B, "learning_rate=nan"], r"learning_rate=nan is not allowed: it must be >= 0"),
    Row("lr-inf", T, [B, "learning_rate=inf"], r"learning_rate=inf is not allowed"),
    Row("adam-eps-negative", T, [B, "adam_eps=-1"], r"adam_eps=-1.0 is not allowed: it must be > 0"),
    Row("adam-b2-one", T, [B, "adam_b2=1"], r"adam_b2=1.0 is not allowed: it must be in \[0, 1\)"),
    Row("schedule-steps-negative", T, [B, "learning_rate_schedule_steps=-5"],
        r"learning_rate_schedule_steps=-5 is not allowed: it must be -1 or >= 1"),
    Row("weight-decay-negative", T, [B, "adam_weight_decay=-5"], r"adam_weight_decay=-5.0 is not allowed"),
    Row("grain-workers-negative", T, [B, "grain_worker_count=-2"], r"grain_worker_count=-2 is not allowed"),
    Row("peak-tflops-negative", T, [B, "peak_tflops_per_device=-3"], r"peak_tflops_per_device=-3.0 is not allowed"),
    Row("warmup-fraction-above-1", T, [B, "warmup_steps_fraction=1.5"], r"warmup_steps_fraction=1.5 is not allowed"),
    Row("seed-negative", T, [B, "seed=-1"], r"seed=-1 is not allowed: it must be in \[0, 4294967295\]"),
    Row("dtype-unknown", T, [B, "dtype=fp8"], r"dtype='fp8' is not allowed: it must be one of: autoselected"),
    Row("schedule-unknown", T, [B, "lr_schedule_type=linear"], r"lr_schedule_type='linear' is not allowed"),
    Row("flash-block-not-power-of-two", T, [B, "sa_block_q=100"], r"sa_block_q=100 must be a power of two"),
    Row("kv-heads-do-not-divide", T, [B, "base_num_kv_heads=3"], r"base_num_query_heads=4 must be a multiple of "
        r"base_num_kv_heads=3"),
    Row("tensor-parallelism-does-not-divide", T, [B, "ici_tensor_parallelism=3"], r"tensor parallelism 3 .* must "
        r"divide base_num_query_heads=4"),
    Row("two-fill-axes", T, [B, "ici_data_parallelism=-1"], r"only one ici_\*_parallelism may be -1"),
    Row("mesh-axis-unknown", T, [B, 'logical_axis_rules=[["embed", "model"]]'], r"unknown mesh axis 'model'"),
    Row("two-text-columns", T, [B, "train_data_columns=[a, b]"], r"train_data_columns=\['a', 'b'\] must name "
        r"exactly one text field"),
    Row("model-preset-missing", T, [B, "model_name=gpt5"], r"model_name='gpt5' (has no preset|is not a preset)"),
    Row("both-starting-points", T, [B, "load_parameters_path=a", "load_full_state_path=b"],
        r"set only one of load_parameters_path .* and load_full_state_path"),
    Row("moe-experts-per-token-above-experts", T, [B, "decoder_block=mixtral", "num_experts=4", "num_experts_per_tok=6"],
        r"num_experts_per_tok=6 is more than num_experts=4: .* use num_experts_per_tok <= 4"),
    Row("moe-expert-parallelism-does-not-divide", T, [B, "decoder_block=mixtral", "num_experts=4",
                                                      "num_experts_per_tok=2", "ici_expert_parallelism=3"],
        r"expert parallelism 3 .* must divide num_experts=4: .* e.g. ici_expert_parallelism=(2|4)"),
    Row("moe-capacity-factor-zero", T, [B, "decoder_block=mixtral", "num_experts=4", "num_experts_per_tok=2",
                                        "moe_dispatch=capacity", "capacity_factor=0"],
        r"capacity_factor=0.0 is not allowed: it must be > 0 .*moe_dispatch=dropless"),
    Row("moe-grouped-matmul-unknown", T, [B, "decoder_block=mixtral", "num_experts=4", "num_experts_per_tok=2",
                                          "moe_grouped_matmul=triton"],
        r"moe_grouped_matmul='triton' is not allowed: it must be one of: autoselected, xla, pallas"),
    Row("gdn-kernel-chunk-not-a-tile", T, [B, "decoder_block=qwen3_5_text", "inhomogeneous_layer_cycle_interval=2",
                                           "gdn_kernel=pallas", "gdn_chunk_size=24"],
        r"gdn_chunk_size=24 cannot run in the gated delta-net Pallas kernel: .* set gdn_chunk_size=16 or gdn_kernel=jnp",
        tiny=True),
    Row("fp8-with-float16", T, [B, "quantization=fp8", "dtype=float16"],
        r"quantization=fp8 with dtype=float16 is not supported: .* use dtype=bfloat16"),
    Row("fp8-unknown-recipe", T, [B, "quantization=int8"], r"quantization='int8' is not supported; use quantization=fp8"),
    Row("fp8-head-without-quantization", T, [B, "quantize_output_head=true"],
        r"quantize_output_head=true only applies with quantization=fp8 or fp8_mlp"),
    Row("key-twice-on-command-line", T, [B, "steps=3", "steps=5"], r"the command line sets steps twice \(argument 2: "
        r"'steps=3' and argument 3: 'steps=5'\)"),
    Row("override-without-equals", T, [B, "steps"], r"cannot read argument 'steps': overrides are key=value"),
    Row("first-argument-not-yaml", T, ["steps=3"], r"the first argument must be a YAML config file"),
    Row("no-arguments", T, [], r"usage: python -m maxtrain.train configs/base.yml"),
    Row("eval-split-zero-default-corpus", T, [B, "eval_split_fraction=0"], r"eval_split_fraction=0.0 must be "
        r"strictly between 0 and 1"),
    # train: nothing silent (issue 44): a setting of a feature that is off, a family's defining setting left off,
    # a sampler with one choice, a sequence too short for a setting, an empty output directory
    Row("feature-off-distillation-key", T, [B, "distill_alpha=0.3"], r"distill_alpha=0.3 does nothing without "
        r"objective=distill \(here objective=lm\): set objective=distill .*, or drop distill_alpha"),
    Row("feature-off-muon-key", T, [B, "muon_beta=0.9"], r"muon_beta=0.9 does nothing without opt_type=muon"),
    Row("feature-off-moe-key-on-dense", T, [B, "num_experts_per_tok=2"], r"num_experts_per_tok=2 does nothing without "
        r"a mixture-of-experts family \(here decoder_block=llama\)"),
    Row("feature-off-window-on-llama", T, [B, "sliding_window_size=4096"], r"sliding_window_size=4096 does nothing "
        r"without sliding-window layers"),
    Row("family-gpt-oss-without-window", T, [B, "model_name=gpt-oss-20b", "sliding_window_size=0"],
        r"decoder_block=gpt_oss has sliding-window layers .* set sliding_window_size=128"),
    Row("family-olmo3-without-window", T, [B, "model_name=olmo3-7b", "sliding_window_size=0"],
        r"decoder_block=olmo3 has sliding-window layers \(sliding sliding sliding full, repeated\), but "
        r"sliding_window_size=0 .* set sliding_window_size=4096"),
    Row("family-moe-with-one-expert", T, [B, "decoder_block=mixtral"], r"decoder_block=mixtral is a mixture of experts, "
        r"but num_experts=1 .* set num_experts=8"),
    # Gemma 4 (gemma4_text): layers of their own head shape, shared keys and values
    Row("gemma4-shared-kv-without-producer", T, [*G4, "attention_layer_types=[sliding,sliding,sliding,full]",
                                                 "num_kv_shared_layers=1"],
        r"num_kv_shared_layers=1: each of the last 1 layers shares the keys and values of an earlier layer .* "
        r"leave none for \['full'\]"),
    Row("gemma4-shared-kv-all-layers", T, [*G4, "num_kv_shared_layers=4"], r"num_kv_shared_layers=4: .* use fewer"),
    Row("gemma4-global-head-dim-odd", T, [*G4, "global_head_dim=33"], r"global_head_dim=33 must be even"),
    Row("gemma4-global-kv-heads-not-dividing", T, [*G4, "global_num_kv_heads=3"],
        r"base_num_query_heads=4 must be a multiple of global_num_kv_heads=3"),
    Row("gemma4-cudnn-wide-heads", T, [*G4, "global_head_dim=512", "attention=cudnn"],
        r"attention=cudnn takes heads of at most 256 features, but global_head_dim=512"),
    Row("gemma4-double-wide-without-shared", T, [*G4, "double_wide_mlp=true"],
        r"double_wide_mlp=true widens the shared-KV layers' MLP, but num_kv_shared_layers=0"),
    Row("gemma4-key-on-another-family", T, [B, "global_head_dim=128"],
        r"global_head_dim=128 does nothing without decoder_block=gemma4_text"),
    Row("rope-proportion-without-proportional", T, [B, "rope_proportion=0.5"],
        r"rope_proportion=0.5 does nothing without rope_type=proportional"),
    Row("grpo-top-k-of-one", T, [B, "objective=grpo", "dataset_type=jsonl", "grain_train_files=x.jsonl",
                                 "train_data_columns=[prompt,answer]", "eval_data_columns=[prompt,answer]",
                                 "decode_sampling_strategy=topk", "decode_sampling_top_k=1"],
        r"objective=grpo samples .*decode_sampling_top_k=1.* would all be the same"),
    Row("mtp-modules-beyond-the-sequence", T, [B, "model_name=deepseek3-tiny", "mtp_num_layers=4", "max_target_length=4"],
        r"mtp_num_layers=4 needs max_target_length >= 5, but max_target_length=4"),
    # (a chunk of Llama 4's chunked attention at least as long as the sequence is full attention: accepted, as Llama 4
    # Scout's 8,192 at 4,096 tokens; tests/test_config.py)
    Row("hybrid-gdn-chunk-longer-than-the-sequence", T, [B, "model_name=qwen3-next-80b-a3b", "gdn_chunk_size=128",
                                                         "max_target_length=64"],
        r"gdn_chunk_size=128 needs max_target_length >= 128, but max_target_length=64: the gated delta rule pads the "
        r"sequence to whole chunks"),
    # the off-feature gate's second switches: a key of an active family that needs another of its switches
    Row("feature-off-temperature-scale-without-tuning", T, [B, "decoder_block=llama4_text", "num_experts=4",
                                                            "nope_layer_interval=4", "temperature_tuning_scale=0.2"],
        r"temperature_tuning_scale=0.2 does nothing without temperature_tuning=true \(here temperature_tuning=false\)"),
    Row("feature-off-chunk-without-rope-layers", T, [B, "decoder_block=llama4_text", "num_experts=4",
                                                     "nope_layer_interval=1", "chunk_attn_window_size=64"],
        r"chunk_attn_window_size=64 does nothing without RoPE layers \(nope_layer_interval other than 1\) \(here "
        r"nope_layer_interval=1\)"),
    Row("feature-off-gdn-without-linear-layers", T, [B, "model_name=qwen3-next-80b-a3b",
                                                     "inhomogeneous_layer_cycle_interval=1", "gdn_chunk_size=32"],
        r"gdn_chunk_size=32 does nothing without gated delta-net layers \(inhomogeneous_layer_cycle_interval >= 2\)"),
    Row("feature-off-grouped-matmul-with-capacity", T, [B, "decoder_block=mixtral", "num_experts=4",
                                                        "moe_dispatch=capacity", "moe_grouped_matmul=pallas"],
        r"moe_grouped_matmul='pallas' does nothing without moe_dispatch=dropless \(here moe_dispatch=capacity\)"),
    Row("feature-off-key-of-a-user-preset", T, [B, "model_name={scratch}/my.yml"],
        r"model_name=.*/my.yml: temperature_tuning_scale=0.2 does nothing without temperature_tuning=true",
        setup=yaml_file("decoder_block: llama4_text\nnum_experts: 4\nnope_layer_interval: 4\n"
                        "temperature_tuning_scale: 0.2\n")),
    # rules that place experts leaving none
    Row("moe-sparse-step-leaves-no-experts", T, [B, "decoder_block=qwen3_moe", "num_experts=4",
                                                 "decoder_sparse_step=8"],
        r"decoder_sparse_step=8 leaves no layer of experts among base_num_decoder_layers=4: decoder_block=qwen3_moe "
        r"would be a dense model"),
    Row("moe-mlp-only-layers-leave-no-experts", T, [B, "decoder_block=qwen3_moe", "num_experts=4",
                                                    "mlp_only_layers=[0,1,2,3]"],
        r"mlp_only_layers=\[0, 1, 2, 3\] leaves no layer of experts"),
    # keys of another command
    Row("train-with-compile-topology", T, [B, "compile_topology=v5p-8"],
        r"compile_topology='v5p-8' is read by maxtrain.train_compile, not by maxtrain.train"),
    Row("train-with-compile-report-file", T, [B, "compile_report_file={scratch}/r.json"],
        r"compile_report_file='.*/r.json' is read by maxtrain.train_compile, not by maxtrain.train"),
    Row("decode-with-compiled-trainstep-file", D, [B, "compiled_trainstep_file={scratch}/step.bin"],
        r"compiled_trainstep_file='.*/step.bin' is read by maxtrain.train_compile and maxtrain.train, not by "
        r"maxtrain.decode"),
    Row("llama4-nope-interval-zero", T, [B, "decoder_block=llama4_text", "num_experts=4", "nope_layer_interval=0"],
        r"nope_layer_interval=0 is not allowed: it must be -1 or >= 1"),
    Row("llama4-chunks-with-context-parallelism", T, [B, "decoder_block=llama4_text", "num_experts=4",
                                                      "chunk_attn_window_size=64", "ici_context_parallelism=2"],
        r"chunk_attn_window_size=64 \(chunked attention\) does not run with context parallelism 2 yet; set "
        r"ici_context_parallelism=1"),
    Row("feature-off-llama4-key-on-llama", T, [B, "use_qk_norm=true"], r"use_qk_norm=true does nothing without "
        r"decoder_block=llama4_text"),
    Row("glm4_moe-rotated-features-odd", T, [B, "model_name=glm-4.5-air", "partial_rotary_factor=0.01"],
        r"partial_rotary_factor=0.01 rotates 1 of head_dim=128 features, but RoPE rotates an even number of them "
        r"\(at least 2\)"),
    Row("feature-off-partial-rope-on-llama", T, [B, "partial_rotary_factor=0.5"],
        r"partial_rotary_factor=0.5 does nothing without decoder_block=.*glm4_moe \(here decoder_block=llama\)"),
    Row("feature-off-attention-bias-on-llama", T, [B, "attention_bias=true"],
        r"attention_bias=true does nothing without decoder_block=glm4_moe \(here decoder_block=llama\)"),
    Row("glm4_moe-dense-layers-leave-no-experts", T, [B, "model_name=glm-4.5-air", "first_num_dense_layers=46"],
        r"first_num_dense_layers=46 leaves no layer of experts among base_num_decoder_layers=46"),
    Row("output-directory-empty", T, [B, "base_output_directory="], r"base_output_directory is empty .* the run would "
        r"be written into the current directory"),
    Row("decode-top-k-without-topk", D, [B, "decode_sampling_top_k=5"], r"decode_sampling_top_k=5 does nothing without "
        r"decode_sampling_strategy=topk"),
    # train: post-training (SFT, DPO, LoRA; docs/post_training.md)
    # the old switches (use_sft, use_dpo, use_grpo, use_distillation) still work with a notice; two of them, or one
    # against objective, are refused naming both keys
    Row("sft-and-dpo", T, [B, "use_sft=true", "use_dpo=true"], r"use_sft=true and use_dpo=true were both set; a run "
        r"has one objective: set objective=sft or objective=dpo"),
    Row("old-key-contradicts-objective", T, [B, "objective=sft", "use_dpo=true"], r"use_dpo=true contradicts "
        r"objective=sft: a run has one objective; drop use_dpo"),
    Row("objective-unknown", T, [B, "objective=ppo"], r"objective='ppo' is not allowed: it must be one of: lm, sft, dpo, "
        r"grpo, distill"),
    Row("sft-default-corpus", T, [B, "objective=sft", "train_data_columns=[messages]", "eval_data_columns=[messages]"],
        r"objective=sft reads jsonl or parquet files, but dataset_type=default"),
    Row("dpo-two-columns", T, [B, "objective=dpo", "dataset_type=jsonl", "grain_train_files=x.jsonl",
                               "train_data_columns=[prompt,chosen]"],
        r"objective=dpo reads preference pairs, but train_data_columns=\['prompt', 'chosen'\]; set "
        r"train_data_columns=\[prompt,chosen,rejected\]"),
    Row("dpo-beta-zero", T, [B, "dpo_beta=0"], r"dpo_beta=0.0 is not allowed: it must be > 0"),
    Row("lora-target-unknown", T, [B, "lora_rank=4", "lora_target_modules=[q_proj,v_proj]"],
        r"lora_target_modules=\['q_proj', 'v_proj'\] must list distinct projections among q, k, v, o, gate, up, down"),
    Row("muon-with-lora", T, [B, "opt_type=muon", "lora_rank=4"],
        r"opt_type=muon trains whole weight matrices, but lora_rank=4 trains low-rank adapters: set opt_type=adamw"),
    Row("chat-template-unknown", T, [B, "chat_template=vicuna"], r"chat_template='vicuna' is not a built-in template"),
    Row("sft-no-chat-template", T, [B, "objective=sft", "dataset_type=jsonl", "tokenizer_path={tok}",
                                    "grain_train_files={scratch}/rows.jsonl", "train_data_columns=[messages]",
                                    "eval_data_columns=[messages]"],
        r"the tokenizer .*tok.model has no chat template.* chat_template.* chatml", tiny=True, setup=jsonl_file([])),
    Row("sft-no-assistant-turn", T, [B, "objective=sft", "dataset_type=jsonl", "tokenizer_path={tok}",
                                     "chat_template=plain", "grain_train_files={scratch}/rows.jsonl",
                                     "train_data_columns=[messages]", "eval_data_columns=[messages]"],
        r"rows.jsonl line 1: the conversation has no assistant turn", tiny=True,
        setup=jsonl_file([{"messages": [{"role": "user", "content": "hi"}]}])),
    Row("sft-unknown-role", T, [B, "objective=sft", "dataset_type=jsonl", "tokenizer_path={tok}",
                                "chat_template=plain", "grain_train_files={scratch}/rows.jsonl",
                                "train_data_columns=[messages]", "eval_data_columns=[messages]"],
        r"rows.jsonl line 1: message 0 has an unknown role 'human'", tiny=True,
        setup=jsonl_file([{"messages": [{"role": "human", "content": "hi"}, {"role": "assistant", "content": "x"}]}])),
    Row("sft-eval-file-without-the-column", T, [B, "objective=sft", "dataset_type=jsonl", "tokenizer_path={tok}",
                                                "chat_template=plain", "grain_train_files={scratch}/rows.jsonl",
                                                "grain_eval_files={data}/good.jsonl", "train_data_columns=[messages]",
                                                "eval_data_columns=[messages]"],
        r"good.jsonl line 1: no 'messages' field \(the record has: text\)\. Name the fields with "
        r"eval_data_columns=\[messages\]", tiny=True, setup=jsonl_file([])),
    Row("grpo-columns-without-eval-files", T, [B, "objective=grpo", "dataset_type=jsonl", "grain_train_files=x.jsonl",
                                               "train_data_columns=[prompt,answer]"],
        r"objective=grpo samples each prompt's completions with decode_sampling_strategy=greedy"),
    Row("dpo-every-pair-truncated", T, [B, "objective=dpo", "dataset_type=jsonl", "tokenizer_path={tok}",
                                        "chat_template=plain", "grain_train_files={scratch}/pairs.jsonl",
                                        "train_data_columns=[prompt,chosen,rejected]",
                                        "eval_data_columns=[prompt,chosen,rejected]"],
        r"the first preference pair of every train file leaves no token to learn from at max_target_length=32 .* "
        r"Raise max_target_length to \d+ or more", tiny=True,
        setup=lambda w, s: _write(os.path.join(s, "pairs.jsonl"), json.dumps(
            {"prompt": "the same long question " * 30, "chosen": "yes", "rejected": "no"}) + "\n")),
    Row("dpo-row-without-rejected", T, [B, "objective=dpo", "dataset_type=jsonl", "tokenizer_path={tok}",
                                        "chat_template=plain", "grain_train_files={scratch}/rows.jsonl",
                                        "train_data_columns=[prompt,chosen,rejected]",
                                        "eval_data_columns=[prompt,chosen,rejected]"],
        r"rows.jsonl line 1: a DPO row needs 'prompt', 'chosen' and 'rejected', but 'rejected' is missing", tiny=True,
        setup=jsonl_file([{"prompt": "1+1=", "chosen": "2"}])),
    # train: distillation (docs/post_training.md, "Distillation"); refused before any data or compile work
    Row("distill-no-teacher", T, [B, "objective=distill"], r"objective=distill needs a teacher: set "
        r"distill_teacher_path="),
    Row("distill-alpha-above-one", T, [B, "distill_alpha=1.5"], r"distill_alpha=1.5 is not allowed: it must be in "
        r"\[0, 1\]"),
    Row("distill-temperature-zero", T, [B, "distill_temperature=0"], r"distill_temperature=0.0 is not allowed: it "
        r"must be > 0"),
    Row("distill-and-dpo", T, [B, "use_distillation=true", "distill_teacher_path={run}", "use_dpo=true",
                               "dataset_type=jsonl", "grain_train_files=x.jsonl",
                               "train_data_columns=[prompt,chosen,rejected]", "eval_data_columns=[prompt,chosen,rejected]"],
        r"use_distillation=true and use_dpo=true were both set; a run has one objective"),
    Row("distill-pipeline-stages", T, [B, "objective=distill", "distill_teacher_path={run}",
                                       "ici_pipeline_parallelism=2"],
        r"objective=distill does not run with pipeline parallelism yet; set ici_pipeline_parallelism=1"),
    Row("distill-teacher-missing", T, [B, "objective=distill", "distill_teacher_path={scratch}/none",
                                       "run_name=new", "base_output_directory={scratch}"],
        r"distill_teacher_path='.*/none' does not exist", tiny=True),
    Row("distill-teacher-other-vocab", T, [B, "objective=distill", "distill_teacher_path={run}", "vocab_size=256",
                                           "run_name=new", "base_output_directory={scratch}"],
        r"the teacher .*/run/checkpoints/4 predicts a vocabulary of 512 tokens and the student 256; .* same tokenizer",
        tiny=True),
    # train: YAML files
    Row("yaml-missing", T, ["{scratch}/none.yml"], r"config file '.*/none.yml' does not exist"),
    Row("yaml-empty", T, ["{scratch}/my.yml"], r"config file '.*/my.yml' is empty", setup=yaml_file("")),
    Row("yaml-key-twice", T, ["{scratch}/my.yml"], r"config file '.*/my.yml' sets steps twice \(line 1 and line 3\)",
        setup=yaml_file("steps: 3\nseed: 1\nsteps: 5\n")),
    Row("yaml-invalid", T, ["{scratch}/my.yml"], r"config file '.*/my.yml' is not valid YAML at line 2",
        setup=yaml_file("steps: [3\nseed: 1\n")),
    Row("yaml-a-list", T, ["{scratch}/my.yml"], r"must be a mapping of `key: value` lines, but it is a list",
        setup=yaml_file("- steps: 3\n")),
    Row("yaml-unknown-key", T, ["{scratch}/my.yml"], r"/my.yml: unknown config key 'stepz': did you mean steps\?",
        setup=yaml_file("base_config: {base}\nstepz: 3\n")),
    Row("yaml-base-missing", T, ["{scratch}/my.yml"], r"base_config 'nowhere.yml' does not exist",
        setup=yaml_file("base_config: nowhere.yml\nsteps: 3\n")),
    Row("yaml-base-cycle", T, ["{scratch}/my.yml"], r"base_config cycle", setup=yaml_file("base_config: my.yml\n")),
    Row("yaml-range", T, ["{scratch}/my.yml"], r"adam_eps=-1.0 is not allowed",
        setup=yaml_file("base_config: {base}\nadam_eps: -1\n")),
    # train: multi-process settings (refused before any wait)
    Row("port-above-65535", T, [B, "coordinator_address=127.0.0.1:99999", "num_processes=2", "process_id=1"],
        r"coordinator_address='127.0.0.1:99999': port 99999 is outside 1-65535"),
    Row("address-without-port", T, [B, "coordinator_address=10.0.0.1", "num_processes=2", "process_id=0"],
        r"coordinator_address='10.0.0.1' must be host:port"),
    Row("process-id-out-of-range", T, [B, "coordinator_address=127.0.0.1:1234", "num_processes=2", "process_id=2"],
        r"process_id=2 must be in \[0, num_processes=2\)"),
    Row("grpo-on-two-processes", T, [B, "objective=grpo", "dataset_type=jsonl", "grain_train_files=x.jsonl",
                                     "train_data_columns=[prompt,answer]", "decode_sampling_strategy=weighted",
                                     "coordinator_address=127.0.0.1:1234", "num_processes=2", "process_id=1"],
        r"objective=grpo runs in one process for now \(its rollouts are gathered on one host\), but num_processes=2"),
    Row("processes-without-coordinator", T, [B, "num_processes=2", "process_id=0"],
        r"num_processes=2 needs coordinator_address=host:port"),
    # train: outputs
    Row("metrics-file-under-a-file", T, [B, "metrics_file={scratch}/afile/m.jsonl"],
        r"metrics_file='.*/afile/m.jsonl' cannot be created: .*/afile is a file", setup=a_file),
    Row("metrics-file-is-a-directory", T, [B, "metrics_file={scratch}"], r"metrics_file='.*' is a directory"),
    Row("output-under-a-file", T, [B, "base_output_directory={scratch}/afile"],
        r"base_output_directory='.*/afile' .*is a file", setup=a_file),
    Row("run-directory-is-a-file", T, [B, "base_output_directory={scratch}", "run_name=afile"],
        r"the run directory '.*/afile' is a file, not a directory.* choose another run_name", setup=a_file),
    Row("dataset-cache-dir-under-a-file", T, [B, "dataset_cache_dir={scratch}/afile/cache"],
        r"dataset_cache_dir='.*/afile/cache' cannot be created: .*/afile is a file", setup=a_file),
    Row("run-name-escapes-the-output-directory", T, [B, "base_output_directory={scratch}", "run_name=../../x"],
        r"run_name='../../x' must be one directory name .* set base_output_directory; e.g. "
        r"base_output_directory=.* run_name=x"),
    Row("run-name-absolute", T, [B, "run_name={scratch}/elsewhere"], r"run_name='.*/elsewhere' must be one directory "
        r"name"),
    # train: data
    Row("jsonl-without-files", T, [B, "dataset_type=jsonl"], r"dataset_type=jsonl needs grain_train_files"),
    Row("glob-matches-nothing", T, [B, "dataset_type=jsonl", "tokenizer_path={tok}",
                                    "grain_train_files={data}/nothing*.jsonl"],
        r"grain_train_files: '.*/nothing\*.jsonl' matches no files", tiny=True),
    Row("train-files-a-directory", T, [B, "dataset_type=arrayrecord", "grain_train_files={prepared}"],
        r"grain_train_files: '.*/prepared' is a directory, not a glob of files: name its files, e.g. "
        r"'.*/prepared/train-\*\.arrayrecord'", tiny=True),
    Row("eval-files-a-directory", T, [B, "dataset_type=jsonl", "tokenizer_path={tok}",
                                      "grain_train_files={data}/good.jsonl", "grain_eval_files={data}/"],
        r"grain_eval_files: '.*/data/' is a directory, not a glob of files: name its files, e.g. '.*/data/\*\.jsonl' "
        r"\(it holds \d+ \.jsonl", tiny=True),
    Row("jsonl-files-a-prepared-directory", T, [B, "dataset_type=jsonl", "tokenizer_path={tok}",
                                                "grain_train_files={prepared}"],
        r"'.*/prepared' is a directory of prepared \(tokenized\) data, not jsonl files: read it with "
        r"dataset_type=arrayrecord", tiny=True),
    Row("mixture-weight-not-a-number", T, [B, "dataset_type=jsonl", "tokenizer_path={tok}",
                                           "grain_train_files={data}/good*:abc"],
        r"the weight of '.*/good\*' is 'abc', which is not a number", tiny=True),
    Row("mixture-weight-infinite", T, [B, "dataset_type=jsonl", "tokenizer_path={tok}",
                                       "grain_train_files={data}/good*:inf"],
        r"the weight of '.*/good\*' is inf; weights must be finite and > 0", tiny=True),
    Row("mixture-weight-zero", T, [B, "dataset_type=jsonl", "tokenizer_path={tok}",
                                   "grain_train_files={data}/good*:0"],
        r"weights must be finite and > 0", tiny=True),
    Row("mixture-weight-without-glob", T, [B, "dataset_type=jsonl", "tokenizer_path={tok}", "grain_train_files=:0.5"],
        r"':0.5' has a weight but no files before it", tiny=True),
    Row("jsonl-not-json", T, [B, "dataset_type=jsonl", "tokenizer_path={tok}",
                              "grain_train_files={data}/bad_json.jsonl"],
        r"bad_json.jsonl line 1: not valid JSON", tiny=True),
    Row("jsonl-text-not-a-string", T, [B, "dataset_type=jsonl", "tokenizer_path={tok}",
                                       "grain_train_files={data}/nonstring.jsonl"],
        r"nonstring.jsonl line 1: field 'text' holds a int, not a string", tiny=True),
    Row("jsonl-no-text-field", T, [B, "dataset_type=jsonl", "tokenizer_path={tok}",
                                   "grain_train_files={data}/no_field.jsonl"],
        r"no_field.jsonl line 1: no 'text' field \(the line has: body\)", tiny=True),
    Row("jsonl-train-file-without-the-column", T, [B, "dataset_type=jsonl", "tokenizer_path={tok}",
                                                   "grain_train_files={data}/good.jsonl", "train_data_columns=[body]",
                                                   "grain_eval_files={data}/no_field.jsonl",
                                                   "eval_data_columns=[body]"],
        r"good.jsonl line 1: no 'body' field \(the line has: text\)\. Name the text field with "
        r"train_data_columns=\[NAME\]", tiny=True),
    Row("jsonl-eval-file-without-the-column", T, [B, "dataset_type=jsonl", "tokenizer_path={tok}",
                                                  "grain_train_files={data}/good.jsonl",
                                                  "grain_eval_files={data}/no_field.jsonl"],
        r"no_field.jsonl line 1: no 'text' field \(the line has: body\)\. Name the text field with "
        r"eval_data_columns=\[NAME\]", tiny=True),
    Row("parquet-eval-file-without-the-column", T, [B, "dataset_type=parquet", "tokenizer_path={tok}",
                                                    "grain_train_files={data}/no_text_column.parquet",
                                                    "train_data_columns=[body]",
                                                    "grain_eval_files={data}/no_text_column.parquet"],
        r"no_text_column.parquet: no column 'text' \(columns: body\)\. Name the text column with "
        r"eval_data_columns=\[NAME\]", tiny=True),
    Row("jsonl-empty-file", T, [B, "dataset_type=jsonl", "tokenizer_path={tok}",
                                "grain_train_files={data}/empty.jsonl"], r"empty.jsonl is empty", tiny=True),
    Row("jsonl-bad-utf8", T, [B, "dataset_type=jsonl", "tokenizer_path={tok}",
                              "grain_train_files={data}/bad_utf8.jsonl"],
        r"bad_utf8.jsonl line 1: invalid UTF-8", tiny=True),
    Row("parquet-not-parquet", T, [B, "dataset_type=parquet", "tokenizer_path={tok}",
                                   "grain_train_files={data}/not.parquet"],
        r"not.parquet: not a readable parquet file", tiny=True),
    Row("parquet-no-text-column", T, [B, "dataset_type=parquet", "tokenizer_path={tok}",
                                      "grain_train_files={data}/no_text_column.parquet"],
        r"no_text_column.parquet: no column 'text' \(columns: body\)", tiny=True),
    Row("parquet-column-not-text", T, [B, "dataset_type=parquet", "tokenizer_path={tok}",
                                       "grain_train_files={data}/int_column.parquet"],
        r"int_column.parquet: column 'text' has type int64, not string", tiny=True),
    Row("jsonl-as-parquet", T, [B, "dataset_type=parquet", "tokenizer_path={tok}",
                                "grain_train_files={data}/good.jsonl"],
        r"good.jsonl is a jsonl file but dataset_type=parquet", tiny=True),
    Row("unknown-file-type", T, [B, "dataset_type=jsonl", "tokenizer_path={tok}", "grain_train_files={data}/table.csv"],
        r"table.csv: unknown file type", tiny=True),
    Row("tokenizer-missing", T, [B, "dataset_type=jsonl", "tokenizer_path={scratch}/none.model",
                                 "grain_train_files={data}/good.jsonl"],
        r"tokenizer_path='.*/none.model' does not exist", tiny=True),
    Row("tokenizer-garbage", T, [B, "dataset_type=jsonl", "tokenizer_path={root}/garbage.model",
                                 "grain_train_files={data}/good.jsonl"],
        r"garbage.model'? is not a (valid )?sentencepiece model", tiny=True),
    Row("default-corpus-vocab-below-characters", T, [B, "vocab_size=10"],
        r"vocab_size=10 is too small for this text: .* Use vocab_size=\d+ or more", tiny=True),
    Row("step-larger-than-memory", T, [B, "per_device_batch_size=10000000"],
        r"the compiled train step needs [\d,.]+ GiB per device .*, more than the [\d,.]+ GiB it can have .* Try a "
        r"smaller per_device_batch_size \(now 10000000", tiny=True),
    Row("tokenizer-larger-than-vocab", T, [B, "dataset_type=jsonl", "tokenizer_path={tok}",
                                           "grain_train_files={data}/good.jsonl", "vocab_size=256"],
        r"has 400 pieces but vocab_size=256", tiny=True),
    Row("arrayrecord-without-metadata", T, [B, "dataset_type=arrayrecord", "grain_train_files={scratch}/x.arrayrecord"],
        r"has no metadata.json", tiny=True, setup=lambda w, s: _write(os.path.join(s, "x.arrayrecord"), "x")),
    Row("arrayrecord-other-tokenizer", T, [B, "dataset_type=arrayrecord", "tokenizer_path={root}/garbage.model",
                                           "grain_train_files={prepared}/train-*.arrayrecord"],
        r"garbage.model'? is not a (valid )?sentencepiece model", tiny=True),
    # train: checkpoints
    Row("load-parameters-missing", T, [B, "load_parameters_path={scratch}/none", "run_name=new",
                                       "base_output_directory={scratch}", "dataset_cache_dir={cache}"],
        r"load_parameters_path='.*/none' does not exist", tiny=True),
    Row("load-parameters-empty-dir", T, [B, "load_parameters_path={scratch}/nothing", "run_name=new",
                                         "base_output_directory={scratch}", "dataset_cache_dir={cache}"],
        r"load_parameters_path='.*/nothing' holds no complete checkpoint", tiny=True, setup=empty_dir),
    Row("load-parameters-does-not-fit", T, [B, "load_parameters_path={run}", "run_name=new", "base_emb_dim=64",
                                            "base_output_directory={scratch}", "dataset_cache_dir={cache}"],
        r"the checkpoint .*/run/checkpoints/4 \(load_parameters_path\) does not fit the configured model", tiny=True),
    Row("load-full-state-other-optimizer", T, [B, "load_full_state_path={run}", "opt_type=muon", "run_name=new",
                                               "base_output_directory={scratch}", "dataset_cache_dir={cache}"],
        r"/run/checkpoints/4 \(load_full_state_path\) holds the optimizer state of opt_type=adamw, not of "
        r"opt_type=muon: continue it with opt_type=adamw", tiny=True),
    Row("moe-preset-dense-checkpoint", T, [B, "model_name=mixtral-8x7b", "load_parameters_path={run}", "run_name=new",
                                           "base_output_directory={scratch}", "dataset_cache_dir={cache}"],
        r"holds a dense llama model \(no experts\), but this run's model is a mixture of experts \(mixtral, 8 experts, "
        r"2 per token\)", tiny=True),
    Row("load-parameters-bit-flipped", T, [B, "load_parameters_path={scratch}/run/checkpoints/4", "run_name=new",
                                           "base_output_directory={scratch}", "dataset_cache_dir={cache}"],
        r"is damaged: .*/checkpoints/4/state/.*: its contents changed since it was saved", tiny=True, setup=flipped),
    Row("load-full-state-truncated", T, [B, "load_full_state_path={scratch}/run/checkpoints/4", "run_name=new",
                                         "base_output_directory={scratch}", "dataset_cache_dir={cache}"],
        r"is damaged: .*/checkpoints/4/state/.* has \d+ bytes, but \d+ were saved", tiny=True, setup=truncated),
    Row("resume-past-steps", T, [B, "run_name=run", "base_output_directory={scratch}", "dataset_cache_dir={cache}",
                                 "steps=2"],
        r"checkpoint .*/run/checkpoints/4 is at step 4, steps=2: nothing to train; raise steps", code=0, tiny=True,
        setup=lambda w, s: copy_run(w, s)),
    Row("resume-bit-flipped-falls-back", T, [B, "run_name=run", "base_output_directory={scratch}",
                                             "dataset_cache_dir={cache}", "steps=2"],
        r"checkpoint step 4 is damaged: .*/checkpoints/4/state/.*: its contents changed since it was saved .*\. Moved "
        r"it to .*/run/damaged_checkpoints/4", code=0, tiny=True, setup=flipped),
    Row("resume-state-deleted-falls-back", T, [B, "run_name=run", "base_output_directory={scratch}",
                                               "dataset_cache_dir={cache}", "steps=2"],
        r"checkpoint step 4 is damaged: .*/checkpoints/4/state is missing", code=0, tiny=True, setup=no_state),
    Row("resume-every-step-damaged", T, [B, "run_name=run", "base_output_directory={scratch}",
                                         "dataset_cache_dir={cache}", "steps=2"],
        r"no usable checkpoint is left in .*/run/checkpoints: every step was damaged \(step 2: .*: its contents "
        r"changed since it was saved \(checksum mismatch\)\) and was moved to .*/run/damaged_checkpoints",
        tiny=True, setup=every_step_flipped),
    Row("resume-with-another-objective", T, [B, "run_name=run", "base_output_directory={scratch}",
                                             "dataset_cache_dir={cache}", "objective=distill",
                                             "distill_teacher_path={run}", "steps=6"],
        r"this run's checkpoint .*/run/checkpoints/4 was trained with objective=lm, and this run has objective=distill: "
        r"the objective changed\. Start the new stage as a new run from its parameters \(run_name=<a new name> "
        r"load_parameters_path=", tiny=True, setup=lambda w, s: copy_run(w, s)),
    Row("load-full-state-of-another-objective", T, [B, "load_full_state_path={run}", "objective=distill",
                                                    "distill_teacher_path={run}", "run_name=new",
                                                    "base_output_directory={scratch}", "dataset_cache_dir={cache}"],
        r"load_full_state_path=.*/run/checkpoints/4 holds the state of a run with objective=lm .* the objective "
        r"changed\. Start the new stage from its parameters: load_parameters_path=", tiny=True),
    # train: the checks see the model a checkpoint's settings make (adopted where the command sets no model_name)
    Row("imported-deepseek-expert-parallelism", T, [B, "load_parameters_path={scratch}/ds", "ici_expert_parallelism=3",
                                                    "dataset_type=synthetic"],
        r"expert parallelism 3 .* must divide num_experts=8", setup=imported(DEEPSEEK)),
    Row("imported-deepseek-routing-key", T, [B, "load_parameters_path={scratch}/ds", "topk_routing_group=8",
                                             "dataset_type=synthetic"],
        r"topk_routing_group=8 is more than n_routing_groups=4", setup=imported(DEEPSEEK)),
    Row("imported-deepseek-mtp-key", T, [B, "load_parameters_path={scratch}/ds", "mtp_num_layers=1",
                                         "dataset_type=synthetic", "max_target_length=32", "per_device_batch_size=1",
                                         "run_name=new", "base_output_directory={scratch}"],
        r"the checkpoint .*/ds/checkpoints/0 \(load_parameters_path\) does not fit the configured model",
        setup=imported(DEEPSEEK)),
    Row("imported-tokenizer-other-than-the-prepared-data", T, [B, "load_parameters_path={scratch}/ds",
                                                               "dataset_type=arrayrecord", "max_target_length=32",
                                                               "grain_train_files={prepared}/train-*.arrayrecord",
                                                               "per_device_batch_size=1", "run_name=new",
                                                               "base_output_directory={scratch}"],
        r"but the model's tokenizer, .*/ds/hf \(adopted from its checkpoint\), has checksum \w+: .* Prepare the data "
        r"again with prepare_data.py --tokenizer .*/ds/hf", setup=imported(LLAMA, tokenizer=True)),
    Row("attention-cudnn-on-cpu", T, [B, "attention=cudnn"], r"attention=cudnn needs an NVIDIA GPU", tiny=True),
    Row("attention-tokamax-on-cpu", T, [B, "attention=tokamax"], r"attention=tokamax needs an NVIDIA GPU", tiny=True),
    Row("mesh-does-not-fit-devices", T, [B, "ici_data_parallelism=3"], r"ici_data_parallelism|devices", tiny=True),
    # decode
    Row("decode-no-checkpoint", D, [B], r"maxtrain.decode needs a checkpoint: set load_parameters_path="),
    Row("decode-checkpoint-missing", D, [B, "load_parameters_path={scratch}/none"],
        r"load_parameters_path='.*/none' does not exist"),
    Row("decode-bit-flipped", D, [B, "load_parameters_path={scratch}/run/checkpoints/4"],
        r"/checkpoints/4' is damaged: .*: its contents changed since it was saved", setup=flipped, tiny=True),
    Row("decode-truncated", D, [B, "load_parameters_path={scratch}/run/checkpoints/4"],
        r"/checkpoints/4' is damaged: .* has \d+ bytes, but \d+ were saved", setup=truncated, tiny=True),
    Row("decode-file-deleted", D, [B, "load_parameters_path={scratch}/run/checkpoints/4"],
        r"/checkpoints/4' is damaged: .* is missing \(it was saved with this step\)", setup=deleted, tiny=True),
    Row("decode-nucleus-above-1", D, [B, "decode_sampling_nucleus_p=1.5"], r"decode_sampling_nucleus_p=1.5 is not "
        r"allowed: it must be in \(0, 1\]"),
    Row("decode-strategy-unknown", D, [B, "decode_sampling_strategy=beam"], r"decode_sampling_strategy='beam' is not "
        r"allowed"),
    Row("decode-temperature-zero", D, [B, "decode_sampling_temperature=0"], r"decode_sampling_temperature=0.0 is not "
        r"allowed: it must be > 0"),
    Row("decode-empty-prompt", D, [B, "load_parameters_path={run}", "prompt=", "tokenizer_path={tok}"],
        r"prompt='' is empty: there is nothing to continue; give a prompt", tiny=True),
    Row("decode-prompt-longer-than-max-target-length", D, [B, "load_parameters_path={run}", "prompt=" + "x " * 60,
                                                           "tokenizer_path={tok}"],
        r"prompt='x x .*\.\.\.' is \d+ tokens, more than max_target_length=32 .* shorten the prompt or raise "
        r"max_target_length", tiny=True),
    Row("decode-continuation-past-max-target-length", D, [B, "load_parameters_path={run}", "prompt=def ",
                                                          "max_new_tokens=40", "tokenizer_path={tok}"],
        r"the prompt is \d+ tokens and max_new_tokens=40: \d+ tokens, more than max_target_length=32 .* set "
        r"max_new_tokens=\d+ or less, or raise max_target_length", tiny=True),
    Row("decode-no-new-tokens", D, [B, "load_parameters_path={run}", "tokenizer_path={tok}"],
        r"max_new_tokens=0: maxtrain.decode has no token to generate; set max_new_tokens=", tiny=True),
    Row("train-sample-prompt-empty", T, [B, "dataset_type=synthetic", "tokenizer_path={tok}", "prompt=",
                                         "max_new_tokens=4"],
        r"prompt='' is empty: .* \(it is the prompt of the greedy sample after training; max_new_tokens=0 skips",
        tiny=True),
    Row("eval-tasks-with-a-set-tokenizer-path", T, [B, "dataset_type=synthetic", "tokenizer_path={tok}",
                                                    "eval_tasks=arc_easy", "eval_tasks_cache_dir={scratch}/none"],
        r"no prepared evaluation data in .*/none", tiny=True),
    Row("decode-synthetic-without-tokenizer", D, [B, "load_parameters_path={run}", "dataset_type=synthetic"],
        r"dataset_type=synthetic has no tokenizer of its own; pass tokenizer_path=", tiny=True),
    # viz
    Row("viz-no-checkpoint", R, [B], r"maxtrain.viz needs a checkpoint: set load_parameters_path="),
    Row("viz-checkpoint-missing", R, [B, "load_parameters_path={scratch}/none"],
        r"load_parameters_path='.*/none' does not exist"),
    Row("viz-garbage-metadata", R, [B, "load_parameters_path={scratch}/run/checkpoints/4"],
        r"/checkpoints/4' is damaged: .*/metadata/metadata (has \d+ bytes, but|: its contents changed)",
        setup=garbage_metadata, tiny=True),
    Row("viz-samples-zero", R, [B, "viz_num_samples=0"], r"viz_num_samples=0 is not allowed: it must be >= 1"),
    Row("viz-no-eval-data", R, [B, "load_parameters_path={run}", "dataset_type=synthetic"],
        r"maxtrain.viz shows eval samples: use dataset_type=default or set grain_eval_files", tiny=True),
    # inspect_data
    Row("inspect-data-host-out-of-range", "inspect_data", [B, "num_processes=2", "process_id=3"],
        r"process_id=3 must be in \[0, num_processes=2\)"),
    Row("inspect-data-not-parquet", "inspect_data", [B, "dataset_type=parquet", "tokenizer_path={tok}",
                                                     "grain_train_files={data}/not.parquet"],
        r"not.parquet: not a readable parquet file", tiny=True),
    Row("inspect-data-bad-utf8", "inspect_data", [B, "dataset_type=jsonl", "tokenizer_path={tok}",
                                                  "grain_train_files={data}/bad_utf8.jsonl"],
        r"bad_utf8.jsonl line 1: invalid UTF-8", tiny=True),
    Row("inspect-data-batches-not-a-number", "inspect_data", ["--batches", "two", B],
        r"argument --batches: invalid int value: 'two'"),
    Row("inspect-data-unknown-key", "inspect_data", [B, "grain_train_file=x"], r"unknown config key 'grain_train_file'"),
    Row("inspect-data-mixture-weight", "inspect_data", [B, "dataset_type=jsonl", "tokenizer_path={tok}",
                                                        "grain_train_files={data}/good*:-1"],
        r"the weight of '.*/good\*' is -1; weights must be finite and > 0", tiny=True),
    # prepare_data
    Row("prepare-input-matches-nothing", "prepare_data", ["--input", "{data}/none*.jsonl", "--tokenizer", "{tok}",
                                                          "--output-dir", "{scratch}/out"],
        r"--input '.*/none\*.jsonl' matches no files"),
    Row("prepare-input-a-directory", "prepare_data", ["--input", "{data}", "--tokenizer", "{tok}",
                                                      "--output-dir", "{scratch}/out"],
        r"--input '.*/data' is a directory, not a glob of files: name its files, e.g. '.*/data/\*\.jsonl'"),
    Row("prepare-tokenizer-missing", "prepare_data", ["--input", "{data}/good.jsonl", "--tokenizer",
                                                      "{scratch}/none.model", "--output-dir", "{scratch}/out"],
        r"--tokenizer '.*/none.model' does not exist"),
    Row("prepare-tokenizer-garbage", "prepare_data", ["--input", "{data}/good.jsonl", "--tokenizer",
                                                      "{root}/garbage.model", "--output-dir", "{scratch}/out"],
        r"garbage.model'? is not a (valid )?sentencepiece model"),
    Row("prepare-eval-fraction", "prepare_data", ["--input", "{data}/good.jsonl", "--tokenizer", "{tok}",
                                                  "--output-dir", "{scratch}/out", "--eval-fraction", "1.5"],
        r"--eval-fraction=1.5 must be in \[0, 1\)"),
    Row("prepare-shard-mb-zero", "prepare_data", ["--input", "{data}/good.jsonl", "--tokenizer", "{tok}",
                                                  "--output-dir", "{scratch}/out", "--shard-mb", "0"],
        r"--shard-mb=0.0 must be a number > 0"),
    Row("prepare-workers-zero", "prepare_data", ["--input", "{data}/good.jsonl", "--tokenizer", "{tok}",
                                                 "--output-dir", "{scratch}/out", "--workers", "0"],
        r"--workers=0 must be at least 1"),
    Row("prepare-other-tokenizer", "prepare_data", ["--input", "{data}/good.jsonl", "--tokenizer",
                                                    "{scratch}/other.model", "--output-dir", "{prepared}",
                                                    "--workers", "1"],
        r"--output-dir .*/prepared was prepared with another tokenizer .* pass --overwrite",
        setup=lambda w, s: _other_tokenizer(w, s)),
    Row("prepare-output-is-a-file", "prepare_data", ["--input", "{data}/good.jsonl", "--tokenizer", "{tok}",
                                                     "--output-dir", "{scratch}/afile", "--workers", "1"],
        r"--output-dir .*/afile is a file, not a directory", setup=a_file),
    Row("prepare-not-parquet", "prepare_data", ["--input", "{data}/not.parquet", "--tokenizer", "{tok}",
                                                "--output-dir", "{scratch}/out", "--workers", "1"],
        r"not.parquet: not a readable parquet file"),
    Row("prepare-no-text-field", "prepare_data", ["--input", "{data}/no_field.jsonl", "--tokenizer", "{tok}",
                                                  "--output-dir", "{scratch}/out", "--workers", "1"],
        r"no_field.jsonl line 1: no 'text' field"),
    Row("prepare-unknown-file-type", "prepare_data", ["--input", "{data}/table.csv", "--tokenizer", "{tok}",
                                                      "--output-dir", "{scratch}/out"],
        r"table.csv: unknown file type"),
    # train_tokenizer
    Row("tokenizer-vocab-tiny", "train_tokenizer", ["--input", "{data}/good.jsonl", "--vocab-size", "3",
                                                    "--output", "{scratch}/t.model"],
        r"--vocab-size 3 is too small"),
    Row("tokenizer-vocab-below-characters", "train_tokenizer", ["--input", "{data}/chars.txt", "--vocab-size", "50",
                                                                "--output", "{scratch}/t.model"],
        r"--vocab-size 50 is too small for this text: .* Use --vocab-size \d+ or more"),
    Row("tokenizer-hf-vocab-below-bytes", "train_tokenizer", ["--kind", "hf", "--input", "{data}/good.jsonl",
                                                              "--vocab-size", "100", "--output", "{scratch}/t/"],
        r"--vocab-size 100 is too small for a byte-level BPE: .* Use --vocab-size 259 or more"),
    Row("tokenizer-vocab-above-text", "train_tokenizer", ["--input", "{data}/no_field.jsonl", "--text-field", "body",
                                                          "--vocab-size", "5000", "--output", "{scratch}/t.model"],
        r"--vocab-size 5000 is more pieces than sentencepiece can learn from this text \(at most \d+"),
    Row("tokenizer-input-matches-nothing", "train_tokenizer", ["--input", "{data}/none*.txt", "--output",
                                                               "{scratch}/t.model"], r"--input '.*' matches no files"),
    Row("tokenizer-input-a-prepared-directory", "train_tokenizer", ["--input", "{prepared}", "--output",
                                                                    "{scratch}/t.model"],
        r"--input '.*/prepared' is a directory of prepared \(tokenized\) data, not text: give the raw text files"),
    Row("tokenizer-output-is-a-directory", "train_tokenizer", ["--input", "{data}/good.jsonl", "--output", "{scratch}"],
        r"--output .* is a directory"),
    Row("tokenizer-output-under-a-file", "train_tokenizer", ["--input", "{data}/good.jsonl", "--output",
                                                             "{scratch}/afile/t.model"],
        r"--output .*/afile/t.model cannot be (written|created): .*/afile is a file", setup=a_file),
    Row("tokenizer-hf-output-under-a-file", "train_tokenizer", ["--kind", "hf", "--input", "{data}/good.jsonl",
                                                                "--vocab-size", "300", "--output", "{scratch}/afile/tok"],
        r"--output .*/afile/tok cannot be created: .*/afile is a file, not a directory", setup=a_file),
    Row("tokenizer-max-mb-zero", "train_tokenizer", ["--input", "{data}/good.jsonl", "--max-mb", "0", "--output",
                                                     "{scratch}/t.model"], r"--max-mb 0.0 must be a number > 0"),
    Row("tokenizer-input-not-json", "train_tokenizer", ["--input", "{data}/bad_json.jsonl", "--output",
                                                        "{scratch}/t.model"], r"bad_json.jsonl line 1: not valid JSON"),
    # convert_hf
    Row("convert-hf-dir-missing", "convert_hf", ["import", "{scratch}/none", "{scratch}/out"],
        r".*/none (has no config.json|is not a directory; pass a Hugging Face model directory)"),
    Row("convert-config-malformed", "convert_hf", ["import", "{scratch}/hf", "{scratch}/out"],
        r".*/hf/config.json(: Expecting property name| is not valid JSON)", setup=hf_dir("{model_type: llama")),
    Row("convert-config-a-list", "convert_hf", ["import", "{scratch}/hf", "{scratch}/out"],
        r".*/hf/config.json holds a JSON list, not an object", setup=hf_dir("[1, 2]")),
    Row("convert-config-unreadable", "convert_hf", ["import", "{scratch}/hf", "{scratch}/out"],
        r".*/hf has no config.json|cannot read .*/hf/config.json", setup=hf_dir("dir")),
    Row("convert-no-weights", "convert_hf", ["import", "{scratch}/hf", "{scratch}/out"],
        r".*/hf has no model.safetensors or model.safetensors.index.json", setup=hf_dir(LLAMA)),
    Row("convert-pickle-only", "convert_hf", ["import", "{scratch}/hf", "{scratch}/out"],
        r"pickle files and are never loaded", setup=hf_dir(LLAMA, {"pytorch_model.bin": b"\x80\x04garbage"})),
    Row("convert-safetensors-garbage", "convert_hf", ["import", "{scratch}/hf", "{scratch}/out"],
        r".*/hf/model.safetensors is not a safetensors file",
        setup=hf_dir(LLAMA, {"model.safetensors": b"\x10\x00\x00\x00\x00\x00\x00\x00{not json at all}"})),
    Row("convert-index-malformed", "convert_hf", ["import", "{scratch}/hf", "{scratch}/out"],
        r".*/hf/model.safetensors.index.json is not valid JSON",
        setup=hf_dir(LLAMA, {"model.safetensors.index.json": "{oops"})),
    Row("convert-config-size-not-a-count", "convert_hf", ["import", "{scratch}/hf", "{scratch}/out"],
        r".*/hf/config.json: num_attention_heads=0 is not a positive integer",
        setup=hf_dir({**LLAMA, "num_attention_heads": 0})),
    Row("convert-config-field-malformed", "convert_hf", ["import", "{scratch}/hf", "{scratch}/out"],
        r".*/hf/config.json is missing or has a malformed field for a llama model",
        setup=hf_dir({**LLAMA, "rope_scaling": "yarn"})),
    Row("convert-config-unbuildable", "convert_hf", ["import", "{scratch}/hf", "{scratch}/out"],
        r".*/hf/config.json describes a llama model that maxtrain's llama family cannot build: .*base_num_kv_heads=3",
        setup=hf_dir({**LLAMA, "num_key_value_heads": 3})),
    Row("convert-deepseek-softmax-router", "convert_hf", ["import", "{scratch}/hf", "{scratch}/out"],
        r".*/hf/config.json: cannot convert this checkpoint without changing its outputs: scoring_func='softmax'",
        setup=hf_dir({**DEEPSEEK, "scoring_func": "softmax"})),
    Row("convert-olmo3-scaled-sliding-rope", "convert_hf", ["import", "{scratch}/hf", "{scratch}/out"],
        r".*/hf/config.json: rope_parameters.sliding_attention=.*'yarn'.* \(maxtrain's sliding-window layers rotate by "
        r"an unscaled RoPE\)", setup=hf_dir({**OLMO3, "rope_parameters": {
            "full_attention": {"rope_type": "default", "rope_theta": 1e4},
            "sliding_attention": {"rope_type": "yarn", "factor": 2.0, "rope_theta": 1e4}}})),
    Row("convert-olmo3-sliding-layers-without-window", "convert_hf", ["import", "{scratch}/hf", "{scratch}/out"],
        r".*/hf/config.json: sliding_window=None with sliding_attention layers; set the window size",
        setup=hf_dir({**OLMO3, "sliding_window": None, "layer_types": ["sliding_attention", "full_attention"]})),
    Row("convert-glm4_moe-no-rotated-features", "convert_hf", ["import", "{scratch}/hf", "{scratch}/out"],
        r".*/hf/config.json describes a glm4_moe model that maxtrain's glm4_moe family cannot build: .*"
        r"partial_rotary_factor=0.1 rotates 0 of head_dim=8 features",
        setup=hf_dir({**GLM4_MOE, "partial_rotary_factor": 0.1})),
    Row("convert-glm4_moe-gelu", "convert_hf", ["import", "{scratch}/hf", "{scratch}/out"],
        r".*/hf/config.json: cannot convert this checkpoint without changing its outputs: hidden_act='gelu'",
        setup=hf_dir({**GLM4_MOE, "hidden_act": "gelu"})),
    Row("convert-safetensors-entry-malformed", "convert_hf", ["import", "{scratch}/hf", "{scratch}/out"],
        r".*/hf/model.safetensors: the header entry of tensor x is .*, not \{dtype, shape, data_offsets\}",
        setup=hf_dir(LLAMA, {"model.safetensors": _header({"x": {"dtype": "F32", "shape": [2]}})})),
    Row("convert-safetensors-truncated", "convert_hf", ["import", "{scratch}/hf", "{scratch}/out"],
        r".*/hf/model.safetensors: tensor x has data_offsets \[0, 16\], which do not hold its shape",
        setup=hf_dir(LLAMA, {"model.safetensors": _header({"x": {"dtype": "F32", "shape": [4],
                                                                  "data_offsets": [0, 16]}}, bytes(8))})),
    Row("convert-tensor-wrong-shape", "convert_hf", ["import", "{scratch}/hf", "{scratch}/out"],
        r".*/hf/model.safetensors: model.layers.1.mlp.up_proj.weight has shape \[3, 3\], but config.json implies "
        r"\[64, 32\]", setup=hf_model(LLAMA, lambda t: t.update({"model.layers.1.mlp.up_proj.weight":
                                                                   t["lm_head.weight"][:3, :3]}))),
    Row("convert-fp8-scales-wrong-shape", "convert_hf", ["import", "{scratch}/hf", "{scratch}/out"],
        r".*/hf/model.safetensors: model.layers.0.mlp.up_proj.weight_scale_inv has shape \[5, 5\]",
        setup=hf_model(LLAMA, lambda t: t.update({
            "model.layers.0.mlp.up_proj.weight": t["model.layers.0.mlp.up_proj.weight"].astype("float8_e4m3fn"),
            "model.layers.0.mlp.up_proj.weight_scale_inv": t["lm_head.weight"][:5, :5]}))),
    Row("convert-index-shard-missing", "convert_hf", ["import", "{scratch}/hf", "{scratch}/out"],
        r".*/hf/model.safetensors.index.json names model-00002-of-00002.safetensors, which .*/hf does not hold",
        setup=hf_dir(LLAMA, {"model.safetensors.index.json": json.dumps(
            {"weight_map": {"x": "model-00001-of-00002.safetensors", "y": "model-00002-of-00002.safetensors"}}),
            "model-00001-of-00002.safetensors": _header({"x": {"dtype": "F32", "shape": [2],
                                                              "data_offsets": [0, 8]}}, bytes(8))})),
    Row("convert-index-entry-not-in-its-shard", "convert_hf", ["import", "{scratch}/hf", "{scratch}/out"],
        r".*/hf/model.safetensors.index.json maps y to model-00001-of-00001.safetensors, but no shard holds it",
        setup=hf_dir(LLAMA, {"model.safetensors.index.json": json.dumps(
            {"weight_map": {"x": "model-00001-of-00001.safetensors", "y": "model-00001-of-00001.safetensors"}}),
            "model-00001-of-00001.safetensors": _header({"x": {"dtype": "F32", "shape": [2],
                                                              "data_offsets": [0, 8]}}, bytes(8))})),
    Row("convert-model-type-unsupported", "convert_hf", ["import", "{scratch}/hf", "{scratch}/out"],
        r"model_type='gpt2' is not supported", setup=hf_dir({**LLAMA, "model_type": "gpt2"})),
    Row("convert-output-under-a-file", "convert_hf", ["import", "{scratch}/hf", "{scratch}/afile/out"],
        r"OUT .*/afile/out cannot be created: .*/afile is a file, not a directory",
        setup=lambda world, scratch: (a_file(world, scratch), hf_dir(LLAMA)(world, scratch))),
    Row("convert-fp8-weight-without-scale", "convert_hf", ["import", "{scratch}/hf", "{scratch}/out"],
        r".*/hf/model.safetensors: model.embed_tokens.weight is stored as float8_e4m3fn .*but has no scale \(expected "
        r"model.embed_tokens.weight_scale_inv beside it\)",
        setup=hf_dir({**LLAMA, "quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128]}},
                     {"model.safetensors": safetensors_bytes({"model.embed_tokens.weight": ("F8_E4M3", [512, 32],
                                                                                            b"\x40" * 512 * 32)})})),
    Row("convert-export-missing", "convert_hf", ["export", "{scratch}/none", "{scratch}/out"],
        r"'.*/none' does not exist"),
    Row("convert-export-bit-flipped", "convert_hf", ["export", "{scratch}/run/checkpoints/4", "{scratch}/out"],
        r"/checkpoints/4' is damaged: .*: its contents changed since it was saved", setup=flipped),
    Row("convert-export-peft-without-adapters", "convert_hf", ["export", "{run}", "{scratch}/out", "--peft",
                                                              "{scratch}/adapter"],
        r"the checkpoint .*/run/checkpoints/4 holds no LoRA adapters \(it was not trained with lora_rank > 0\)"),
    # inspect_checkpoint
    Row("inspect-no-path", K, [], r"usage: python -m maxtrain.inspect_checkpoint PATH"),
    Row("inspect-path-missing", K, ["{scratch}/none"], r"path='.*/none' does not exist"),
    Row("inspect-no-checkpoints", K, ["{scratch}/nothing"], r"'.*/nothing' holds no complete checkpoint",
        setup=empty_dir),
    Row("inspect-bit-flipped", K, ["{scratch}/run/checkpoints/4"],
        r"/checkpoints/4' is damaged: .*/state/.*: its contents changed since it was saved", setup=flipped),
    Row("inspect-truncated", K, ["{scratch}/run/checkpoints/4"],
        r"/checkpoints/4' is damaged: .* has \d+ bytes, but \d+ were saved", setup=truncated),
    Row("inspect-file-deleted", K, ["{scratch}/run/checkpoints/4"],
        r"/checkpoints/4' is damaged: .* is missing \(it was saved with this step\)", setup=deleted),
    Row("inspect-state-deleted", K, ["{scratch}/run/checkpoints/4"],
        r"/checkpoints/4' is damaged: .*/checkpoints/4/state is missing", setup=no_state),
    Row("inspect-run-with-damaged-newest", K, ["{scratch}/run"],
        r"latest usable step: 2", code=0, setup=flipped),
    Row("inspect-garbage-metadata", K, ["{scratch}/run/checkpoints/4"],
        r"/checkpoints/4' is damaged: .*/metadata/metadata (has \d+ bytes, but|: its contents changed)",
        setup=garbage_metadata),
    Row("inspect-garbage-array-metadata", K, ["{scratch}/run/checkpoints/4"],
        r"/checkpoints/4' is damaged: .*/state/_METADATA (has \d+ bytes, but|: its contents changed)",
        setup=garbage_array_metadata),
    Row("inspect-garbage-checksums", K, ["{scratch}/run/checkpoints/4"],
        r"/checkpoints/4' is damaged: .*/checksums/process_0.json: the checksum file itself cannot be read",
        setup=garbage_checksums),
]


def _other_tokenizer(world, scratch):
    """A second tokenizer (another vocabulary size) for the prepared directory's row."""
    from maxtrain.data import text_files, tokenizer_training  # pylint: disable=import-outside-toplevel

    texts = [t.upper() for t in text_files.read_texts(os.path.join(world.paths["data"], "good.jsonl"))]
    tokenizer_training.train("sentencepiece", texts, 500).write(os.path.join(scratch, "other.model"))


# --------------------------------------------------------------------------------------------
# Running a row and judging the answer
# --------------------------------------------------------------------------------------------


def argv_for(row: Row, world: World, scratch: str) -> list[str]:
    args = [world.fmt(a, scratch) for a in row.args]
    if row.tiny:  # the tiny model's settings, unless the row sets the same key itself
        given = {a.partition("=")[0] for a in args[1:]}
        extra = [a for a in TINY + [f"dataset_cache_dir={world.paths['cache']}"] if a.partition("=")[0] not in given]
        args = args[:1] + extra + args[1:]
    return args


def judge(row: Row, code: int, out: str, err: str) -> tuple[str, str]:
    """("clear" | "unclear" | "silent" | "traceback", the line judged)."""
    prog = TOOLS[row.tool][0]
    text = out + err
    if "Traceback (most recent call last)" in text or "Check failure stack trace" in text:
        return "traceback", text.strip().splitlines()[-1] if text.strip() else ""
    if row.code == 0:
        found = re.search(row.expect, text)
        return ("clear" if code == 0 and found else "silent" if code == 0 else "unclear"), (
            found.group(0) if found else (text.strip().splitlines() or [""])[-1])
    if code == 0:
        return "silent", (text.strip().splitlines() or [""])[-1]
    lines = err.strip().splitlines()
    errors = [line for line in lines if ": error: " in line and (prog.split(".")[-1] in line.split(": error: ")[0]
                                                                or line.startswith("maxtrain"))]
    line = errors[-1] if errors else (lines[-1] if lines else "")
    ok = code == row.code and len(errors) == 1 and re.search(row.expect, line)
    return ("clear" if ok else "unclear"), line


def kind(row: Row, code: int, out: str, err: str) -> str:
    """The answer's shape, whatever its wording: traceback | silent | one-line error | other."""
    text = out + err
    if "Traceback (most recent call last)" in text or "Check failure stack trace" in text:
        return "traceback"
    if row.code != 0:
        if code == 0:
            return "silent"
        errors = [line for line in err.strip().splitlines() if ": error: " in line]
        return "one-line error" if code == 2 and len(errors) == 1 else "other"
    return "said so" if code == 0 and re.search(row.expect, text) else "silent" if code == 0 else "other"


def run_subprocess(row: Row, world: World, scratch: str, python: str, repo: str,
                   timeout: float = 150) -> tuple[int, str, str]:
    """(exit status, stdout, stderr) of the row as a real command; a command still running after `timeout`
    seconds accepted the input and started work (it is stopped and counts as exit 0)."""
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=8 --xla_backend_optimization_level=0",
           "JAX_PLATFORMS": "cpu", "PYTHONUNBUFFERED": "1", "PYTHONPATH": repo}
    cmd = [python, *TOOLS[row.tool][1], *argv_for(row, world, scratch)]
    try:
        done = subprocess.run(cmd, cwd=repo, env=env, capture_output=True, text=True, timeout=timeout,
                              stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired as e:  # still working: the bad input was accepted (e.g. it trains)
        out = e.stdout.decode() if isinstance(e.stdout, bytes) else e.stdout or ""
        return 0, out + f"\n(still running after {timeout}s: stopped)", ""
    return done.returncode, done.stdout, done.stderr


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--python", default=sys.executable, help="the interpreter whose maxtrain is judged")
    parser.add_argument("--repo", default=REPO, help="the checkout to run the tools from")
    parser.add_argument("--work", default="/tmp/bad_inputs", help="scratch directory (emptied first)")
    parser.add_argument("--only", default="", help="regex of row ids to run")
    parser.add_argument("--json", default="", help="write the verdicts to this file")
    parser.add_argument("--timeout", type=float, default=150, help="seconds after which a row counts as accepted")
    parser.add_argument("--skip", default="", help="regex of row ids not to run")
    parser.add_argument("--reuse-world", action="store_true", help="keep the world of an earlier run in --work")
    args = parser.parse_args(argv)
    world_dir = os.path.join(args.work, "world")
    if args.reuse_world and os.path.isdir(os.path.join(world_dir, "run")):
        world = World(world_dir)
        world.paths["base"] = os.path.join(args.repo, "configs", "base.yml")
        shutil.rmtree(os.path.join(args.work, "rows"), ignore_errors=True)
    else:
        shutil.rmtree(args.work, ignore_errors=True)
        world = build_world(world_dir, args.python, args.repo)
    before = tree_hash(world.root)
    verdicts, counts, shapes = {}, {}, {}
    for row in ROWS:
        if (args.only and not re.search(args.only, row.id)) or (args.skip and re.search(args.skip, row.id)):
            continue
        scratch = os.path.join(args.work, "rows", row.id)
        os.makedirs(scratch)
        if row.setup:
            row.setup(world, scratch)
        code, out, err = run_subprocess(row, world, scratch, args.python, args.repo, args.timeout)
        verdict, line = judge(row, code, out, err)
        shape = kind(row, code, out, err)
        if tree_hash(world.root) != before:
            verdict = shape = "changed the world"
            before = tree_hash(world.root)
        counts[verdict] = counts.get(verdict, 0) + 1
        shapes[shape] = shapes.get(shape, 0) + 1
        verdicts[row.id] = {"tool": row.tool, "verdict": verdict, "kind": shape, "exit": code, "line": line}
        print(f"{verdict:<10} {shape:<15} exit {code:<3} {row.tool:<15} {row.id:<38} {line[:200]}", flush=True)
    print(f"{len(verdicts)} rows, as the table expects: " + ", ".join(f"{v} {n}" for v, n in sorted(counts.items())))
    print(f"{len(verdicts)} rows, by the answer's shape: " + ", ".join(f"{v} {n}" for v, n in sorted(shapes.items())))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"counts": counts, "shapes": shapes, "rows": verdicts}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
