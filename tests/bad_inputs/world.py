"""The bad-input table's parts every tool's rows use: a row's type, the world rows start from (a trained
run, data, a tokenizer, a prepared directory, built once) and the setups that break something in a row's
own scratch directory. tests/bad_inputs/__init__.py says how the table runs."""

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

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

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


def write(path: str, data, mode: str = "w") -> str:
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
    write(os.path.join(p["data"], "good.jsonl"), "".join(json.dumps({"text": d}) + "\n" for d in docs))
    write(os.path.join(p["data"], "bad_json.jsonl"), "{not json\n" + json.dumps({"text": "fine"}) + "\n")
    write(os.path.join(p["data"], "nonstring.jsonl"), json.dumps({"text": 42}) + "\n")
    write(os.path.join(p["data"], "no_field.jsonl"), json.dumps({"body": "x"}) + "\n")
    write(os.path.join(p["data"], "bad_utf8.jsonl"), b'{"text": "caf\xe9"}\n', "wb")
    write(os.path.join(p["data"], "empty.jsonl"), "")
    write(os.path.join(p["data"], "not.parquet"), "this is text, not parquet\n")
    write(os.path.join(p["data"], "table.csv"), "text\nhello\n")
    write(os.path.join(p["data"], "chars.txt"), "".join(chr(c) for c in range(0x4E00, 0x4E00 + 400)))
    import pyarrow as pa  # pylint: disable=import-outside-toplevel
    import pyarrow.parquet as pq  # pylint: disable=import-outside-toplevel

    pq.write_table(pa.table({"body": docs[:5]}), os.path.join(p["data"], "no_text_column.parquet"))
    pq.write_table(pa.table({"text": list(range(5))}), os.path.join(p["data"], "int_column.parquet"))
    write(os.path.join(root, "garbage.model"), os.urandom(256), "wb")
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
    write(os.path.join(copy_run(world, scratch), "checkpoints", "4", "metadata", "metadata"), "{garbage")


def garbage_array_metadata(world, scratch):
    write(os.path.join(copy_run(world, scratch), "checkpoints", "4", "state", "_METADATA"), "{garbage")


def garbage_checksums(world, scratch):
    write(os.path.join(copy_run(world, scratch), "checkpoints", "4", "checksums", "process_0.json"), "[1")


def no_state(world, scratch):
    shutil.rmtree(os.path.join(copy_run(world, scratch), "checkpoints", "4", "state"))


def every_step_flipped(world, scratch):
    run = copy_run(world, scratch)
    for step in ("2", "4"):
        flip(array_file(os.path.join(run, "checkpoints", step)))


def empty_dir(world, scratch):
    os.makedirs(os.path.join(scratch, "nothing"), exist_ok=True)


def a_file(world, scratch):
    write(os.path.join(scratch, "afile"), "x")


def yaml_file(text: str):
    def setup(world, scratch):
        write(os.path.join(scratch, "my.yml"), text.format(base=world.paths["base"]))
    return setup


def hf_dir(config=None, files=None):
    """A Hugging Face directory with `config` as config.json (a dict, raw text, or None for none)."""
    def setup(world, scratch):
        d = os.path.join(scratch, "hf")
        os.makedirs(d, exist_ok=True)
        if isinstance(config, dict):
            write(os.path.join(d, "config.json"), json.dumps(config))
        elif config == "dir":
            os.makedirs(os.path.join(d, "config.json"))
        elif isinstance(config, str):
            write(os.path.join(d, "config.json"), config)
        for name, data in (files or {}).items():
            write(os.path.join(d, name), data, "wb" if isinstance(data, bytes) else "w")
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
        write(os.path.join(scratch, "rows.jsonl"), "".join(json.dumps(r) + "\n" for r in [*rows, *[good] * 4]))
    return setup


def header(entries: dict, data: bytes = b"") -> bytes:
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
            other_tokenizer(world, scratch)
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


def other_tokenizer(world, scratch):
    """A second tokenizer (another vocabulary size) for the prepared directory's row."""
    from maxtrain.data import text_files, tokenizer_training  # pylint: disable=import-outside-toplevel

    texts = [t.upper() for t in text_files.read_texts(os.path.join(world.paths["data"], "good.jsonl"))]
    tokenizer_training.train("sentencepiece", texts, 500).write(os.path.join(scratch, "other.model"))


# Shorthands of the rows
B = "{base}"
G4 = [B, "decoder_block=gemma4_text", "sliding_window_size=8"]  # a tiny Gemma 4 (four sliding-window layers)
T, D, R, K = "train", "decode", "viz", "inspect"
