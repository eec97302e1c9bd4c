"""Time splash's block tables (the causal mask's forward and dkv MaskInfo) built by maxtrain/kernels/splash_tables.py
against splash's own `_process_mask`, at the lengths and blocks of the long-context rows (docs/scale.md).

    JAX_PLATFORMS=cpu python scripts/splash_tables_time.py                         # ours at 32k, 128k, 1M
    JAX_PLATFORMS=cpu python scripts/splash_tables_time.py --splash-up-to 131072   # and splash's up to 128k

Splash's own at 1M takes about 1,300 s a table (extrapolated as T^2): give --splash-up-to 1048576 to wait for it.
Each build is timed once, on a fresh mask (both sides cache by mask). Prints one line per (length, table).
"""

from __future__ import annotations

import argparse
import sys
import time

from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as masks
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask_info as mask_info_lib

from maxtrain.errors import run_cli
from maxtrain.kernels import splash_tables

ROWS = ((32768, 256), (131072, 512), (1048576, 2048))  # tokens, block (as docs/scale.md's measurements)


def _time(build) -> tuple[float, object]:
    start = time.perf_counter()
    out = build()
    return time.perf_counter() - start, out


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--splash-up-to", type=int, default=0, help="also time splash's own up to this length")
    args = parser.parse_args(argv)
    for length, block in ROWS:
        for is_dkv in (False, True):
            table = "dkv" if is_dkv else "forward"
            ours, info = _time(lambda: splash_tables.mask_info(masks.CausalMask((length, length)), (block, block),
                                                               is_dkv))
            line = (f"T={length:>8,} block={block:>5} {table:>7}: ours {ours * 1e3:8.1f} ms "
                    f"(block_mask {list(info[0].block_mask.shape)} {info[0].block_mask.dtype})")
            if length <= args.splash_up_to:
                theirs, expected = _time(lambda: mask_info_lib._process_mask(  # pylint: disable=protected-access
                    masks.MultiHeadMask([masks.CausalMask((length, length))]), (block, block), is_dkv))
                same = splash_tables.compare(info, expected) or "same tables"
                line += f", splash's {theirs:8.2f} s ({same})"
            print(line, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(run_cli("splash_tables_time", main))
