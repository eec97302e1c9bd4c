"""The model families, one module each, named by config/registry.py: `FAMILIES["llama"]` is llama.py's MODEL.

A family module holds what is particular to one family and nothing else: its parameter declarations
(`param_specs`), its layer composition (`layer_types`, `layer`), its Hugging Face name mapping
(`HF_NAMES`, `from_hf_config`, `to_hf_config`) and its FLOPs per token, and ends by writing them into
its `MODEL`, a models/contract.FamilyModel (the one type the rest of maxtrain sees). Its registry row
(`FAMILY`) gives its decoder_block name, Hugging Face model_type and architecture, its settings and rules.
A family module never imports another: what families share lives in models/ (standard_layers, blocks,
moe, mla, hf); tests/house/test_house.py checks it.

Adding a family: a row in maxtrain/config/registry.py, a module here ending in its MODEL, presets in
configs/models/ and a parity test against transformers (tests/models/test_families.py).
"""

from __future__ import annotations

import importlib

from maxtrain.config import registry
from maxtrain.models.contract import FamilyModel

# Imported by name from the registry, so that the registry stays the one list of families.
FAMILIES: dict[str, FamilyModel] = {name: importlib.import_module(f"{__name__}.{name}").MODEL for name in registry.FAMILIES}
