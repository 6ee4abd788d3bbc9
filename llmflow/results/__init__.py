"""The result types that cross a file: what llmflow writes for people and machines to read back.

Each type is a dataclass read and written by one codec (``codec.py``: ``to_json``, ``from_json``,
``json_schema``); the JSON schemas in ``schemas/`` are generated from the types. This package sits
on the lowest floor (it imports only ``errors``), so every layer that fills or reads a result, from
``compare/`` and ``localize/`` up to the report and the CLI, uses the same types.
"""
