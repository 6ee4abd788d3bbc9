"""The names of llmflow's own dump format that both its writer (``llmflow_dump``) and its reader
(``llmflow_reader``) use: the format's tag and version and its top-level files. Kept apart so
that each of the two imports them from here and neither imports the other for them."""

FORMAT = "llmflow-dump"
# 2: index lines hold batches of rows (version 1: one entry a line, still read);
# 3: a statistics-mode repeat of a tensor holds no statistics of its own (``_share_repeat_stats``)
VERSION = 3
META_FILE = "llmflow_dump.json"
ENV_FILE = "env.json"
TOPOLOGY_FILE = "topology.json"
