"""GRPO's loss variants against TRL 1.16's GRPOTrainer, through maxtrain's real train step.

The same tiny Llama on both sides: maxtrain's params exported with maxtrain's converter (checkpointing/convert.py's
to_hf and hf_config) and loaded by transformers; so is a reference model (the params moved a little), which TRL
builds as it does for grpo_beta > 0. The same records: 4 completions of 5-token prompts, of 3 to 12 tokens (padding
after them), advantages of both signs, old log-probabilities moved away from the current ones (rows above and below
the clip range, so the ratio, its clipping and cispo's cap matter). TRL's `_compute_loss` is called on each of the 2
micro-batches as its training loop calls it (training mode, 2 gradient-accumulation steps, the step's token count as
num_items_in_batch), with the gradients of both summed; maxtrain runs its jitted train step with
gradient_accumulation_steps=2 and an optax transformation that keeps the gradients it is given (so the step's own
gradients are compared, not an update made from them). Equal to 1e-5 (float32): the step's loss, the per-token
log-probabilities, the loss masks and every weight's gradient; and TRL's logged metrics against the objective's, per
micro-batch. Cases: every grpo_loss_type at both importance-sampling levels (TRL warns of, and runs, the sequence
level under the token-summing losses), clip-higher, the KL's bias correction, and no KL term at all.
"""

import json

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from conftest import BASE_YML, TINY, slow_params
from maxtrain import config as config_lib
from maxtrain.checkpointing import convert, safetensors_files
from maxtrain.models import model_keys
from maxtrain.models.model import Model
from maxtrain.models.runtime import Runtime
from maxtrain.training import grpo, losses, train_step
from post_helpers import compose

torch = pytest.importorskip("torch", reason="the [hf] extra (torch, transformers, trl) is not installed")
transformers = pytest.importorskip("transformers", reason="the [hf] extra (torch, transformers, trl) is not installed")
trl = pytest.importorskip("trl", reason="the [hf] extra (trl==1.16.0) is not installed")
datasets = pytest.importorskip("datasets", reason="trl's dependency datasets is not installed")
tokenizers = pytest.importorskip("tokenizers", reason="the [hf] extra (transformers' tokenizers) is not installed")

PROMPT, KEPT = 5, np.array([7, 3, 12, 9])                 # prompt tokens; each completion's tokens
ADVANTAGES = np.array([1.0, -0.7, 0.5, -1.2], np.float32)
SHIFT = np.array([-0.35, 0.3, 0.05, 0.28], np.float32)    # log pi_old - log pi per row: clipped high, low, inside
MICRO, STEPS = 2, 2                                       # rows per micro-batch, gradient-accumulation steps
PREFILL = 8                                               # max_prefill_predict_length: completions of <= 24 tokens

# id: (grpo_loss_type, importance-sampling level, beta, epsilon_high (-1: unset), KL bias correction)
CASES = {
    "grpo-sequence-clip-higher-kl-bias": ("grpo", "sequence", 0.04, 0.28, True),
    "dapo-token": ("dapo", "token", 0.04, -1.0, False),
    "dapo-sequence": ("dapo", "sequence", 0.04, -1.0, False),
    "grpo-token": ("grpo", "token", 0.04, -1.0, False),
    "grpo-sequence": ("grpo", "sequence", 0.04, -1.0, False),
    "bnpo-token": ("bnpo", "token", 0.04, -1.0, False),
    "bnpo-sequence": ("bnpo", "sequence", 0.04, -1.0, False),
    "dr_grpo-token": ("dr_grpo", "token", 0.04, -1.0, False),
    "dr_grpo-sequence": ("dr_grpo", "sequence", 0.04, -1.0, False),
    "cispo-token": ("cispo", "token", 0.04, 1.1, False),
    "cispo-sequence": ("cispo", "sequence", 0.04, 1.1, False),
    "dapo-clip-higher": ("dapo", "token", 0.04, 0.28, False),
    "dapo-token-kl-bias": ("dapo", "token", 0.04, -1.0, True),
    "cispo-token-kl-bias": ("cispo", "token", 0.04, 1.1, True),
    "grpo-token-no-kl": ("grpo", "token", 0.0, -1.0, False),
}
DEFAULT_RUN = {"grpo-sequence-clip-higher-kl-bias"}  # the other cases are marked slow


def _config(tmp_path, loss_type="dapo", level="token", beta=0.04, epsilon_high=-1.0, bias=False):
    args = [*TINY, "per_device_batch_size=2", f"gradient_accumulation_steps={STEPS}", "num_generations=2",
            "objective=grpo", "train_data_columns=[prompt,answer]", "dataset_type=jsonl", "grain_train_files=x.jsonl",
            "decode_sampling_strategy=weighted", f"max_prefill_predict_length={PREFILL}", f"grpo_beta={beta}",
            f"grpo_loss_type={loss_type}", f"grpo_importance_sampling_level={level}",
            f"grpo_epsilon_high={epsilon_high}", f"grpo_kl_bias_correction={str(bias).lower()}",
            f"base_output_directory={tmp_path}"]
    return config_lib.with_devices(config_lib.load_config(compose(BASE_YML, *args)), 1)


def _export(params, config, directory) -> str:
    """A Hugging Face directory of `params`, written by maxtrain's converter."""
    keys = {k: getattr(config, k) for k in model_keys.MODEL_KEYS}
    directory.mkdir()
    safetensors_files.write(str(directory / "model.safetensors"), convert.to_hf(params, keys, np.float32))
    (directory / "config.json").write_text(json.dumps(convert.hf_config(keys, None, "float32")))
    return str(directory)


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """The weights (policy and reference, in maxtrain and exported), the records and the update batch [2, 2, T]."""
    tmp = tmp_path_factory.mktemp("grpo_trl")
    config = _config(tmp)
    model, rt = Model.bind(config), Runtime.from_config(config, "cpu")
    params = model.init_params(jax.random.key(0))
    reference = jax.tree.map(lambda p, k: p + 0.02 * jax.random.normal(k, p.shape, p.dtype), params,
                             jax.tree.unflatten(jax.tree.structure(params),
                                                list(jax.random.split(jax.random.key(1), len(jax.tree.leaves(params))))))
    rng = np.random.default_rng(0)
    n, width = len(KEPT), int(KEPT.max())
    prompts = [rng.integers(2, config.vocab_size, PROMPT).astype(np.int32) for _ in range(n)]
    tokens = rng.integers(2, config.vocab_size, (n, width)).astype(np.int32)
    tokens[np.arange(width)[None, :] >= KEPT[:, None]] = 0  # padding after each completion
    shape = (STEPS, MICRO)
    # the current log-probabilities, then pi_old moved per row (and per token) away from them
    current = grpo.assemble(prompts, tokens, np.zeros((n, width), np.float32), KEPT, ADVANTAGES,
                            config.max_target_length, shape)
    flat = {k: jnp.asarray(v.reshape((n,) + v.shape[2:])) for k, v in current.items()}
    log_probs = np.asarray(jax.jit(lambda p, b: losses.target_log_probs(p, b, model, rt)[0])(params, flat))
    mask = np.asarray(flat["loss_weights"]) > 0
    completion_lp = np.stack([log_probs[i][mask[i]].tolist() + [0.0] * (width - KEPT[i]) for i in range(n)])
    old = (completion_lp + SHIFT[:, None] + rng.normal(0, 0.1, (n, width))).astype(np.float32)
    old[np.arange(width)[None, :] >= KEPT[:, None]] = 0.0
    batch = grpo.assemble(prompts, tokens, old, KEPT, ADVANTAGES, config.max_target_length, shape)
    return {"params": params, "reference": reference, "prompts": np.stack(prompts), "tokens": tokens, "old": old,
            "log_probs": log_probs.reshape((STEPS, MICRO, -1)),
            "batch": batch, "policy_dir": _export(params, config, tmp / "policy"),
            "reference_dir": _export(reference, config, tmp / "reference"), "tmp": tmp}


class _Keep:
    """An optax transformation that keeps the gradients it is given in its state (and updates nothing)."""

    @staticmethod
    def make():
        return optax.GradientTransformation(lambda p: jax.tree.map(jnp.zeros_like, p),
                                            lambda g, state, p=None: (jax.tree.map(jnp.zeros_like, g), g))


def _maxtrain(world, config):
    """(step loss, gradients, metrics) of maxtrain's real train step."""
    model, rt = Model.bind(config), Runtime.from_config(config, "cpu")
    tx = _Keep.make()
    state = train_step.init_state(config, model, rt, tx, jax.random.key(2))
    state["params"] = world["params"]
    if "reference" in state:
        state["reference"] = world["reference"]
    batch = {k: jnp.asarray(v) for k, v in world["batch"].items()}
    new_state, out = jax.jit(train_step.make_train_step(config, model, rt, tx))(state, batch)
    return float(out["loss"]), new_state["opt_state"], out


def _trl(world, config, tmp, loss_type, level, beta, epsilon_high, bias):
    """(step loss, {HF name: gradient}, per-micro-batch (log-probs, completion mask, metrics)) of TRL's GRPOTrainer."""
    policy = transformers.AutoModelForCausalLM.from_pretrained(world["policy_dir"], dtype=torch.float32)
    policy.config._name_or_path = world["reference_dir"]  # TRL builds its reference model from this path (beta > 0)
    vocab = {f"t{i}": i for i in range(config.vocab_size)}
    tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, "t1")),
        pad_token="t0", eos_token="t1")
    args = trl.GRPOConfig(output_dir=str(tmp / "trl"), report_to="none", use_cpu=True, per_device_train_batch_size=MICRO,
                          gradient_accumulation_steps=STEPS, num_generations=2,
                          max_completion_length=grpo.completion_length(config), loss_type=loss_type,
                          importance_sampling_level=level, beta=beta, epsilon=config.grpo_epsilon,
                          epsilon_high=None if epsilon_high < 0 else epsilon_high, use_bias_correction_kl=bias,
                          temperature=1.0, bf16=False, logging_steps=1)
    dataset = datasets.Dataset.from_dict({"prompt": ["t2 t3"] * 4})
    trainer = trl.GRPOTrainer(model=policy, reward_funcs=lambda completions, **kw: [0.0] * len(completions),
                              args=args, train_dataset=dataset, processing_class=tokenizer)
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = STEPS
    width = world["tokens"].shape[1]
    completion_mask = torch.tensor((np.arange(width)[None, :] < KEPT[:, None]).astype(np.int64))
    prompt_ids, completion_ids = torch.tensor(world["prompts"]), torch.tensor(world["tokens"])
    loss_total, out = 0.0, []
    trainer.model.zero_grad()
    for i in range(STEPS):
        rows = slice(i * MICRO, (i + 1) * MICRO)
        inputs = {"prompt_ids": prompt_ids[rows], "prompt_mask": torch.ones_like(prompt_ids[rows]),
                  "completion_ids": completion_ids[rows], "completion_mask": completion_mask[rows],
                  "advantages": torch.tensor(ADVANTAGES[rows]), "old_per_token_logps": torch.tensor(world["old"][rows]),
                  "num_items_in_batch": completion_mask.sum()}
        input_ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], dim=1)
        attention = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1)
        if beta:  # as _generate_and_score_completions computes them
            with torch.no_grad():
                inputs["ref_per_token_logps"] = trainer._get_per_token_logps_and_entropies(
                    trainer.ref_model, input_ids, attention, width)[0]
        with torch.no_grad():
            log_probs = trainer._get_per_token_logps_and_entropies(trainer.model, input_ids, attention, width)[0]
        before = {k: len(v) for k, v in trainer._metrics["train"].items()}
        loss = trainer._compute_loss(trainer.model, inputs)
        loss.backward()
        loss_total += float(loss.detach())
        logged = {k: v[-1] for k, v in trainer._metrics["train"].items() if len(v) > before.get(k, 0)}
        out.append((log_probs.numpy(), inputs["completion_mask"].numpy(), logged))
    grads = {name: p.grad.numpy() for name, p in trainer.model.named_parameters()}
    return loss_total, grads, out


TRL_METRICS = {"clip_ratio/region_mean": "grpo_clip_fraction", "clip_ratio/low_mean": "grpo_clip_ratio_low",
               "clip_ratio/high_mean": "grpo_clip_ratio_high", "cispo_clip_ratio": "grpo_cispo_clip_ratio",
               "kl": "grpo_kl"}


def _weight(loss_type, weights):
    """A micro-batch's weight in the train step (policy_losses.normalised): its tokens, rows, or 1."""
    rows = weights.shape[0]
    return {"dapo": weights.sum(), "cispo": weights.sum(), "grpo": rows, "bnpo": 1.0,
            "dr_grpo": rows}[loss_type]  # dr_grpo's rows x completion length, up to the constant


@pytest.mark.parametrize("case", slow_params(CASES, set(CASES) - DEFAULT_RUN))
def test_the_loss_variants_equal_trl(world, tmp_path, case):
    loss_type, level, beta, epsilon_high, bias = CASES[case]
    config = _config(tmp_path, loss_type, level, beta, epsilon_high, bias)
    ours_loss, ours_grads, ours_metrics = _maxtrain(world, config)
    theirs_loss, theirs_grads, theirs_micro = _trl(world, config, tmp_path, loss_type, level, beta, epsilon_high, bias)

    np.testing.assert_allclose(ours_loss, theirs_loss, rtol=1e-5, atol=1e-6)
    weights = world["batch"]["loss_weights"]
    for i, (their_lp, their_mask, _) in enumerate(theirs_micro):
        mask = weights[i] > 0
        assert mask.sum(axis=1).tolist() == their_mask.sum(axis=1).tolist()  # the same tokens count, in order
        for row in range(MICRO):
            np.testing.assert_allclose(world["log_probs"][i, row][mask[row]], their_lp[row][their_mask[row] > 0],
                                       rtol=1e-5, atol=1e-5)
    # TRL logs each micro-batch's metric; the train step averages them by the micro-batches' weights
    micro_weights = np.array([_weight(loss_type, weights[i]) for i in range(STEPS)])
    clipped = []
    for theirs_name, ours_name in TRL_METRICS.items():
        values = [logged[theirs_name] for _, _, logged in theirs_micro if theirs_name in logged]
        if values:
            np.testing.assert_allclose(float(ours_metrics[f"aux/{ours_name}"]), np.average(values, weights=micro_weights),
                                       rtol=1e-5, atol=1e-6, err_msg=theirs_name)
            clipped += values if "clip" in theirs_name else []
    assert max(clipped) > 0  # the records reach the clip range (or cispo's cap)
    keys = {k: getattr(config, k) for k in model_keys.MODEL_KEYS}
    ours_hf = convert.to_hf(jax.device_get(ours_grads), keys, np.float32)
    assert set(ours_hf) == set(theirs_grads)
    for name, g in theirs_grads.items():
        np.testing.assert_allclose(ours_hf[name], g, rtol=1e-5, atol=1e-5, err_msg=name)
    assert max(np.abs(g).max() for g in theirs_grads.values()) > 1e-3  # gradients that can differ
