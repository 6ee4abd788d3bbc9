"""Seeds and determinism switches, so a golden and a target run differ only where they must.

``determinism_settings`` says what would be applied (a JSON dict, recorded in dumps and in the
seed stage's outputs); ``apply_settings`` applies such a dict in the current process (the dump
stage calls it in its own subprocess); ``seed_all`` does both.

Environment variables only affect what reads them later: PYTHONHASHSEED affects child processes,
CUBLAS_WORKSPACE_CONFIG must be set before the first cuBLAS call, the HCCL/LCCL/ATB variables
before Ascend libraries initialise. Call ``seed_all`` first thing.
"""

from __future__ import annotations

import os
import random
from typing import Any

from llmflow.errors import UserError

#: The largest seed: PYTHONHASHSEED takes 0..4294967295 (a bigger one kills the interpreter at
#: start-up) and numpy's legacy seeding takes 0..2**32-1.
MAX_SEED = 2**32 - 1

# What each variable does, for the record: cuBLAS reproducible workspaces; Ascend collective
# communication (HCCL, LCCL) in a fixed reduction order; ATB matmul without K-shuffling and
# without the LCOC compute/communication overlap, both of which reorder float additions.
DETERMINISTIC_ENV = {
    "CUBLAS_WORKSPACE_CONFIG": ":4096:8",
    "HCCL_DETERMINISTIC": "true",
    "LCCL_DETERMINISTIC": "1",
    "ATB_MATMUL_SHUFFLE_K_ENABLE": "0",
    "ATB_LLM_LCOC_ENABLE": "0",
}


def determinism_settings(seed: int = 1234, deterministic: bool = True) -> dict[str, Any]:
    """What ``seed_all(seed, deterministic)`` applies, as JSON; touches nothing. A seed outside
    0..MAX_SEED is a UserError."""
    check_seed(seed)
    env = {"PYTHONHASHSEED": str(seed)}
    if deterministic:
        env.update(DETERMINISTIC_ENV)
    return {
        "seed": int(seed),
        "deterministic": bool(deterministic),
        "env": env,
        "torch": {
            "use_deterministic_algorithms": bool(deterministic),
            "cudnn_deterministic": bool(deterministic),
            "cudnn_benchmark": not deterministic,
        },
    }


def check_seed(seed: Any) -> int:
    """``seed`` as an int, or a UserError naming it when it is not one in 0..MAX_SEED."""
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed <= MAX_SEED:
        raise UserError(f"seed {seed!r}: must be an integer from 0 to {MAX_SEED} "
                        "(what PYTHONHASHSEED and numpy accept)")
    return int(seed)


def apply_settings(settings: dict[str, Any]) -> dict[str, Any]:
    """Apply a ``determinism_settings`` dict in this process; returns it, with what was seeded."""
    seed = check_seed(settings["seed"])
    os.environ.update({k: str(v) for k, v in settings.get("env", {}).items()})
    random.seed(seed)
    seeded = ["random"]
    try:
        import numpy as np

        np.random.seed(seed)
        seeded.append("numpy")
    except ImportError:
        pass
    try:
        import torch
    except ImportError:
        return {**settings, "seeded": seeded}
    flags = settings.get("torch", {})
    torch.manual_seed(seed)
    seeded.append("torch")
    torch.use_deterministic_algorithms(bool(flags.get("use_deterministic_algorithms", True)), warn_only=True)
    torch.backends.cudnn.deterministic = bool(flags.get("cudnn_deterministic", True))
    torch.backends.cudnn.benchmark = bool(flags.get("cudnn_benchmark", False))
    if torch.cuda.is_available():
        torch.cuda.manual_seed_all(seed)
        seeded.append("cuda")
    try:
        import torch_npu  # noqa: F401  (registers torch.npu)

        torch.npu.manual_seed_all(seed)
        seeded.append("npu")
    except Exception:  # torch_npu absent or without a device: nothing to seed there
        pass
    return {**settings, "seeded": seeded}


def seed_all(seed: int = 1234, deterministic: bool = True) -> dict[str, Any]:
    """Seed random, numpy, torch (+CUDA, +NPU) and set the determinism switches in this process.

    Drop-in for msit's ``seed_all``. Returns the applied settings (``determinism_settings`` plus
    ``seeded``: the generators that were seeded).
    """
    return apply_settings(determinism_settings(seed, deterministic))
