"""The two kinds of failure llmflow tells apart.

A ``UserError`` is the user's to fix (a broken workflow, a wrong path, a corrupt dump, an
unknown device): the CLI prints its one-line message without a traceback and exits 2.
Any other exception inside a stage is a stage failure: the stage is marked failed, its
dependents are skipped, and the CLI exits 1.
"""

from __future__ import annotations

import re

# Exit codes of every llmflow command, and the word of its last line.
EXIT_PASSED = 0  # the target matches (PASSED)
EXIT_FAILED = 1  # a fault was found, a compared row failed, or a stage crashed (FAILED)
EXIT_BAD_INPUT = 2  # bad input: one line naming the file, line or field (FAILED)
EXIT_INCONCLUSIVE = 3  # the evidence does not cover the question (INCONCLUSIVE)


MAX_MESSAGE = 500  # characters of one error line


def one_line(text: object, limit: int = MAX_MESSAGE) -> str:
    """``text`` as one line of at most ``limit`` characters: line breaks become spaces, and a
    longer text (a repr of a huge value, a pasted file) is cut with its length said."""
    raw = str(text)
    flat = re.sub(r"\s*[\r\n\v\f]+\s*", " ", raw[: 4 * limit]).strip()
    if len(raw) <= 4 * limit and len(flat) <= limit:
        return flat
    return flat[: limit - 30].rstrip() + f" ... ({len(raw)} characters)"


class UserError(Exception):
    """A mistake in the user's input. ``str(err)`` is the whole one-line message.

    Name the file, line or field in the message, e.g. ``"workflow.yaml:12:5: unknown key 'nedds'"``
    or ``"dump: device 'npu': torch_npu is not installed"``.
    """


class ComputeError(RuntimeError):
    """Work that could not be done for a reason outside the user's input (a compare whose dask
    workers kept dying): the CLI prints its one line without a traceback and exits 1."""


class DumpFormatError(UserError):
    """A dump file or index that cannot be read: truncated, lying header, unknown dtype, unsafe."""
