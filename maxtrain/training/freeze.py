"""Which weights of an image-and-text model do not train (vision_freeze): its tower, its projector (the weights that
map the tower's features into the language model's width: contract.Vision.projector), its language model (the rest).

    part(path, model)               "tower" | "projector" | "language_model": the part a parameter path belongs to
    labels(params, model)           the same tree of "train" / "frozen" (the optimizer's optax.multi_transform:
                                    a frozen weight gets no update, no weight decay and no optimizer state)
    stop_gradients(params, config, model)
                                    params with the frozen weights under stop_gradient, inside the loss: the backward
                                    then computes no gradient for them, and none at all through a tower whose weights
                                    are all frozen (its input is pixels), the saving a frozen tower is for
    counts(params, config, model)   (trainable, frozen) sizes, for the start-up summary

vision_freeze is checked before anything is built (config/vision_checks.py): distinct parts, not all three, and with
LoRA (which trains adapters of the language model alone, the tower and projector frozen) nothing else.
"""

from __future__ import annotations

import jax

from maxtrain.errors import ConfigError


def part(path: tuple, model) -> str:
    """The part of the model the parameter at `path` (dict keys) belongs to."""
    if not path or path[0] != "vision":
        return "language_model"
    projector = model.family.vision.projector
    if not projector:
        raise ConfigError(f"vision_freeze: the {model.config.decoder_block} family does not say which of its tower's "
                          "weights are the projector (contract.Vision.projector); set vision_freeze=[]")
    return "projector" if len(path) > 1 and path[1] in projector else "tower"


def _keys(path) -> tuple:
    return tuple(getattr(entry, "key", entry) for entry in path)


def frozen_tree(params, config, model):
    """The tree of params with True where the weight is frozen by vision_freeze."""
    parts = set(config.vision_freeze)
    return jax.tree_util.tree_map_with_path(lambda path, _: part(_keys(path), model) in parts, params)


def labels(params, config, model):
    return jax.tree.map(lambda f: "frozen" if f else "train", frozen_tree(params, config, model))


def stop_gradients(params, config, model):
    if not config.vision_freeze:
        return params
    return jax.tree.map(lambda p, f: jax.lax.stop_gradient(p) if f else p, params, frozen_tree(params, config, model))


def counts(params, config, model) -> tuple[int, int]:
    """(weights that train, weights vision_freeze freezes) among params."""
    sizes = jax.tree.leaves(jax.tree.map(lambda p, f: (0, p.size) if f else (p.size, 0), params,
                                         frozen_tree(params, config, model)), is_leaf=lambda x: isinstance(x, tuple))
    return sum(s[0] for s in sizes), sum(s[1] for s in sizes)
