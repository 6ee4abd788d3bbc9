"""The compare levels, coarse to fine: a row belongs to one or more (a decoder layer's output is
also a module row). Here, apart from the matching, so a stage's schema lists them without torch."""

LEVELS = ("logits", "layer", "module", "api", "save")
