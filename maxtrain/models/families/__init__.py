"""The model families, one module each, named by config/registry.py: `FAMILIES["llama"]` is llama.py.

A family module holds what is particular to one family and nothing else: its parameter declarations
(`param_specs`), its layer composition (`layer_types`, `layer`), its Hugging Face name mapping
(`HF_NAMES`, `from_hf_config`, `to_hf_config`) and its FLOPs per token. Its registry row
(`FAMILY`) gives its decoder_block name, Hugging Face model_type and architecture.

Adding a family: a row in maxtrain/config/registry.py, a module here with the same names as
llama.py, presets in configs/models/ and a parity test against transformers (tests/test_families.py).
"""

from __future__ import annotations

import importlib

from maxtrain.config import registry

# Imported by name from the registry, so that the registry stays the one list of families.
FAMILIES = {name: importlib.import_module(f"{__name__}.{name}") for name in registry.FAMILIES}
