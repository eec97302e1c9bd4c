"""On-policy distillation (objective=distill_on_policy): the per-token reverse KL and its gradients equal TRL 1.16's
(DistillationTrainer's loss at beta=1 and GKDTrainer.generalized_jsd_loss at beta=1) on completions the student
sampled, with the student and the teacher exported to Hugging Face by maxtrain's exporter; and a tiny run through
train.main whose reverse KL falls. The TRL comparison skips, saying why, without torch, transformers or trl."""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import BASE_YML, TINY
from maxtrain import config as config_lib
from maxtrain import train
from maxtrain.checkpointing import convert, safetensors_files
from maxtrain.data import prompts as prompts_lib
from maxtrain.models import distill, model_keys, sampling
from maxtrain.models.model import Model
from maxtrain.models.runtime import Runtime
from maxtrain.training import grpo, losses, on_policy
from post_helpers import compose, grpo_args, make_dataset, sft_args

TEACHER = ["base_emb_dim=48", "base_num_decoder_layers=3", "base_mlp_dim=96", "head_dim=12"]  # wider, deeper
TEMPERATURE = 0.7
VOCAB = 64
STOP = 2  # the stop token: completions of different lengths


def _numpy_reverse_kl(s, u, w, temp):
    """(sum of w x KL(softmax(s/T) || softmax(u/T)), d/ds) in float64."""
    s, u, w = (np.asarray(a, np.float64) for a in (s, u, w))

    def log_softmax(x):
        x = x - x.max(-1, keepdims=True)
        return x - np.log(np.exp(x).sum(-1, keepdims=True))
    log_q, log_p = log_softmax(s / temp), log_softmax(u / temp)
    q = np.exp(log_q)
    kl = (q * (log_q - log_p)).sum(-1)
    # d KL / d s_j = q_j (log q_j - log p_j - KL) / T
    grad = w[..., None] * q * (log_q - log_p - kl[..., None]) / temp
    return (kl * w).sum(), grad


def test_reverse_terms_equal_the_formula_and_the_teacher_gets_no_gradient():
    rng = np.random.default_rng(0)
    s, u = (rng.normal(0, 2, (2, 5, 11)).astype(np.float32) for _ in range(2))
    w = (rng.random((2, 5)) > 0.3).astype(np.float32)
    targets = np.zeros((2, 5), np.int32)

    def loss(s, u):
        return distill.reverse_terms(s, u, targets, w, 1.7)[0]

    kl, (ds, du) = jax.value_and_grad(loss, argnums=(0, 1))(s, u)
    want, want_grad = _numpy_reverse_kl(s, u, w, 1.7)
    np.testing.assert_allclose(float(kl), want, rtol=1e-5)
    np.testing.assert_allclose(ds, want_grad, rtol=1e-4, atol=1e-6)
    assert not np.any(du)


def _config(*extra):
    return config_lib.with_devices(config_lib.load_config(compose(
        BASE_YML, *TINY, f"vocab_size={VOCAB}", "decode_sampling_strategy=weighted",
        f"decode_sampling_temperature={TEMPERATURE}", *extra)), 1)


def _random_params(config, seed):
    """Params drawn at 0.3 x N(0, 1): two models whose next-token distributions differ clearly."""
    rng = np.random.default_rng(seed)
    return jax.tree.map(lambda s: (0.3 * rng.normal(size=s.shape)).astype(np.float32),
                        Model.bind(config).param_specs, is_leaf=lambda x: hasattr(x, "axes"))


def _to_hf(tmp_path, name, config, params):
    """A Hugging Face directory of the params, written by maxtrain's exporter (checkpointing/convert.py), loaded."""
    torch, transformers = pytest.importorskip("torch"), pytest.importorskip("transformers")
    keys = {k: getattr(config, k) for k in model_keys.MODEL_KEYS}
    out = tmp_path / name
    out.mkdir()
    safetensors_files.write(str(out / "model.safetensors"), convert.to_hf(params, keys, np.float32))
    (out / "config.json").write_text(json.dumps(convert.hf_config(keys, None, "float32")))
    return transformers.AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval(), keys


def _sampled_batch(config, params):
    """4 completions the student sampled (the rollout's sampler at TEMPERATURE), in 2 micro-batches of 2 rows."""
    prompts = [np.array(p, np.int32) for p in ([1, 5, 9, 12, 7], [1, 30], [1, 4, 4], [1, 8, 3, 11])]
    ids, first = grpo.left_padded([prompts_lib.Prompt(p, "", "") for p in prompts], 6)
    tokens = jax.device_get(sampling.sample_completions(
        params, ids, first, jax.random.key(3), model=Model.bind(config), rt=Runtime.from_config(config, "cpu"),
        max_new_tokens=10, **sampling.sampling_settings(config))[0])
    kept, _ = grpo.cut(tokens, (STOP,))
    return prompts, tokens, kept, on_policy.update_batch(prompts, tokens, kept, 16, (2, 2))


@pytest.mark.slow
def test_loss_and_gradients_equal_trls_on_the_students_samples(tmp_path):
    """maxtrain's objective over 2 micro-batches (summed and divided as the train step does) against TRL's
    DistillationTrainer loss (_chunked_divergence_loss, beta=1, num_items_in_batch = the completion tokens) and
    GKDTrainer.generalized_jsd_loss (beta=1) on the exported models' logits: the loss, the gradient in the student's
    logits and in every student parameter (mapped to Hugging Face names by the exporter), to 1e-5."""
    torch = pytest.importorskip("torch", reason="TRL's loss needs torch (the [hf] extra)")
    pytest.importorskip("transformers", reason="the exported models are loaded with transformers (the [hf] extra)")
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    gkd = pytest.importorskip("trl.experimental.gkd", reason="trl is not installed")
    trl_distillation = pytest.importorskip("trl.trainer.distillation_trainer", reason="trl is not installed")

    student_config = _config("objective=distill_on_policy", "distill_teacher_path=unused", "dataset_type=jsonl",
                             "grain_train_files=x.jsonl", "train_data_columns=[prompt]", "max_target_length=16",
                             "max_prefill_predict_length=6")
    teacher_config = _config(*TEACHER)
    params, teacher_params = _random_params(student_config, 0), _random_params(teacher_config, 1)
    prompts, tokens, kept, batch = _sampled_batch(student_config, params)
    assert len(set(kept.tolist())) > 1  # completions of different lengths (cut at their stop token)

    # maxtrain: the objective as losses.make gives it to the train step, summed over the micro-batches
    rt = Runtime.from_config(student_config, "cpu")
    student, teacher = Model.bind(student_config), Model.bind(teacher_config)
    objective = lambda p, b: losses.distill_on_policy(p, b, teacher_params, student, teacher, rt)  # noqa: E731

    def mean_loss(p):
        sums = [objective(p, {k: jnp.asarray(v[i]) for k, v in batch.items()})[:2] for i in range(2)]
        return sum(s[0] for s in sums) / sum(s[1] for s in sums)

    loss, grads = jax.jit(jax.value_and_grad(mean_loss))(params)
    tokens_total = int(batch["loss_weights"].sum())
    assert tokens_total == int(kept.sum())

    # TRL, on the same sequences through the exported models
    hf_student, keys = _to_hf(tmp_path, "student", student_config, params)
    hf_teacher, _ = _to_hf(tmp_path, "teacher", teacher_config, teacher_params)
    trl_loss, student_logits, teacher_logits = 0.0, [], []
    for prompt, row, k in zip(prompts, tokens, kept):
        seq = torch.tensor(np.concatenate([prompt, row[:k]])[None].astype(np.int64))
        where = slice(len(prompt) - 1, len(prompt) + int(k) - 1)  # the positions predicting the completion
        h_s = hf_student.model(input_ids=seq).last_hidden_state[:, where]
        with torch.no_grad():
            h_t = hf_teacher.model(input_ids=seq).last_hidden_state[:, where]
        row_loss, _, _ = trl_distillation._chunked_divergence_loss(  # pylint: disable=protected-access
            h_s, h_t, hf_student.lm_head.weight, hf_teacher.lm_head.weight, torch.ones(h_s.shape[:2]), beta=1.0,
            num_items_in_batch=tokens_total, temperature=TEMPERATURE)
        trl_loss = trl_loss + row_loss
        student_logits.append(hf_student(input_ids=seq).logits[0, where].detach())
        with torch.no_grad():
            teacher_logits.append(hf_teacher(input_ids=seq).logits[0, where])
    trl_loss.backward()
    assert float(loss) > 0.05  # the two models' distributions differ: a comparison that can fail
    np.testing.assert_allclose(float(loss), float(trl_loss.detach()), rtol=1e-5)
    hf_grads = {name: p.grad.numpy() for name, p in hf_student.named_parameters() if p.grad is not None}
    ours = convert.to_hf(jax.device_get(grads), keys, np.float32)  # the exporter's map, linear: gradients map alike
    assert set(hf_grads) == set(ours)
    for name, g in hf_grads.items():
        scale = max(np.abs(g).max(), 1e-30)
        np.testing.assert_allclose(ours[name] / scale, g / scale, atol=1e-5, err_msg=name)

    # GKD's generalized JSD at beta=1 (= reverse KL) on the logits, mean over the completion tokens
    s = torch.cat(student_logits)[None].requires_grad_(True)
    u = torch.cat(teacher_logits)[None]
    gkd_loss = gkd.GKDTrainer.generalized_jsd_loss(s, u, labels=torch.zeros(s.shape[:2], dtype=torch.long), beta=1.0,
                                                   temperature=TEMPERATURE, reduction="batchmean")
    gkd_loss.backward()
    ours_logits = jnp.asarray(s.detach().numpy())

    def on_logits(x):
        return distill.reverse_terms(x, jnp.asarray(u.numpy()), None, jnp.ones(x.shape[:2]), TEMPERATURE)[0] / tokens_total

    value, dlogits = jax.value_and_grad(on_logits)(ours_logits)
    np.testing.assert_allclose([float(value), float(loss)], [float(gkd_loss)] * 2, rtol=1e-5)
    g = s.grad.numpy()
    np.testing.assert_allclose(np.asarray(dlogits) / np.abs(g).max(), g / np.abs(g).max(), atol=1e-5)


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    directory = tmp_path_factory.mktemp("opd")
    paths = make_dataset(str(directory), n=64)
    paths["dir"] = str(directory)
    return paths


@pytest.mark.slow
def test_a_tiny_run_brings_the_reverse_kl_down(dataset, tmp_path):
    """A teacher fine-tuned 10 steps on the sums; a random student distilled on-policy for 8 steps through
    train.main: the reverse KL of its own samples (learning/loss) and of its greedy held-out answers fall."""
    out = str(tmp_path)
    train.main(compose(BASE_YML, *TINY, *TEACHER, *sft_args(dataset), f"base_output_directory={out}",
                       "run_name=teacher", "steps=10", "learning_rate=1e-2", "eval_interval=-1",
                       "max_target_length=24"))
    args = [a for a in grpo_args(dataset, dataset["dir"]) if not a.startswith("objective=")]
    result = train.main(compose(BASE_YML, *TINY, *args, "objective=distill_on_policy",
                                f"distill_teacher_path={out}/teacher", f"base_output_directory={out}", "run_name=opd",
                                "steps=8", "learning_rate=1e-2", "eval_interval=4", "enable_checkpointing=false",
                                f"metrics_file={out}/opd.jsonl"))
    logged = [json.loads(line) for line in open(f"{out}/opd.jsonl", encoding="utf-8")]
    kl = [m["learning/loss"] for m in logged if "learning/loss" in m]
    assert len(kl) == 8 and all(np.isfinite(kl))
    assert [m["learning/distill_reverse_kl"] for m in logged if "learning/loss" in m] == kl  # the loss is the KL
    assert max(kl[-2:]) < 0.5 * kl[0], kl
    held_out = [result.eval_metrics[s]["distill_reverse_kl"] for s in (0, 4, 8)]
    assert held_out[2] < held_out[0], held_out
    assert "teacher" in result.state and "reference" not in result.state
