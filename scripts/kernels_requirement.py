"""Print the ``kernels`` requirement the installed transformers accepts, read from the release
itself (``KERNELS_MIN_VERSION`` / ``KERNELS_MAX_VERSION`` in ``transformers.utils.import_utils``):
``kernels>=0.16.0,<0.17.0``; plain ``kernels`` where the release names no bounds. Exit 1, saying
why on stderr, where the release loads no hub kernels at all (no ``is_kernels_available``) or
none through the loader attnguard wraps (before 4.56: attnguard leaves those hub requests alone,
and no test has a use for the package). ``scripts/test.sh`` installs
the newest release in that window for the hub-kernel tests.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path


def main() -> int:
    try:
        import transformers.utils.import_utils as utils
    except Exception as exc:
        print(f"transformers does not import: {exc}", file=sys.stderr)
        return 1
    if not hasattr(utils, "is_kernels_available"):
        print("this transformers release loads no hub kernels", file=sys.stderr)
        return 1
    # read, not imported: importing it imports torch (seconds, in each of CI's many lanes)
    spec = importlib.util.find_spec("transformers.integrations.hub_kernels")
    source = Path(spec.origin).read_text() if spec is not None and spec.origin else ""
    loaders = ("load_and_register_attn_kernel", "load_and_register_kernel")
    if not any(f"def {name}(" in source for name in loaders):
        print("this transformers release has no loader of attention hub kernels", file=sys.stderr)
        return 1
    bounds = [
        f"{op}{value}"
        for op, name in ((">=", "KERNELS_MIN_VERSION"), ("<", "KERNELS_MAX_VERSION"))
        if isinstance(value := getattr(utils, name, None), str)
    ]
    print("kernels" + ",".join(bounds))
    return 0


if __name__ == "__main__":
    sys.exit(main())
