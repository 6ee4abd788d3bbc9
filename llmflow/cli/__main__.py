"""``python -m llmflow.cli`` is the ``llmflow`` command."""

import sys

from llmflow.cli import main

sys.exit(main())
