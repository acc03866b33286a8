"""Evaluation apart from the library: tasks and metrics, the one run path, result files and reports.

``tasks`` (samples and prompts), ``metrics``, ``run`` (a resumable run over a task's samples; its parts
``context``, ``batches``, ``generation``, ``collectives``, ``oom``, ``summary``), ``procedures`` (the paper's b0
trials and the auto-tuner's runs), ``results`` (run folders, resuming), ``report`` (Markdown, CSV, plots),
``files`` (atomic writes).
"""
