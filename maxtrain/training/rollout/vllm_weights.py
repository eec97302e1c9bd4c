"""What runs inside vLLM's worker processes for the vLLM engine (vllm_engine.py): weights loaded by their Hugging Face
names. vLLM mixes `WeightLoader` into its worker class (the engine's `worker_extension_cls`, named by its dotted path,
as RL frameworks extend it) and `LLM.collective_rpc("maxtrain_load_weights", ...)` calls it there.

This module imports only numpy and torch (vLLM's own): the worker processes import it and nothing else of maxtrain.
"""

from __future__ import annotations

import warnings

import numpy as np
import torch


class WeightLoader:
    """Methods added to vLLM's worker (`self` is the worker: `self.model_runner.model` its model)."""

    def maxtrain_load_weights(self, named: list) -> dict:
        """Loads [(hf_name, shape, float32 bytes), ...] (plain bytes: what vLLM's RPC carries unchanged) into the model through its own `load_weights` (which fuses q/k/v and
        gate/up as the family's loader does), one name at a time so that a name the model does not know is told
        apart from the rest. Returns {"unknown": names the model refused or skipped, "loaded": the model's own
        parameter names that were written, "params": all its parameter names}."""
        model = self.model_runner.model
        unknown, loaded = [], set()
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # torch.from_numpy of a read-only buffer (received bytes)
            for name, shape, data in named:
                tensor = torch.from_numpy(np.frombuffer(data, np.float32).reshape(shape))
                try:
                    written = model.load_weights([(name, tensor)])
                except (KeyError, ValueError, AttributeError):  # vLLM's loaders: "no module or parameter named ..."
                    unknown.append(name)
                    continue
                if written is not None and not written:  # skipped without a word: it would never be applied
                    unknown.append(name)
                loaded.update(written or ())
        return {"unknown": unknown, "loaded": sorted(loaded), "params": sorted(n for n, _ in model.named_parameters())}
