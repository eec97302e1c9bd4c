"""python tests/bad_inputs [--python PY] [--repo DIR] [--json OUT]: every row as a real command."""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bad_inputs import main  # noqa: E402  pylint: disable=wrong-import-position

sys.exit(main())
