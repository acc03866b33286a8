"""Run configuration in parts: layered defaults -> YAML (``--config FILE``) -> CLI flags.

The keys stay flat (YAML ``batch_size``, flag ``--batch-size``); the code reads them by concern, one small validated
dataclass per part:

=============== ======================================================================================
``cfg.model``   :class:`ModelConfig`: ``model`` (``.name``), ``dtype``, ``device``
``cfg.data``    :class:`DataConfig`: ``task``, ``data`` (``.path``), ``num_samples``, shots, cutting, metric
``cfg.generation`` :class:`GenerationConfig`: ``max_new_tokens``, EOS, sampling, ``seed``
``cfg.sweep``   :class:`SweepConfig`: the runs -- ``methods``/``runs``, ``rule``, ``kv_max``, ``p``, batching
``cfg.memory``  :class:`MemoryConfig`: ``memory_budget`` (``.budget``), ``procedure``, ``kv_values``, ``target``
``cfg.parallel`` :class:`ParallelConfig`: ``tp_size``, ``dp_size``, ``setup_timeout``
``cfg.output``  :class:`OutputConfig`: ``out`` (``.dir``), ``log_level``
=============== ======================================================================================

Each field's metadata (:class:`Setting`) holds its YAML key, its kind (the type a YAML value must have and how its
flag's text is read), its help and its limits: the parts check themselves from it, and :func:`build_parser` makes
the flags from it. Every problem is a :class:`ConfigError` with a one-line message that starts with the offending
key, e.g. ``kv_max: kv_max must be > p for method 'bm', got kv_max=64 p=64``.

The job: the same-memory comparison (the "main job", ``RunConfig.main_job``) runs unless the configuration lists its
runs itself -- a ``methods`` (``method``), ``batch_size``, ``kv_max``, ``runs`` or ``procedure`` given in the YAML or
as a flag (:data:`LISTING_KEYS`) -- or sets ``same_memory: false``; ``same_memory: true`` forces it, and with it
``methods`` chooses among the main job's methods (``fkv`` with any of ``ed``, ``bm``, ``snap``).

Validation needs only torch-free modules (``core.method``, ``core.rules``, ``plan``, ``config.tasks``), so a bad
setting is reported in a fraction of a second, before torch or transformers load; nothing here loads a model or
writes a file.

The package, by concern: ``settings`` (:class:`ConfigError`, :class:`Kind`, :class:`Setting`, the base
:class:`Part`), ``parts`` (model, data, generation, parallel, output), ``sweep`` (:class:`SweepConfig` and ``runs``
entries), ``memory`` (:class:`MemoryConfig`), ``run`` (:class:`RunConfig`, YAML) and ``parser`` (the flags).
"""

from ..embedded import EMBEDDED_MODEL  # the default model
from .memory import PROCEDURES, MemoryConfig
from .parser import build_parser, parse_args
from .parts import DTYPES, LOG_LEVELS, DataConfig, GenerationConfig, ModelConfig, OutputConfig, ParallelConfig
from .run import LISTING_KEYS, RunConfig, load_yaml
from .settings import ConfigError
from .sweep import RUN_KEYS, SweepConfig
from .tasks import METRICS, TASK_NAMES

__all__ = [
    "ConfigError",
    "DataConfig",
    "EMBEDDED_MODEL",
    "GenerationConfig",
    "LISTING_KEYS",
    "MemoryConfig",
    "ModelConfig",
    "OutputConfig",
    "ParallelConfig",
    "RunConfig",
    "SweepConfig",
    "DTYPES",
    "LOG_LEVELS",
    "METRICS",
    "PROCEDURES",
    "RUN_KEYS",
    "TASK_NAMES",
    "build_parser",
    "load_yaml",
    "parse_args",
]
