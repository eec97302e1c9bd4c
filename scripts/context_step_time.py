"""Predicted step time of a long-context train step under each context-parallel strategy, from the shapes (no
compile): the model's FLOPs on the chip's calibrated peak plus each layer's context-parallel communication that
the attention does not hide (compile/context_costs.py's formulas), and the fastest strategy per case.

    python scripts/context_step_time.py --model llama3-8b --chips h100,v5p --cp 8 --lengths 131072,1048576

A case is one sequence of T tokens split over a context group of C devices (also sharding the parameters, FSDP
over the same devices), remat full (the forward runs twice). compute = flops_per_token(dense_attention) x T / C x
4/3 (remat's second forward) / (bf16 peak x the chip kind's matmul efficiency, compile/predict.py); every key
is counted, as all three strategies compute masked blocks in full today. step = compute + layers x the exposed
communication of one layer. Not counted: the parameters' all-gathers and reduce-scatters (the same under every
strategy), memory-bound work, the host. Whether a case fits is train_compile's question (docs/scale.md).
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys

from maxtrain import config as config_lib
from maxtrain.compile import context_costs, predict
from maxtrain.config import chips
from maxtrain.errors import run_cli
from maxtrain.models.model import Model

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="context_step_time", description=__doc__.split("\n\n", maxsplit=1)[0])
    parser.add_argument("--model", default="llama3-8b", help="a preset of configs/models/")
    parser.add_argument("--chips", default="h100,v5p", help="chip records (config/chips.py), comma-separated")
    parser.add_argument("--cp", type=int, default=8, help="devices in the context group")
    parser.add_argument("--lengths", default="131072,1048576", help="comma-separated token counts")
    parser.add_argument("--usp-inner", type=int, default=0,
                        help="usp's ulysses group (ici_context_parallelism), the ring over cp / it; 0: no usp row")
    args = parser.parse_args(argv)
    print("$ python scripts/context_step_time.py " + shlex.join(sys.argv[1:] if argv is None else argv))
    print(f"{'chip':<6}{'tokens':>9}  {'strategy':<11}{'CP comm s':>10}{'exposed s':>10}{'compute s':>10}"
          f"{'step s':>9}  fastest")
    for name in args.chips.split(","):
        chip = chips.by_name(name)
        cal = predict.calibration_for(chip)
        for tokens in (int(t) for t in args.lengths.split(",")):
            config = config_lib.load_config([os.path.join(REPO, "configs", "base.yml"), f"model_name={args.model}",
                                             f"max_target_length={tokens}"])
            model = Model.bind(config)
            compute = (model.flops_per_token(dense_attention=True) * tokens / args.cp * 4 / 3
                       / (chip.bf16_flops * cal.matmul))
            shape = context_costs.Shape(batch=1, tokens=tokens, heads=config.base_num_query_heads,
                                        kv_heads=config.base_num_kv_heads, head_dim=config.head_dim)
            rows = []
            for strategy in context_costs.STRATEGIES:
                if strategy == "usp" and not args.usp_inner:
                    continue
                comm = context_costs.layer_seconds(context_costs.layer_communication(
                    strategy, shape, args.cp, recompute=True, inner=args.usp_inner), chip)
                layers = config.base_num_decoder_layers
                rows.append((strategy, comm["total"] * layers, comm["exposed"] * layers,
                             compute + comm["exposed"] * layers))
            best = min(rows, key=lambda r: r[3])[0]
            for strategy, total, exposed, step in rows:
                print(f"{name:<6}{tokens:>9}  {strategy:<11}{total:>10.3f}{exposed:>10.3f}{compute:>10.2f}{step:>9.2f}"
                      f"  {'*' if strategy == best else ''}")
    return 0


if __name__ == "__main__":
    sys.exit(run_cli("context_step_time", main))
