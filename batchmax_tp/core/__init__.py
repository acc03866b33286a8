"""The paper's algorithms on an unchanged Hugging Face model; imports nothing else from batchmax_tp.

``method`` (what to keep) -> ``rules`` (how BM ranks pairs) -> ``schedule`` (the block/step plan) -> ``cache``
(the bounded cache) -> ``attention`` (the "batchmax" attention that feeds the scores) -> ``engine`` (generate);
``baseline`` (FKV and ED on the model's own attention) and ``workspace`` (bytes each attention call allocates).
"""
