"""The pip constraints that keep an installed torch and hold the rest to what it can run with.

    python scripts/torch_constraints.py 2.1.0+cpu   ->   torch==2.1.0+cpu / transformers<4.56 / numpy<2

scripts/install.sh installs llmflow under these, so nothing replaces the user's torch (the build
torch_npu or CUDA needs) and nothing newer than that torch supports comes along with llmflow.
"""

from __future__ import annotations

import re
import sys

# (below this torch, the requirement it needs, why); pyproject.toml says more
HOLDS = [
    ((2, 2), "transformers<4.56", "transformers 4.56+ registers pytree nodes through an API of torch 2.2"),
    ((2, 3), "numpy<2", "torch before 2.3 was built against numpy 1.x"),
]


def constraints(torch_version: str) -> list[str]:
    """The constraint lines for this installed torch version (as its metadata spells it)."""
    found = re.match(r"(\d+)\.(\d+)", torch_version)
    if found is None:
        raise ValueError(f"torch version {torch_version!r}: expected MAJOR.MINOR...")
    major_minor = (int(found.group(1)), int(found.group(2)))
    return [f"torch=={torch_version}", *(req for below, req, _ in HOLDS if major_minor < below)]


if __name__ == "__main__":
    print("\n".join(constraints(sys.argv[1])))
