"""The paper's algorithms on an unchanged Hugging Face model; imports nothing else from batchmax_tp.

``method`` (what to keep; ``rules``: how BM ranks pairs) -> ``schedule`` (each request's passes) -> ``step`` (one
pass, described) -> ``pool`` (the bounded slots; evicts) -> ``attention`` (the "batchmax" attention: reads the
description, writes the pool, feeds the scores; ``probe``, ``snap``, ``workspace`` beside it) -> ``scheduler`` and
``replay`` -> ``serve`` (the pass loop) -> ``engine`` (``Engine``, ``generate``); ``hf_cache`` (HF generate's
drop-in: each of HF's forwards described as a pass over a pool and run by ``attention``) on top.
"""
