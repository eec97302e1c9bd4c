"""compile/context_costs.py: each context-parallel strategy's communication per layer (the formulas, against numbers
worked by hand) and one attention layer's compiled memory (ring below all_gather at a long sequence).

The hand numbers: one row of T = 1024 tokens, N = 4 query and G = 2 kv heads of H = 8, bfloat16 (2 bytes), CP 4.
K and V of the whole sequence: 2 x 1024 x 2 x 8 x 2 = 65,536 bytes, of which a gather brings 3/4 = 49,152.
A device's block: 256 tokens, K and V 16,384 bytes, dK and dV (float32) 2 x 256 x 2 x 8 x 4 = 32,768; the block's
forward attention 4 x 256^2 x 4 x 8 = 8,388,608 FLOPs, its backward 2.5 x that = 20,971,520. Ulysses: q (and the
output) 256 x 4 x 8 x 2 = 16,384 bytes, k (and v) 8,192; an all-to-all sends 3/4 of each.
The chip: a link of 1e9 B/s and 1e12 FLOP/s after the GPU calibration's efficiencies, 15 us a collective.
"""

from __future__ import annotations

import dataclasses
import os
import re
import subprocess
import sys
import types

import jax
import pytest

from maxtrain.compile import context_costs, libtpu, predict, report
from maxtrain.compile.context_costs import Collective, Shape
from maxtrain.config import chips

SHAPE = Shape(batch=1, tokens=1024, heads=4, kv_heads=2, head_dim=8, act_bytes=2)
CAL = predict.calibration_for(chips.by_name("h100"))
CHIP = dataclasses.replace(chips.by_name("h100"), link_bytes_per_s=1e9 / CAL.link, bf16_flops=1e12 / CAL.matmul)
US = 1e-6


def test_all_gather_gathers_the_whole_sequence_keys_and_reduce_scatters_their_gradients():
    assert context_costs.layer_communication("all_gather", SHAPE, 4) == [
        Collective("all-gather", 1, 49_152), Collective("reduce-scatter", 1, 49_152)]
    assert context_costs.layer_communication("all_gather", SHAPE, 4, recompute=True)[0] == Collective(
        "all-gather", 2, 49_152)
    seconds = context_costs.layer_seconds(context_costs.layer_communication("all_gather", SHAPE, 4), CHIP)
    assert seconds["total"] == pytest.approx(2 * (49.152 + 15) * US)
    assert seconds["exposed"] == pytest.approx(seconds["total"])  # nothing overlaps the gather


def test_ring_passes_blocks_and_hides_them_behind_the_block_in_hand():
    comm = context_costs.layer_communication("ring", SHAPE, 4)
    assert comm == [Collective("collective-permute", 3, 16_384, 8_388_608),
                    Collective("collective-permute", 3, 16_384 + 32_768, 20_971_520),
                    Collective("collective-permute", 1, 32_768)]
    seconds = context_costs.layer_seconds(comm, CHIP)
    assert seconds["total"] == pytest.approx((3 * (16.384 + 15) + 3 * (49.152 + 15) + (32.768 + 15)) * US)
    # each pass minus its block's attention (8.388608 us forward, 20.97152 us backward); the last pass is exposed
    assert seconds["exposed"] == pytest.approx((3 * (31.384 - 8.388608) + 3 * (64.152 - 20.97152) + 47.768) * US)
    # a block whose attention outlasts its pass hides it entirely: only the last pass (dK, dV home) stays
    long = dataclasses.replace(SHAPE, tokens=1 << 16)
    hidden = context_costs.layer_seconds(context_costs.layer_communication("ring", long, 4), CHIP)
    assert hidden["exposed"] == pytest.approx(2 * (1 << 14) * 2 * 8 * 4 / 1e9 + 15 * US)


def test_ulysses_trades_tokens_for_heads_with_four_all_to_alls_each_way():
    assert context_costs.layer_communication("ulysses", SHAPE, 4) == [
        Collective("all-to-all", 4, 12_288), Collective("all-to-all", 4, 6_144)]
    assert [c.count for c in context_costs.layer_communication("ulysses", SHAPE, 4, recompute=True)] == [6, 6]
    seconds = context_costs.layer_seconds(context_costs.layer_communication("ulysses", SHAPE, 4), CHIP)
    assert seconds["exposed"] == pytest.approx((4 * (12.288 + 15) + 4 * (6.144 + 15)) * US)


def test_one_device_communicates_nothing_and_an_unknown_strategy_is_refused():
    assert context_costs.layer_communication("ring", SHAPE, 1) == []
    with pytest.raises(ValueError, match="hybrid"):
        context_costs.layer_communication("hybrid", SHAPE, 4)
    with pytest.raises(ValueError, match="usp needs inner"):
        context_costs.layer_communication("usp", SHAPE, 4)


def test_usp_is_ulysses_inside_and_the_ring_across():
    """usp 2 x 2: the all-to-alls of ulysses among 2 devices on T / 2 tokens (each device's T / 4 of every head),
    then the ring over 2 on T / 2 tokens of half the heads: its blocks are the 4-way ring's, passed once."""
    comm = context_costs.layer_communication("usp", SHAPE, 4, inner=2)
    ring4 = context_costs.layer_communication("ring", SHAPE, 4)
    trade, ring = comm[:2], comm[2:]
    assert [c.kind for c in trade] == ["all-to-all"] * 2 and [c.kind for c in ring] == ["collective-permute"] * 3
    assert [c.count for c in ring] == [1, 1, 1]
    assert [c.bytes for c in ring] == [c.bytes for c in ring4]
    local_q = SHAPE.batch * (SHAPE.tokens // 4) * SHAPE.heads * SHAPE.head_dim * SHAPE.act_bytes
    assert trade[0] == Collective("all-to-all", 4, local_q / 2)


def test_ring_compiled_memory_at_cp4_is_a_fraction_of_all_gathers():
    """4,096 tokens over 4 devices: all_gather's temporaries hold scores of 1,024 queries against all 4,096 keys
    (and the gathered keys), the ring's one block pair's 1,024 x 1,024; the arguments are the same."""
    ring = context_costs.compiled_attention_memory("ring", 4, 4096, heads=4, head_dim=8, devices=jax.devices()[:4])
    gather = context_costs.compiled_attention_memory("all_gather", 4, 4096, heads=4, head_dim=8,
                                                     devices=jax.devices()[:4])
    assert ring["arguments"] == gather["arguments"]
    assert ring["temporaries"] < gather["temporaries"] / 2


def test_the_flash_ring_holds_no_block_scores():
    """The flash kernel inside the ring (interpret mode here), GQA: its temporaries are a fraction of the plain ring's,
    which holds one block pair's [T / C, N, T / C] scores; the kv arguments follow kv_heads."""
    kwargs = dict(heads=4, kv_heads=2, head_dim=8, devices=jax.devices()[:4])
    flash = context_costs.compiled_attention_memory("ring", 4, 4096, implementation="flash", **kwargs)
    plain = context_costs.compiled_attention_memory("ring", 4, 4096, **kwargs)
    assert flash["arguments"] == plain["arguments"] == 4 * (2 * 4096 * 4 * 8 + 2 * 4096 * 2 * 8 + 4096) // 4
    assert flash["temporaries"] < plain["temporaries"] / 4


def test_the_tpu_compilers_refusal_is_read_in_terabytes_too():
    """A 128k-token step on v5p (scripts: train_compile, docs/scale.md) was refused with its temporaries in T; the
    refusal must still become train_compile's one-line error, not a traceback."""
    said = ("RESOURCE_EXHAUSTED: E1000: CompileTimeHbmOom: Ran out of memory on HBM, the total memory required for "
            "HLO temporaries (3.09T) exceeds available HBM (95.73G). HLO module: jit_train_step.")
    assert libtpu.out_of_memory(RuntimeError(said)) == pytest.approx((3.09 * 1024, 95.73))
    assert libtpu.out_of_memory(RuntimeError(said.replace("3.09T", "17.21G"))) == pytest.approx((17.21, 95.73))
    assert libtpu.out_of_memory(RuntimeError("RESOURCE_EXHAUSTED: something else")) is None


def test_the_tpu_compilers_scalar_memory_refusal_becomes_one_line_naming_the_blocks():
    """libtpu's words when the splash kernels' block tables overflow SMEM (a v5p-16 ring with flash at 1M tokens,
    scripts/context_memory.py, 2026-11-29): read, and turned into train_compile's one line with the fix."""
    said = ("RESOURCE_EXHAUSTED: XLA:TPU compile permanent error. Ran out of memory in memory space smem. Used 1.50M of "
            "1.00M smem. Exceeded smem capacity by 513.1K.")
    assert libtpu.out_of_scalar_memory(RuntimeError(said)) == ("1.50M", "1.00M")
    assert libtpu.out_of_scalar_memory(RuntimeError("RESOURCE_EXHAUSTED: Ran out of memory on HBM")) is None
    one_table = ("RESOURCE_EXHAUSTED: Allocation (size=2097152) would exceed memory (size=1048576) :: #allocation6 "
                 "[shape = 'u8[2097152]{0}', space=smem, size = 0x200000, scoped, tag = 'prefetched SMEM operand 0'] "
                 ":: splash_mha_fwd_segmented")  # ulysses at 131,072 tokens on a v5p-16, blocks of 128
    assert libtpu.out_of_scalar_memory(RuntimeError(one_table)) == ("2.00M", "1.00M")
    assert libtpu.out_of_scalar_memory(RuntimeError(one_table.replace("space=smem", "space=vmem"))) is None
    config = types.SimpleNamespace(sa_block_q=128, sa_block_kv=256)
    line = report.scalar_memory_message("1.50M", "1.00M", config, "v5p")
    assert "\n" not in line and "1.50M of a v5p chip's 1.00M scalar memory (SMEM)" in line
    assert "raise sa_block_q=128 and sa_block_kv=256" in line and "ici_context_parallelism" in line


def test_the_tpu_compilers_scoped_vmem_refusal_becomes_one_line_naming_the_blocks():
    """libtpu's words when a splash tile overflows the scoped VMEM limit (llama3-8b ulysses at 1M tokens on a v5p-16,
    blocks of 2,048, 2026-12-02): read, and turned into train_compile's one line with the fix."""
    said = ("RESOURCE_EXHAUSTED: E1001: CompileTimeScopedVmemOom: Ran out of memory in memory space vmem while "
            "allocating on stack for %splash_mha_fwd_segmented_residuals.3 ... Scoped allocation with size 29.77M and "
            "limit 16.00M exceeded scoped vmem limit by 13.77M.")
    assert libtpu.out_of_scoped_vmem(RuntimeError(said)) == ("29.77M", "16.00M")
    assert libtpu.out_of_scoped_vmem(RuntimeError("RESOURCE_EXHAUSTED: Ran out of memory in memory space smem")) is None
    line = report.scoped_vmem_message("29.77M", "16.00M", types.SimpleNamespace(sa_block_q=2048, sa_block_kv=2048),
                                      "v5p")
    assert "\n" not in line and "29.77M of a v5p chip's vector memory (VMEM)" in line
    assert "sa_block_q=2048" in line and "--xla_tpu_scoped_vmem_limit_kib" in line


def test_the_memory_script_prints_a_row_per_run_and_the_reason_a_run_does_not_compile():
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=4", "JAX_PLATFORMS": "cpu"}
    out = subprocess.run([sys.executable, "scripts/context_memory.py", "--cp", "4", "--lengths", "4096", "--heads", "4",
                          "--kv-heads", "2", "--runs", "ring:flash,ring:cudnn"], capture_output=True, text=True,
                         env=env, timeout=300, check=True).stdout
    rows = {line.split()[0]: line for line in out.splitlines() if line.startswith("ring:")}
    assert re.fullmatch(r"ring:flash\s+4096(\s+[\d.]+){4}", rows["ring:flash"]), out
    assert ("not compiled: attention=cudnn inside context_parallel_strategy=ring needs an NVIDIA GPU"
            in rows["ring:cudnn"]), out
