"""The paper's algorithms on an unchanged Hugging Face model; imports nothing else from batchmax_tp.

``method`` (what to keep; ``rules``: how BM ranks pairs) -> ``schedule`` (each request's passes) -> ``step`` (one
pass, described) -> the pools (``slots``: what every pool shares; ``bounded``, ``layered``, ``dense``: each kind's
storage, descriptions and evictions; ``pool``: the method's) -> ``attention`` (the "batchmax" attention: reads the
description and the pool's storage, writes the pairs, feeds the scores; ``probe``, ``snap``, ``workspace`` beside
it) -> ``scheduler`` and ``replay`` -> ``requests`` (a run's inputs and outputs) -> ``engine`` (``Engine``: a run,
one ``step`` per pass); ``hf_cache`` (HF generate's drop-in: each of HF's forwards described as a pass over a pool
and run by ``attention``) on top.
"""
