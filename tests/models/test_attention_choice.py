"""`attention=autoselected` on a GPU (models/attention/kernel_choice.py): what each implementation supports, the
fastest measured among those, the reason printed; tokamax (the optional [gpu] extra) checked on the CPU
through its XLA reference, and never imported by a run that does not ask for it."""

import dataclasses
import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest

from conftest import BASE_YML, TINY
from maxtrain.models.model import Model
from maxtrain.models.runtime import Runtime
from maxtrain.config import attention_speeds, load_config, with_overrides
from maxtrain.models import attention
from maxtrain.models.attention import kernel_choice, kernel_check

BF16 = jnp.bfloat16


def choose(**kwargs):
    kwargs.setdefault("dtype", BF16)
    return attention.resolve_implementation("autoselected", "gpu", with_reason=True, **kwargs)


@pytest.fixture
def without_tokamax(monkeypatch):
    monkeypatch.setattr(kernel_choice, "tokamax_installed", lambda: False)


def test_cudnn_is_chosen_where_it_was_measured_fastest(without_tokamax):
    """llama3.2-1b's shape (head_dim 64, GQA 4:1, 4096 tokens): cuDNN 272 against flash 76 TFLOP/s at 8k."""
    choice = choose(head_dim=64, length=4096, gqa=4, capability="9.0")
    assert choice.implementation == "cudnn"
    assert choice.reason.startswith("cudnn: fastest measured for head_dim 64 at 4096 tokens on sm90 (nearest row: "
                                    "head_dim 64 at 8192 tokens, cudnn 272, flash 76 TFLOP/s")
    assert choice.reason.count("tokamax is not installed (pip install 'maxtrain[gpu]')") == 1  # said once
    # MLA (DeepSeek): query/key 192 wide, values 128: padded to one width of 192, within cuDNN's 256
    assert choose(head_dim=192, v_head_dim=128, length=4096).implementation == "cudnn"


@pytest.mark.parametrize("kwargs, lacking", [
    ({"head_dim": 128, "logits_soft_cap": 50.0}, "cudnn does not implement logits_soft_cap=50.0"),  # Gemma 2
    ({"head_dim": 64, "sinks": True}, "cudnn does not implement sinks=True"),  # gpt-oss
    ({"head_dim": 128, "dtype": jnp.float32}, "cudnn needs dtype=bfloat16 or float16"),
    ({"head_dim": 12}, "cudnn needs head_dim to be a multiple of 8"),
    ({"head_dim": 256, "capability": "8.0"}, "at most 128 (256 from Hopper on, 128 before), got head_dim=256"),
])
def test_flash_where_cudnn_cannot_run_the_model(without_tokamax, kwargs, lacking):
    choice = choose(length=8192, **kwargs)
    assert choice.implementation == "flash" and lacking in choice.reason
    assert choice.reason.startswith("flash: the only kernel that supports this model (head_dim")


def test_a_faster_measured_tokamax_row_wins_and_unsupported_ones_are_passed_over(monkeypatch):
    monkeypatch.setattr(kernel_choice, "tokamax_installed", lambda: True)
    monkeypatch.setattr(kernel_choice, "tokamax_jax_mismatch", lambda: None)  # the kernel is not run here
    row = attention_speeds.Row("sm90", 128, 8192, (("tokamax", 400.0), ("cudnn", 349.3), ("flash", 201.2)),
                               "H100", "2026-12-01", "a test row")
    monkeypatch.setattr(attention_speeds, "MEASURED", (row,))
    choice = choose(head_dim=128, length=8192)
    assert choice.implementation == "tokamax" and "tokamax 400, cudnn 349, flash 201" in choice.reason
    # soft-caps: tokamax has them, cuDNN not
    assert choose(head_dim=128, length=8192, logits_soft_cap=30.0).implementation == "tokamax"
    # sinks: neither; Volta (sm70): not tokamax's Mosaic GPU kernel
    assert choose(head_dim=128, length=8192, sinks=True).implementation == "flash"
    assert choose(head_dim=128, length=8192, capability="7.0").implementation == "cudnn"
    monkeypatch.setattr(attention_speeds, "MEASURED", ())  # nothing measured: our kernel, the tie-break
    choice = choose(head_dim=128, length=8192)
    assert choice.implementation == "flash" and "no measured row compares flash and cudnn and tokamax" in choice.reason


def test_the_measured_table_names_its_device_date_and_source():
    for row in attention_speeds.MEASURED:
        assert row.date.startswith("2026-") and row.device in ("H100", "H200") and "docs/gpu.md" in row.source
        assert {name for name, _ in row.tflops} <= {"cudnn", "flash", "tokamax", "dot_product"}
        assert all(tflops > 0 for _, tflops in row.tflops)


def test_the_start_up_summary_names_the_choice_and_the_reason(without_tokamax):
    cfg = load_config([BASE_YML, *with_overrides(TINY, "attention=autoselected", "dtype=bfloat16")])
    text = Runtime.from_config(cfg, "gpu", capability="9.0").describe()
    assert f"attention cudnn (autoselected for gpu) [cudnn: fastest measured for head_dim {cfg.head_dim} at " \
           f"{cfg.max_target_length} tokens on sm90" in text
    text = Runtime.from_config(cfg.replace(attention="flash"), "gpu").describe()
    assert "attention flash (Pallas Triton)  " in text  # chosen by the user: no reason


def test_tokamax_is_refused_cleanly_where_it_cannot_run(monkeypatch):
    monkeypatch.setattr(kernel_choice, "tokamax_installed", lambda: False)
    with pytest.raises(ValueError, match=r"attention=tokamax is not installed \(pip install 'maxtrain\[gpu\]'\)\. "
                                         r"Use attention=flash, dot_product or autoselected"):
        attention.resolve_implementation("tokamax", "gpu", dtype=BF16, head_dim=128)
    monkeypatch.setattr(kernel_choice, "tokamax_installed", lambda: True)
    monkeypatch.setattr(kernel_choice, "tokamax_jax_mismatch", lambda: None)  # the kernel is not run here
    assert attention.resolve_implementation("tokamax", "gpu", dtype=BF16, head_dim=128) == "tokamax"
    with pytest.raises(ValueError, match=r"attention=tokamax needs dtype=bfloat16 or float16, got float32"):
        attention.resolve_implementation("tokamax", "gpu", dtype=jnp.float32, head_dim=128)
    with pytest.raises(ValueError, match=r"attention=tokamax runs its Mosaic GPU kernel on sm90 and sm100 only"):
        attention.resolve_implementation("tokamax", "gpu", dtype=BF16, head_dim=128, capability="8.0")


def test_tokamax_is_refused_by_name_where_the_installed_jax_breaks_its_kernel(monkeypatch):
    """tokamax 0.0.12 passes out_shape to jax's mosaic_gpu.kernel, which jax 0.10 takes and jax 0.11 on does not
    (every call failed on an H200 with jax 0.11.2): the check reads the installed jax, so each interpreter of CI
    checks its own side (jax 0.10.2 on Python 3.11, 0.12 on 3.12)."""
    monkeypatch.setattr(kernel_choice, "tokamax_installed", lambda: True)
    kernel_choice.tokamax_jax_mismatch.cache_clear()
    if tuple(int(x) for x in jax.__version__.split(".")[:2]) < (0, 11):
        assert kernel_choice.tokamax_jax_mismatch() is None
        assert attention.resolve_implementation("tokamax", "gpu", dtype=BF16, head_dim=128) == "tokamax"
        return
    with pytest.raises(ValueError, match=rf"^attention=tokamax .+ cannot run with jax {jax.__version__}: its Mosaic "
                                         r"GPU kernel passes out_shape to .*out_type.*\. Use attention=flash"):
        attention.resolve_implementation("tokamax", "gpu", dtype=BF16, head_dim=128)
    choice = choose(head_dim=128, length=8192)  # autoselected passes over it, saying why once
    assert choice.implementation == "cudnn" and choice.reason.count(f"cannot run with jax {jax.__version__}") == 1


def test_a_cpu_run_does_not_import_the_kernel_library():
    code = ("import sys; from maxtrain.training import builder; from maxtrain.models import attention; "
            "attention.resolve_implementation('autoselected', 'gpu', head_dim=128, length=4096); "
            "assert 'tokamax' not in sys.modules, 'imported'")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def _tokamax_or_skip():
    if not kernel_choice.tokamax_installed():
        pytest.skip("tokamax (the [gpu] extra) is not installed")


@pytest.mark.parametrize("case", [
    dict(causal=True, packed=True, window=0, cap=0.0, hv=32),
    dict(causal=False, packed=True, window=0, cap=0.0, hv=32),
    dict(causal=True, packed=False, window=24, cap=20.0, hv=16),  # window, soft-cap, a value head dim of its own
])
def test_tokamax_wrapper_against_the_float32_reference(case):
    """Through models/attention.attention (platform gpu, interpret: tokamax's XLA reference on this CPU):
    GQA 4:1, packed documents, forward and gradients against dot_product_attention in float32."""
    _tokamax_or_skip()
    shapes = kernel_check.Case(batch=2, length=64, heads=8, kv_heads=2, head_dim=32, dtype="float32",
                                  causal=case["causal"], packed=case["packed"])
    q, k, v, seg, do = kernel_check.inputs(shapes, seed=3)
    v = v[..., :case["hv"]]
    seg = jnp.ones(q.shape[:2], jnp.int32) if seg is None else seg
    kwargs = dict(causal=case["causal"], sliding_window=case["window"], logits_soft_cap=case["cap"], scale=0.3)

    def run(implementation):
        def loss(q, k, v):
            out = attention.attention(q, k, v, seg, implementation=implementation, platform="gpu", interpret=True,
                                      **kwargs)
            return jnp.sum(out * do[..., :case["hv"]]), out
        with jax.default_matmul_precision("highest"):
            return jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True)(q, k, v)

    (_, out), grads = run("tokamax")
    (_, ref), ref_grads = run("dot_product")
    assert out.shape == ref.shape == q.shape[:3] + (case["hv"],)
    errors = kernel_check.relative_errors((out, *grads), (ref, *ref_grads))
    assert kernel_check.passes(errors, "float32"), errors


def test_dataclass_shape_features_are_the_kernel_limits_keys():
    keys = {key for limits in kernel_choice.KERNEL_LIMITS.values() for key in limits}
    assert keys <= set(kernel_choice.Shape().features()) and dataclasses.is_dataclass(kernel_choice.Shape)


def test_compiled_without_the_gpu_the_choice_is_one_that_lowers_here(without_tokamax):
    """train_compile on a CPU: JAX lowers cuDNN attention as for pre-Hopper (head_dim <= 128), and tokamax's
    Mosaic GPU kernel not at all; on the GPU itself cuDNN takes head_dim 256 (Gemma 3)."""
    assert choose(head_dim=256, length=4096).implementation == "cudnn"
    choice = choose(head_dim=256, length=4096, gpu_present=False)
    assert choice.implementation == "flash" and "cudnn cannot be compiled here for head_dim 256" in choice.reason
    assert choose(head_dim=128, length=4096, gpu_present=False).implementation == "cudnn"


def test_long_packed_sequences_keep_their_segment_ids_in_a_kernel(without_tokamax):
    """cuDNN takes the segment ids (documents, padding) as a [B, 1, T, S] mask: 2 GiB a sequence at 32k tokens
    in bf16; flash keeps them as ids."""
    assert choose(head_dim=128, length=16384).implementation == "cudnn"
    choice = choose(head_dim=128, length=32768)
    assert choice.implementation == "flash" and "[B, 1, T, S] mask, 2.0 GiB a sequence at 32768 tokens" in choice.reason
    assert choose(head_dim=128, length=32768, packed=False).implementation == "cudnn"


GEMMA4 = with_overrides(TINY, "decoder_block=gemma4_text", "head_dim=256", "global_head_dim=512",
                        "base_num_decoder_layers=6", "sliding_window_size=64", "dtype=bfloat16",
                        "attention=autoselected", "max_target_length=4096")


def gemma4_runtime(*overrides, **kwargs):
    cfg = load_config([BASE_YML, *with_overrides(GEMMA4, *overrides)])
    return cfg, Runtime.from_config(cfg, "gpu", capability="9.0", layer_types=Model.bind(cfg).layer_types,
                                           **kwargs)


def test_each_layer_kind_gets_the_fastest_implementation_that_runs_it(without_tokamax):
    """Gemma 4's shape on an H100: its sliding-window layers (head_dim 256) run cuDNN, measured fastest there; its
    global layers' 512-wide heads are beyond cuDNN's 256, so they run our flash kernel. Each layer attends with
    its kind's choice, and the summary says per kind what was chosen and why."""
    cfg, rt = gemma4_runtime()
    by_kind = {k.label(): k.implementation for k in rt.attention_kinds}
    assert by_kind == {"sliding-window layers (head_dim 256, window 64)": "cudnn",
                       "full-attention layers (head_dim 512)": "flash"}
    assert rt.attention == "cudnn"  # what most layers (5 of 6) run
    layers = Model.bind(cfg).layer_types
    assert [rt.attention_for(t, cfg.head_dim) for t in layers] == ["cudnn"] * 5 + ["flash"]
    text = rt.describe()
    assert ("attention cudnn for the sliding-window layers (head_dim 256, window 64), flash (Pallas Triton) for the "
            "full-attention layers (head_dim 512) (autoselected for gpu)") in text
    assert "full-attention layers (head_dim 512): flash: the only kernel that supports this model" in text
    assert "got head_dim=512" in text and "cudnn: fastest measured for head_dim 256" in text
    # compiled without the GPU (train_compile on a CPU): cuDNN lowers only up to head_dim 128 there, so flash for both
    _, rt = gemma4_runtime(gpu_present=False)
    assert {k.implementation for k in rt.attention_kinds} == {"flash"} and rt.attention == "flash"
    assert "attention flash (Pallas Triton) (autoselected for gpu)" in rt.describe()
    # one head dim for every layer: one kind per window, the same choice, said once
    _, rt = gemma4_runtime("global_head_dim=256")
    assert [k.implementation for k in rt.attention_kinds] == ["cudnn", "cudnn"]
    assert rt.attention_reason.startswith("cudnn: fastest measured for head_dim 256") and " | " not in rt.attention_reason
    # on the CPU every kind runs dot_product, as before
    cfg, rt = gemma4_runtime()
    cpu = Runtime.from_config(cfg, "cpu", layer_types=Model.bind(cfg).layer_types)
    assert {k.implementation for k in cpu.attention_kinds} == {"dot_product"} and cpu.attention == "dot_product"


def test_an_explicit_choice_one_layer_kind_cannot_run_is_refused_naming_it(monkeypatch):
    monkeypatch.setattr(kernel_choice, "tokamax_installed", lambda: True)
    monkeypatch.setattr(kernel_choice, "tokamax_jax_mismatch", lambda: None)  # the kernel is not run here
    with pytest.raises(ValueError, match=r"^attention=tokamax cannot run the model's full-attention layers \(head_dim "
                                         r"512\): tokamax needs head_dim to be a multiple of 64 and at most 256, got "
                                         r"512\. Use attention=flash, dot_product or autoselected \(which chooses per "
                                         r"layer kind\)\.$"):
        gemma4_runtime("attention=tokamax")
    _, rt = gemma4_runtime("attention=tokamax", "global_head_dim=256")  # both kinds within its limits
    assert rt.attention == "tokamax" and {k.implementation for k in rt.attention_kinds} == {"tokamax"}
    # a choice no kind can run: refused as for the whole model
    with pytest.raises(ValueError, match=r"^attention=tokamax needs an NVIDIA GPU, but the platform is 'cpu'\. Use"):
        cfg = load_config([BASE_YML, *GEMMA4])
        Runtime.from_config(cfg.replace(attention="tokamax"), "cpu",
                                   layer_types=Model.bind(cfg).layer_types)


def test_the_builder_resolves_each_layer_kind_once():
    """build() hands the model's layer types to the runtime: a tiny Gemma 4 on this CPU has two kinds (sliding
    and full, their own head dims), each resolved, both to dot_product; the default model one."""
    from maxtrain.training import builder  # pylint: disable=import-outside-toplevel

    run = builder.build(load_config([BASE_YML, *with_overrides(TINY, "decoder_block=gemma4_text", "global_head_dim=32",
                                                               "base_num_decoder_layers=6",
                                                               "sliding_window_size=8", "dataset_type=synthetic")]))
    assert [(k.head_dim, k.window, k.implementation) for k in run.rt.attention_kinds] == [(16, 8, "dot_product"),
                                                                                         (32, 0, "dot_product")]
    run = builder.build(load_config([BASE_YML, *TINY, "dataset_type=synthetic"]))
    assert [(k.head_dim, k.window, k.implementation) for k in run.rt.attention_kinds] == [(16, 0, "dot_product")]
