"""Checks of one dump or checkpoint, as opposed to a compare of two runs' tensors.

``weights``: a checkpoint (float or msModelSlim-quantized) against another, tensor by tensor;
``overflow``: where Inf/NaN or near-max values first appear in one dump; ``env_diff``: what
differs between two recorded environments. They use ``llmflow.compare``'s metrics, one layer up.
"""
