"""What runs inside vLLM's worker processes for the vLLM engine (vllm_engine.py): weights loaded by their Hugging Face
names. vLLM mixes `WeightLoader` into its worker class (the engine's `worker_extension_cls`, named by its dotted path,
as RL frameworks extend it) and `LLM.collective_rpc("maxtrain_load_weights", ...)` calls it there.

This module imports only numpy, torch and vLLM: the worker processes import it and nothing else of maxtrain.
"""

from __future__ import annotations

import warnings

import numpy as np
import torch
from vllm.model_executor.model_loader.reload import finalize_layerwise_reload, initialize_layerwise_reload


class WeightLoader:
    """Methods added to vLLM's worker (`self` is the worker: `self.model_runner.model` its model)."""

    def maxtrain_load_weights(self, named: list) -> dict:
        """Loads [(hf_name, shape, float32 bytes), ...] (plain bytes: what vLLM's RPC carries unchanged) in place,
        as vLLM's own `reload_weights` does: the layers' load-time parameters restored, filled through the model's
        `load_weights` (which fuses q/k/v and gate/up as the family's loader does), then processed again into the
        kernels' layout (on CPU the linear layers' weights are repacked after loading). One name at a time, so that
        a name the model does not know is told apart from the rest. Returns {"unknown": names the model refused or
        skipped, "loaded": the model's own parameter names that were written, "params": all its parameter names}."""
        runner = self.model_runner
        model = runner.get_model()
        params = sorted(n for n, _ in model.named_parameters())
        unknown, loaded = [], set()
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # torch.from_numpy of a read-only buffer (received bytes)
            initialize_layerwise_reload(model)
            try:
                for name, shape, data in named:
                    tensor = torch.from_numpy(np.frombuffer(data, np.float32).reshape(shape))
                    try:
                        written = model.load_weights([(name, tensor)])
                    except (KeyError, ValueError, AttributeError):  # vLLM's loaders: "no module or parameter named"
                        unknown.append(name)
                        continue
                    if written is not None and not written:  # skipped without a word: it would never be applied
                        unknown.append(name)
                    loaded.update(written or ())
            finally:
                finalize_layerwise_reload(model, runner.vllm_config.model_config)
        return {"unknown": unknown, "loaded": sorted(loaded), "params": params}
