"""A LoRA checkpoint's adapters as a PEFT adapter directory, for transformers + peft.

    peft.write_peft(out_dir, adapters, saved_config)   # adapter_config.json + adapter_model.safetensors

PEFT's tensor names and layouts: `lora_A.weight` [r, in] and `lora_B.weight` [out, r] per layer and
projection (torch Linear), under `base_model.model.<the Hugging Face module name>`.
"""

from __future__ import annotations

import json
import os

import numpy as np

from maxtrain.models.model import Model
from maxtrain.checkpointing import convert, safetensors_files

# the PEFT / Hugging Face module name of each projection
HF_MODULES = {"wq": "q_proj", "wk": "k_proj", "wv": "v_proj", "wo": "o_proj", "w_gate": "gate_proj",
              "w_up": "up_proj", "w_down": "down_proj"}


def peft_tensors(adapters: dict, family, layer_types) -> dict[str, np.ndarray]:
    """PEFT's tensor names and layouts: lora_A.weight [r, in], lora_B.weight [out, r] (torch Linear)."""
    out = {}
    for kind, targets in adapters.get("layers", {}).items():
        indices = [i for i, t in enumerate(layer_types) if t.kind == kind]
        for pname, ab in targets.items():
            hf_name, _ = family.hf_names[f"layers/{kind}/{pname}"]
            module = hf_name.removesuffix(".weight")
            a, b = np.asarray(ab["a"], np.float32), np.asarray(ab["b"], np.float32)
            for j, i in enumerate(indices):
                prefix = "base_model.model." + module.format(i=i)
                out[prefix + ".lora_A.weight"] = np.ascontiguousarray(a[j].reshape(-1, a.shape[-1]).T)
                out[prefix + ".lora_B.weight"] = np.ascontiguousarray(b[j].reshape(b.shape[1], -1).T)
    return out


def write_peft(out_dir: str, adapters: dict, saved_config: dict, base_model: str = "") -> str:
    """Writes adapter_config.json and adapter_model.safetensors for peft.PeftModel.from_pretrained."""
    model = Model.bind(convert.spec_config(saved_config))
    tensors = peft_tensors(adapters, model.family, model.layer_types)
    modules = sorted({HF_MODULES[p] for targets in adapters.get("layers", {}).values() for p in targets})
    rank = saved_config["lora_rank"]
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": saved_config["lora_alpha"],
              "lora_dropout": 0.0, "bias": "none", "target_modules": modules, "fan_in_fan_out": False,
              "base_model_name_or_path": base_model, "inference_mode": True, "use_rslora": False,
              "init_lora_weights": True}
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "adapter_config.json"), "w") as f:
        json.dump(config, f, indent=2)
    safetensors_files.write(os.path.join(out_dir, "adapter_model.safetensors"), tensors, {"format": "pt"})
    return out_dir
