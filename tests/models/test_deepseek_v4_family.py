"""The deepseek_v4 family end to end: a tiny random DeepseekV4ForCausalLM (transformers 5.24, save_pretrained) is
imported by scripts/convert_hf.py's import_hf, its logits checked by check_logits against transformers (float32,
<= 1e-5 relative) at a length where the sliding window (6 of 24), CSA's top-k (2 of 6 entries) and HCA's closed
entries all drop keys, and exported back to the very tensors and a config transformers loads to the same logits.
The config checks refuse, in one line and before compiling, what its layers cannot run."""

from __future__ import annotations

import json

import numpy as np
import pytest

torch = pytest.importorskip("torch")
v4 = pytest.importorskip("transformers.models.deepseek_v4.modeling_deepseek_v4")

from maxtrain import check_logits  # noqa: E402
from maxtrain import config as config_lib  # noqa: E402
from maxtrain.checkpointing import convert, safetensors_files  # noqa: E402
from maxtrain.errors import ConfigError  # noqa: E402
from maxtrain.models.model import Model  # noqa: E402
from maxtrain.models.runtime import Runtime  # noqa: E402
from maxtrain.training import builder  # noqa: E402

from test_deepseek_v4_parts import YARN, T, randomize, tiny_config  # noqa: E402  (tests/models/ is on sys.path)


def _logits(model, ids):
    with torch.no_grad():
        return model(input_ids=torch.as_tensor(ids)).logits.numpy()


@pytest.mark.slow
@pytest.mark.parametrize("rope", [None, YARN], ids=["default-rope", "yarn"])
def test_import_check_logits_and_export(tmp_path, capsys, rope):
    cfg = tiny_config(**({"rope_parameters": dict(rope)} if rope else {}))
    hf_model = randomize(v4.DeepseekV4ForCausalLM(cfg).eval(), seed=70)
    hf_dir, out, golden = tmp_path / "hf", tmp_path / "imported", tmp_path / "golden.npz"
    hf_model.save_pretrained(hf_dir)
    keys = convert.import_hf(str(hf_dir), str(out))
    assert keys["decoder_block"] == "deepseek_v4" and keys["hc_mult"] == 3 and keys["num_hash_layers"] == 1

    rc = check_logits.main([str(out), "--hf", str(hf_dir), "--golden", str(golden), "--length", str(T)])
    last = capsys.readouterr().out.strip().splitlines()[-1]
    print(f"deepseek_v4: relative logits error {last}")
    assert rc == 0 and float(last) <= 1e-5, last
    theirs, ids = np.load(golden)["logits"], np.load(golden)["input_ids"]
    assert np.std(theirs) > 0.1, "logits too flat for a meaningful comparison"

    exported = tmp_path / "export"
    convert.export_hf(str(out), str(exported), "float32")
    original = safetensors_files.read_model_dir(str(hf_dir))
    written = safetensors_files.read_model_dir(str(exported))
    assert sorted(written) == sorted(original)
    for name, array in written.items():
        assert array.dtype == original[name].dtype and array.tobytes() == original[name].tobytes(), name
    config = json.loads((exported / "config.json").read_text())
    assert config["architectures"] == ["DeepseekV4ForCausalLM"] and config["model_type"] == "deepseek_v4"
    reloaded = v4.DeepseekV4ForCausalLM.from_pretrained(exported, dtype=torch.float32).eval()
    np.testing.assert_array_equal(_logits(reloaded, ids), _logits(hf_model, ids))


@pytest.mark.parametrize("override, named", [
    ("max_target_length=250", "compress rate 4 of compressed_sparse_attention does not divide"),
    ("ici_context_parallelism=2 context_parallel_strategy=ring",
     r"context_parallel_strategy=ring cannot split DeepSeek-V4's attention over context parallelism 2"),
    ("o_groups=3", "o_groups 3 does not divide"),
    ("compress_layer_types=[sliding_attention]", "compress_layer_types must list"),
    ("rope_type=llama3", "rope_type=llama3 is not implemented for its compressed layers"),
    ("rope_type=yarn rope_attention_factor=1.3", "rope_attention_factor=1.3 would scale cos and sin"),
    # no router logits: a balance or z loss the user asks for is refused (base.yml's 0.01 too, when given)
    ("load_balance_loss_weight=0.01", r"load_balance_loss_weight=0.01 does nothing with decoder_block=deepseek_v4: "
                                      r".*no router logits.*; drop load_balance_loss_weight \(it is 0.0 for deepseek_v4\)"),
    ("router_z_loss_weight=0.001", "router_z_loss_weight=0.001 does nothing with decoder_block=deepseek_v4"),
])
def test_config_refuses_what_the_layers_cannot_run(override, named):
    with pytest.raises(ConfigError, match=named) as e:
        config_lib.load_config(["configs/base.yml", "model_name=deepseek4-tiny", *override.split()])
    assert "\n" not in str(e.value)


def test_the_family_sets_its_balance_losses_to_zero_and_refuses_only_a_users_value(tmp_path):
    """base.yml's load_balance_loss_weight (0.01) serves the other mixtures of experts: a deepseek_v4 model named by
    its preset, or imported from a config.json and adopted by a run (load_parameters_path alone), resolves it to 0;
    the same run with the user's own value is refused in one line (the control)."""
    assert config_lib.load_config(["configs/base.yml", "model_name=deepseek4-tiny"]).load_balance_loss_weight == 0.0
    v4.DeepseekV4ForCausalLM(tiny_config()).eval().save_pretrained(tmp_path / "hf")
    keys = convert.import_hf(str(tmp_path / "hf"), str(tmp_path / "imported"), log=lambda *_: None)
    assert keys["decoder_block"] == "deepseek_v4"
    run = ["configs/base.yml", f"load_parameters_path={tmp_path / 'imported'}", "max_target_length=24"]
    config = builder.load_config(run, log=lambda *_: None)
    assert config.decoder_block == "deepseek_v4"
    assert (config.load_balance_loss_weight, config.router_z_loss_weight) == (0.0, 0.0)
    with pytest.raises(ConfigError, match="load_balance_loss_weight=0.02 does nothing with decoder_block=deepseek_v4"):
        builder.load_config([*run, "load_balance_loss_weight=0.02"], log=lambda *_: None)


def test_its_attention_is_its_own_form_and_a_kernel_named_for_it_is_refused():
    """V4's layers attend in compressed.py's plain-jnp form whatever config.attention says: autoselected says so
    in the summary (not "flash", which its layers never call), and a kernel named in the config is refused."""

    def runtime(attention, backend):
        config = config_lib.load_config(["configs/base.yml", "model_name=deepseek4-tiny", f"attention={attention}"])
        return Runtime.from_config(config, backend=backend, layer_types=Model.bind(config).layer_types)
    for backend in ("cpu", "gpu", "tpu"):
        rt = runtime("autoselected", backend)
        assert rt.attention == "dot_product" and "compressed.py" in rt.attention_reason, (backend, rt)
        assert "attention dot_product" in rt.describe()
    for kernel in ("flash", "cudnn", "tokamax"):
        with pytest.raises(ValueError, match=rf"attention={kernel} does nothing with decoder_block=deepseek_v4: .*"
                                             r"set attention=autoselected \(or dot_product\)"):
            runtime(kernel, "gpu")
