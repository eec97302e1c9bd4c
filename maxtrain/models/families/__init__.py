"""The model families, one folder each, named by config/registry.py: `FAMILIES["llama"]` is llama/'s MODEL.

A family's folder holds what is particular to it and nothing else. Its `__init__.py` is the family's module:
its parameter declarations (`param_specs`), its layer composition (`layer_types`, `layer`), its Hugging Face
name mapping (`HF_NAMES`, `from_hf_config`, `to_hf_config`) and its FLOPs per token, ending in its `MODEL`,
a models/contract.FamilyModel (the one type the rest of maxtrain sees). Beside it: what only it uses (its own
blocks, routers, Hugging Face layouts in `hf_layouts.py`). Its registry row (`FAMILY`) gives its decoder_block
name, Hugging Face model_type and architecture, its settings and rules. A family never imports another: what
families share lives in models/ (standard_layers, blocks, hf, attention/, moe/, recurrent/), and a shared
module one family alone imports moves into it; tests/house/test_house.py checks both.

Adding a family: a row in maxtrain/config/registry.py, a folder here whose __init__ ends in its MODEL (and its
line in pyproject.toml's packages), presets in configs/models/ and a parity test against transformers
(tests/models/test_families.py).
"""

from __future__ import annotations

import importlib

from maxtrain.config import registry
from maxtrain.models.contract import FamilyModel

# Imported by name from the registry, so that the registry stays the one list of families.
FAMILIES: dict[str, FamilyModel] = {name: importlib.import_module(f"{__name__}.{name}").MODEL for name in registry.FAMILIES}
