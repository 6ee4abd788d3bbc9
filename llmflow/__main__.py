"""``python -m llmflow``: the ``llmflow`` command."""

import sys

from llmflow.cli import main

sys.exit(main())
