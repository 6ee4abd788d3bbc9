"""Example custom compare algorithms for ``llmflow compare -alg`` / the ``algorithms:`` parameter.

    llmflow compare -gp golden_dump -mp target_dump -alg plugins/example_algorithm.py:sign_flip_ratio

Each function receives the golden and target tensors (float32, CPU, same shape) and returns
``(value, message)``; the value becomes a report column named after the function.
"""

from __future__ import annotations

import torch


def sign_flip_ratio(golden: torch.Tensor, target: torch.Tensor) -> tuple[float, str]:
    """Share of elements whose sign differs (zeros on either side do not count as flips).

    Rounding moves values a little; a sign flip on more than a few elements means real damage
    (a wrong rotary half, a negated projection), even when the cosine similarity still looks fine.
    """
    flips = (torch.sign(golden) * torch.sign(target) < 0).sum().item()
    n = golden.numel()
    ratio = flips / n if n else 0.0
    return ratio, (f"{flips} of {n} elements flipped sign" if flips else "")


def max_ulp_error(golden: torch.Tensor, target: torch.Tensor) -> tuple[float, str]:
    """The largest difference in units in the last place of bf16 (the target's usual precision)."""
    if not golden.numel():
        return 0.0, ""
    # |g| = m * 2**e with m in [0.5, 1): bf16 keeps 8 significant bits, so its spacing is 2**(e - 8)
    _, exponent = torch.frexp(golden)
    spacing = torch.ldexp(torch.ones_like(golden), (exponent - 8).clamp_min(-133))
    ulps = (torch.abs(target - golden) / spacing).max().item()
    return ulps, ""
