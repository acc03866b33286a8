"""An lm-evaluation-harness model, ``batchmax``: any lm-eval task scored or generated through Batch-Max.

``BatchMaxLM`` (lm-eval 0.4.13 ``TemplateLM``) runs every request on ``core.engine``: its context is prefilled with the
method's own block schedule (BM evicts during the prompt), a scored continuation is teacher-forced token by token
through the same bounded cache, and the score is the sum of its float32 log-probabilities. One forward pass over
context + continuation, as ``--model hf`` computes it, would never evict (lm-eval issue #3298): here eviction reaches
the scores. Each request runs its own schedule on its unpadded prompt, so its result does not depend on the batch.

- ``loglikelihood``: contexts longest first; the choices of one context are admitted together and their prefill runs
  once (``Batching(share_prompts=True)``: exact, a slot's state after its prompt depends on the prompt only);
- ``loglikelihood_rolling``: lm-eval's rolling windows, each scored as above;
- ``generate_until``: continuous batching; a request stops at its first stop string (its slot frees at once) or
  at ``max_gen_toks``; the text is cut at the stop string as lm-eval's ``hf`` model cuts it.

``model_args`` (``--model_args key=value,...``): ``pretrained``, ``tokenizer``, ``method``, ``kv_max``, ``p``,
``rule``, ``dtype``, ``device``, ``batch_size`` (an int, or ``auto``: the most slots the planner fits in
``memory_budget``), ``max_batch_size``, ``memory_budget``, ``max_length``, ``tp_size``. A bad key or value is one
``ModelArgsError`` line before any weight loads; ``batchmax-lm-eval`` prints it and exits 2.

Parallel: under ``deepspeed``/``torchrun`` the ranks of one replica (``tp_size``, default the world) split the heads
and run the same requests in lock-step; replicas split the requests through lm-eval's ``rank``/``world_size``, and
only the first rank of the first replica reports.

lm-eval 0.4.13 discovers no outside model, so ``main`` (the ``batchmax-lm-eval`` console script) registers this one
and then runs lm-eval's own command line unchanged.
"""

from __future__ import annotations

import datetime
import logging
import os
import sys
import time
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import lm_eval.models  # noqa: F401 - lm-eval's own models register first: registering ours must not hide them
import torch
import torch.distributed as dist
from lm_eval import utils as lm_utils
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from lm_eval.models.utils import (
    handle_stop_sequences,
    normalize_gen_kwargs,
    postprocess_generated_text,
    resolve_max_length,
)
from tqdm import tqdm
from transformers import AutoTokenizer

from . import models, parallel
from .config import EMBEDDED_MODEL
from .core.engine import Engine
from .core.method import METHODS, Method, ranks_by_attention, serving_kv_max
from .core.requests import Batching, Request, RequestOutput, Sampling
from .eval import replicas
from .plan.planner import DTYPE_BYTES, ModelShape, max_slots, parse_bytes

logger = logging.getLogger(__name__)

DEFAULT_MAX_BATCH = 64  # the cap of batch_size=auto without max_batch_size (lm-eval's hf model uses 64 too)
CUDA_BUDGET_FRACTION = 0.9  # batch_size=auto on a GPU without memory_budget: this share of its memory
SAMPLING_KWARGS = ("do_sample", "temperature", "top_k", "top_p")


class ModelArgsError(ValueError):
    """A ``model_args`` key or value ``BatchMaxLM`` cannot run with (one line, naming it)."""


@dataclass(frozen=True)
class Settings:
    """``BatchMaxLM``'s validated ``model_args``."""

    pretrained: str = EMBEDDED_MODEL
    tokenizer: str | None = None
    method: str = "bm"
    kv_max: int | None = None
    p: int = 64
    rule: str = "paper"
    dtype: str = "auto"
    device: str | None = None
    batch_size: int | str = 1
    max_batch_size: int | None = None
    memory_budget: str | None = None
    max_length: int | None = None
    tp_size: int | None = None

    @classmethod
    def parse(cls, args: dict) -> Settings:
        """Settings from ``model_args`` (lm-eval has turned digits into ints); ``ModelArgsError`` names a bad one."""
        known = cls.__dataclass_fields__
        for key in args:
            if key not in known:
                raise ModelArgsError(f"model_args: unknown key {key!r} (known: {', '.join(known)})")
        s = cls(**{k: v for k, v in args.items() if v is not None})
        s.method_()  # the method's own checks, one line each
        for key in ("p", "max_batch_size", "max_length", "tp_size"):
            value = getattr(s, key)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
                raise ModelArgsError(f"model_args: {key} must be an integer >= 1, got {value!r}")
        if s.dtype not in ("auto", *DTYPE_BYTES):
            raise ModelArgsError(f"model_args: dtype must be auto or one of {', '.join(DTYPE_BYTES)}, got {s.dtype!r}")
        if s.slots_wanted() is None and not str(s.batch_size).startswith("auto"):
            raise ModelArgsError(f"model_args: batch_size must be an integer >= 1 or auto, got {s.batch_size!r}")
        if s.memory_budget is not None:
            try:
                parse_bytes(str(s.memory_budget))
            except ValueError as err:
                raise ModelArgsError(f"model_args: memory_budget: {err}") from None
        if s.device is not None and not (s.device == "cpu" or s.device.split(":")[0] == "cuda"):
            raise ModelArgsError(f"model_args: device must be cpu, cuda or cuda:N, got {s.device!r}")
        return s

    def method_(self) -> Method:
        """The ``Method`` these settings name (``kv_max`` defaults: ``core.method.serving_kv_max``, BM 512, ED 65)."""
        if self.method not in METHODS:
            raise ModelArgsError(f"model_args: method must be one of {', '.join(METHODS)}, got {self.method!r}")
        kv_max = self.kv_max if self.kv_max is not None else serving_kv_max(self.method)
        try:
            return Method(self.method, kv_max=kv_max, p=self.p, rule=self.rule)
        except ValueError as err:
            raise ModelArgsError(f"model_args: {err}") from None

    def slots_wanted(self) -> int | None:
        """``batch_size`` as an int (lm-eval's command line passes "8"), or None for ``auto``/``auto:N``."""
        b = self.batch_size  # "auto:N" (lm-eval's re-detection N times) is auto: the planner's size is exact
        if isinstance(b, str) and b.isdigit():
            b = int(b)
        return b if isinstance(b, int) and not isinstance(b, bool) and b >= 1 else None

    def fingerprint(self) -> str:
        """What a response depends on besides the request: part of every ``--use_cache`` file name."""
        m = self.method_()
        model = self.pretrained.strip("/").replace("/", "__").replace(":", "-")
        parts = [model, m.slug()] + ([] if m.held_kv_max is None else [f"kv{m.kv_max}"])  # slug: snap's window...
        parts += [f"p{m.p}"] if ranks_by_attention(m) else []  # BM's blocks, snap's decode eviction
        parts += [m.rule] if m.takes_rule else []
        return "batchmax-" + "-".join(parts + [self.dtype, f"len{self.max_length or 'model'}"])


@register_model("batchmax")
class BatchMaxLM(TemplateLM):
    """lm-eval model ``batchmax``: requests through Batch-Max's bounded cache (or FKV/ED), see the module doc."""

    _DEFAULT_MAX_LENGTH = 2048

    def __init__(self, **model_args):
        super().__init__()
        lm_device = model_args.pop("_lm_eval_device", None)
        s = Settings.parse(model_args)
        self.settings, self.method = s, s.method_()
        rank, world, local_rank = parallel.world_from_env()
        # several ranks: the set-up under one bound, each step named, and a watchdog from the first moment to this
        # process's end, so that no replica waits for a lost one, in our set-up or in lm-eval's own collectives
        # (eval.replicas.Setup, as the main job starts)
        setup = replicas.Setup(rank, world, parallel.SETUP_TIMEOUT_S)
        if setup.early is not None:
            setup.early[1].until_exit()
        config = self._read_config(s)
        heads = int(getattr(config, "num_key_value_heads", None) or config.num_attention_heads)
        tp = parallel.resolve_tp_size(s.tp_size, world, heads)
        try:
            parallel.check_tp_size(tp, world, heads)
        except ValueError as err:
            raise ModelArgsError(f"model_args: tp_size: {err}") from None
        note = parallel.layout_note(s.tp_size, world, heads)
        if note is not None and rank == 0:
            logger.warning("%s", note)
        try:
            device = parallel.resolve_device(s.device or lm_device, strict=s.device is not None)
        except ValueError as err:
            raise ModelArgsError(f"model_args: device: {err}") from None
        # each rank takes its local GPU (lm-eval's default cuda:0 would stack them on one)
        device = parallel.process_device(device, world, local_rank)
        if s.slots_wanted() is None and s.memory_budget is None and not device.startswith("cuda"):
            raise ModelArgsError("model_args: batch_size=auto on the CPU needs memory_budget (e.g. 8GiB)")
        self.layout = setup.join(tp, device)
        self._device = torch.device(device)
        try:
            self.dtype = models.resolve_dtype(s.dtype, str(self._device), config)
        except ValueError as err:
            raise ModelArgsError(f"model_args: dtype: {err}") from None
        with setup.step(f"loading the model {s.pretrained} and splitting it over {tp} ranks"):
            self._load(s, config)
        setup.done()
        self._rank, self._world_size = self.layout.replica, self.layout.dp
        self._dp_group = self._data_parallel_group()
        if self.layout.tp_rank > 0 and os.environ.get("LOCAL_RANK", "0") == "0":
            os.environ["LOCAL_RANK"] = str(self.layout.tp_rank)  # lm-eval reports where rank and LOCAL_RANK are 0
        self.batch_sizes: dict[int, int] = {}  # lm-eval copies these into its results ("batch_sizes")
        self.stats = defaultdict(float)
        logger.info(
            "batchmax: %s on %s (%s), %s",
            self.method.label(),
            self._device,
            self.dtype,
            f"world {self.layout.world} = dp {self.layout.dp} x tp {self.layout.tp}",
        )

    # -- construction ------------------------------------------------------------------------------------------------
    @classmethod
    def create_from_arg_string(cls, arg_string: str, additional_config: dict | None = None) -> BatchMaxLM:
        return cls.create_from_arg_obj(lm_utils.simple_parse_args_string(arg_string), additional_config)

    @classmethod
    def create_from_arg_obj(cls, arg_dict: dict, additional_config: dict | None = None) -> BatchMaxLM:
        """``model_args`` win over lm-eval's own ``--batch_size``/``--max_batch_size``/``--device`` (their
        defaults would otherwise override them); lm-eval's device is only a default."""
        extra = {k: v for k, v in (additional_config or {}).items() if v is not None and k not in arg_dict}
        if "device" in extra:
            extra["_lm_eval_device"] = extra.pop("device")
        return cls(**arg_dict, **extra)

    @staticmethod
    def _read_config(s: Settings):
        if s.pretrained.startswith(models.ARCH_PREFIX) and s.tokenizer is None:
            raise ModelArgsError(
                f"model_args: pretrained={s.pretrained} has random weights and no tokenizer: "
                f"name one with tokenizer=<model or folder>"
            )
        try:
            return models.read_config(s.pretrained)
        except ValueError as err:
            raise ModelArgsError(f"model_args: pretrained: {err}") from None

    def _load(self, s: Settings, config) -> None:
        self._model, tokenizer = models.load_on_ranks(s.pretrained, self.layout, self.dtype, str(self._device))
        if s.tokenizer is not None:
            tokenizer = AutoTokenizer.from_pretrained(models.model_path(s.tokenizer))
        tokenizer.padding_side = "left"
        self.tokenizer = tokenizer
        self.shape = ModelShape.from_config(config)
        self.tp_group = getattr(self._model, "batchmax_tp_group", None)

    def _data_parallel_group(self):
        """The replicas' group for lm-eval's gathers: this rank's peers (same TP rank) in every replica, on gloo."""
        if self.layout.dp == 1:
            return None
        group = None
        for t in range(self.layout.tp):
            g = dist.new_group(
                list(range(t, self.layout.world, self.layout.tp)),
                backend="gloo",
                timeout=datetime.timedelta(seconds=parallel.SETUP_TIMEOUT_S),
            )
            group = g if t == self.layout.tp_rank else group
        return group

    # -- what lm-eval reads --------------------------------------------------------------------------------------------
    @property
    def eot_token_id(self) -> int:
        return self.tokenizer.eos_token_id

    @property
    def prefix_token_id(self) -> int:
        bos = self.tokenizer.bos_token_id
        return bos if bos is not None else self.tokenizer.eos_token_id

    @property
    def max_length(self) -> int:
        if self.settings.max_length:
            return self.settings.max_length
        return resolve_max_length(self._model.config, self.tokenizer, default=self._DEFAULT_MAX_LENGTH)

    @property
    def max_gen_toks(self) -> int:
        return 256

    @property
    def tokenizer_name(self) -> str:
        return self.tokenizer.name_or_path.replace("/", "__")

    @property
    def model(self) -> torch.nn.Module:
        return self._model

    def get_model_info(self) -> dict:
        """Into lm-eval's ``results["config"]``: the method and what this run measured."""
        m = self.method
        wall = self.stats["prefill_s"] + self.stats["decode_s"]
        return {
            "method": m.name,
            "kv_max": m.kv_max,
            "p": m.p,
            "rule": m.rule,
            "method_label": m.label(),
            "memory_budget": self.settings.memory_budget,
            "model_dtype": self.dtype,
            "tp_size": self.layout.tp,
            "model_num_parameters": sum(t.numel() for t in self._model.parameters()),
            "batchmax": {
                **self.stats,
                "tokens_per_s": self.stats["tokens"] / wall if wall else 0.0,
                "requests_per_s": self.stats["requests"] / wall if wall else 0.0,
            },
        }

    def set_cache_hook(self, cache_hook) -> None:
        """lm-eval's response cache is keyed by the request alone: refuse a cache file that does not name this
        method, or FKV, ED and BM runs would read each other's answers (``batchmax-lm-eval`` names it)."""
        db = getattr(cache_hook, "dbdict", None)
        name = os.path.basename(getattr(db, "filename", "") or "")
        if db is not None and self.settings.fingerprint() not in name:
            raise ModelArgsError(
                f"use_cache: lm-eval's cache ignores model_args, so its file must name the method: "
                f"pass a path containing {self.settings.fingerprint()} (batchmax-lm-eval does)"
            )
        super().set_cache_hook(cache_hook)

    # -- distributed (replicas) --------------------------------------------------------------------------------------
    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        if self._dp_group is None:
            return tensor
        parts = [torch.zeros_like(tensor, device="cpu") for _ in range(self.layout.dp)]
        dist.all_gather(parts, tensor.cpu(), group=self._dp_group)
        return (
            torch.stack(parts).view(-1).to(tensor.device) if tensor.dim() == 0 else torch.cat(parts).to(tensor.device)
        )

    def gather_object(self, obj, dst: int = 0):
        if self._dp_group is None:
            return [obj]
        out = [None] * self.layout.dp if self.layout.replica == dst else None
        dist.gather_object(obj, out, dst=dist.get_global_rank(self._dp_group, dst), group=self._dp_group)
        return out

    def barrier(self) -> None:
        if self._dp_group is not None:
            dist.barrier(group=self._dp_group)

    # -- tokens ------------------------------------------------------------------------------------------------------
    def tok_encode(
        self, string: str, add_special_tokens: bool | None = None, left_truncate_len: int | None = None, **kwargs
    ) -> list[int]:
        """As lm-eval's ``hf`` model: the tokenizer's own special tokens unless told, none before a leading BOS."""
        special = {} if add_special_tokens is None else {"add_special_tokens": add_special_tokens}
        bos = self.tokenizer.bos_token
        if add_special_tokens is None and bos and string.startswith(bos):
            special = {"add_special_tokens": False}
        ids = self.tokenizer.encode(string, **special)
        return ids[-left_truncate_len:] if left_truncate_len else ids

    def tok_decode(self, tokens, skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(tokens, skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, chat_history: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        return self.tokenizer.apply_chat_template(
            chat_history,
            tokenize=False,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=not add_generation_prompt,
        )

    # -- running -----------------------------------------------------------------------------------------------------
    def _slots(self, requests: Sequence[Request]) -> int:
        """The batch (pool slots) for ``requests``: ``batch_size``, or with ``auto`` the most slots the planner
        fits in the memory budget for the longest of them (never a trial at ``max_length``)."""
        wanted = self.settings.slots_wanted()
        if wanted is not None:
            slots = wanted
        else:
            budget = self._budget()
            longest = max(len(r.input_ids) for r in requests)
            new = max(r.max_new_tokens for r in requests)
            slots = max_slots(
                budget,
                self.shape,
                self.method,
                longest,
                new,
                tp=self.layout.tp,
                dtype=self.dtype,
                limit=self.settings.max_batch_size or DEFAULT_MAX_BATCH,
            )
            if slots == 0:
                raise ModelArgsError(
                    f"model_args: memory_budget {self.settings.memory_budget or budget} cannot hold "
                    f"the weights and one {longest}-token request under {self.method.label()}"
                )
        slots = min(slots, len(requests))
        self.batch_sizes[len(self.batch_sizes)] = slots
        return slots

    def _budget(self) -> int:
        if self.settings.memory_budget is not None:
            return parse_bytes(str(self.settings.memory_budget))
        return int(torch.cuda.get_device_properties(self._device).total_memory * CUDA_BUDGET_FRACTION)

    def _serve(
        self,
        requests: list[Request],
        slots: int,
        on_finish: Callable[[int, RequestOutput], None],
        sampling: Sampling,
        batching: Batching,
    ) -> list[RequestOutput]:
        """``core.engine.Engine`` on this replica's model (the tokenizer's pad id in ``sampling``; ``on_finish(i,
        output)`` as request i ends); the run's time and tokens go into ``stats``."""
        start = time.perf_counter()
        engine = Engine(self._model, self.method, slots, tp_group=self.tp_group, batching=batching)
        sampling = replace(sampling, pad_token_id=self.tokenizer.pad_token_id)
        done = engine.run(requests, sampling, on_finish=on_finish)
        self.stats["wall_s"] += time.perf_counter() - start
        self.stats["prefill_s"] += done.prefill_s
        self.stats["decode_s"] += done.decode_s
        self.stats["requests"] += len(requests)
        self.stats["tokens"] += sum(len(r.input_ids) for r in requests) + done.generated_tokens
        self.stats["peak_kv_bytes"] = max(self.stats["peak_kv_bytes"], done.peak_kv_bytes)
        self.stats["slots"] = max(self.stats["slots"], slots)
        return done.outputs

    def _bar(self, total: int, desc: str, disable: bool) -> tqdm:
        quiet = disable or self.layout.rank != 0
        return tqdm(total=total, desc=desc, disable=quiet)

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs) -> list[tuple[float, bool]]:
        """(sum of the continuation's log-probabilities, whether it is the greedy one) per (key, context ids,
        continuation ids), in request order. Context and continuation are cut on the left to ``max_length + 1``
        tokens, as lm-eval's ``hf`` model cuts them."""
        items = []
        for _, context, continuation in requests:
            if not continuation or len(continuation) > self.max_length:
                raise ValueError(
                    f"a continuation of {len(continuation)} tokens cannot be scored with max_length {self.max_length}"
                )
            whole = (list(context) + list(continuation))[-(self.max_length + 1) :]
            items.append((tuple(whole[: len(whole) - len(continuation)]), tuple(continuation)))
        results: dict[tuple, tuple[float, bool]] = {}
        unique = list(dict.fromkeys(items))  # each (prompt, continuation) is scored once
        by_prompt: dict[tuple, list[tuple]] = defaultdict(list)
        for item in unique:
            by_prompt[item[0]].append(item)
        # Longest first (lm-eval's order: a batch that does not fit shows at once); one prompt's choices together.
        groups = sorted(by_prompt.values(), key=lambda g: (-len(g[0][0]) - max(len(c) for _, c in g), g[0][0]))
        if not unique:
            return []
        slots = self._slots([Request(p, len(c)) for p, c in unique])
        bar = self._bar(len(unique), "batchmax loglikelihood", disable_tqdm)
        for wave in _waves(groups, slots):
            reqs = [Request(p, len(c), continuation=c) for p, c in wave]
            outs = self._serve(
                reqs,
                min(slots, len(reqs)),
                lambda i, out: bar.update(1),
                Sampling(ignore_eos=True),
                Batching(share_prompts=True),
            )
            for (p, c), out in zip(wave, outs):
                results[(p, c)] = (float(sum(out.logprobs)), list(out.tokens) == list(c))
        bar.close()
        answers = [results[item] for item in items]
        for (key, _, _), answer in zip(requests, answers):
            if key is not None:
                self.cache_hook.add_partial("loglikelihood", key, answer)
        return answers

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        """Each string's log-likelihood over lm-eval's disjoint rolling windows of ``max_length`` tokens."""
        windows, owner = [], []
        for i, (string,) in enumerate(req.args for req in requests):
            tokens = self.tok_encode(string)
            for context, continuation in map(
                lm_utils.make_disjoint_window,
                lm_utils.get_rolling_token_windows(
                    token_list=tokens, prefix_token=self.prefix_token_id, max_seq_len=self.max_length, context_len=1
                ),
            ):
                windows.append((None, context, continuation))
                owner.append(i)
        scores = self._loglikelihood_tokens(windows, disable_tqdm=disable_tqdm)
        totals = [0.0] * len(requests)
        for i, (logprob, _) in zip(owner, scores):
            totals[i] += logprob
        for req, total in zip(requests, totals):
            self.cache_hook.add_partial("loglikelihood_rolling", req.args, total)
        return totals

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        """Greedy (or sampled) continuations, each cut at its first stop string; in request order."""
        results: list[str | None] = [None] * len(requests)
        by_kwargs: dict[str, list[int]] = defaultdict(list)
        for i, req in enumerate(requests):
            by_kwargs[repr(sorted(req.args[1].items()))].append(i)
        bar = self._bar(len(requests), "batchmax generate_until", disable_tqdm)

        def finished(i: int, text: str) -> None:  # each answer cached as it ends: a run resumes per request
            results[i] = text
            self.cache_hook.add_partial("generate_until", requests[i].args, text)
            bar.update(1)

        for indices in by_kwargs.values():
            self._generate(requests, indices, finished)
        bar.close()
        return results

    def _generate(self, requests, indices: list[int], finished: Callable[[int, str], None]) -> None:
        """One engine run for requests that share their generation settings; ``finished(index, text)`` hears each
        request's text (``indices``' entry) as it ends."""
        kwargs = normalize_gen_kwargs(dict(requests[indices[0]].args[1]), self.max_gen_toks)
        eos = self.tok_decode([self.eot_token_id], skip_special_tokens=False)
        until = handle_stop_sequences(kwargs.pop("until", None), eos=eos)
        max_gen = int(kwargs.pop("max_gen_toks"))
        sampling = _sampling(kwargs)
        if max_gen >= self.max_length:
            raise ValueError(f"max_gen_toks {max_gen} leaves no room for a prompt in max_length {self.max_length}")
        prompts = [self.tok_encode(requests[i].args[0], left_truncate_len=self.max_length - max_gen) for i in indices]
        order = sorted(range(len(indices)), key=lambda j: -len(prompts[j]))  # longest first
        reqs = [Request(prompts[j], max_gen, seed=j) for j in order]
        window = max((len(self.tokenizer.encode(s, add_special_tokens=False)) for s in until), default=0) + 2

        def stop(i: int, tokens: list[int]) -> bool:  # the request's text so far holds a stop string
            text = self.tok_decode(tokens[-window:], skip_special_tokens=False)
            return any(s and s in text for s in until)

        chosen = Sampling(eos_token_id=self.eot_token_id, stop=stop, **sampling)

        def done(k: int, out: RequestOutput) -> None:  # request k of ``reqs`` is ``indices[order[k]]``
            text = postprocess_generated_text(self.tok_decode(out.tokens), stop=until, think_end_token=None)
            finished(indices[order[k]], text)

        self._serve(reqs, self._slots(reqs), done, chosen, Batching())


def _sampling(kwargs: dict) -> dict:
    """The ``Sampling`` arguments from lm-eval's normalised generation kwargs (greedy unless ``do_sample``)."""
    unknown = sorted(k for k in kwargs if k not in SAMPLING_KWARGS)
    if unknown:
        raise ValueError(
            f"gen_kwargs: batchmax does not support {', '.join(unknown)} (it takes until, max_gen_toks, "
            f"{', '.join(SAMPLING_KWARGS)})"
        )
    if not kwargs.get("do_sample"):
        return {}
    return {
        "do_sample": True,
        "temperature": float(kwargs.get("temperature") or 1.0),
        "top_k": int(kwargs.get("top_k") or 0),
        "top_p": float(kwargs.get("top_p") or 1.0),
    }


def _waves(groups: list[list[tuple]], slots: int) -> list[list[tuple]]:
    """Consecutive groups (one prompt's continuations each) packed into waves of at most ``slots`` requests, a
    group kept whole when it fits: its requests enter their slots together and share one prefill."""
    waves: list[list[tuple]] = [[]]
    for group in groups:
        for k in range(0, len(group), slots):
            part = group[k : k + slots]
            if len(waves[-1]) + len(part) > slots:
                waves.append([])
            waves[-1].extend(part)
    return [w for w in waves if w]


def cache_path(use_cache: str, model_args: str) -> str:
    """``--use_cache PATH`` for a ``batchmax`` run: PATH with the method's fingerprint appended, so that runs of
    different methods never share lm-eval's cache file."""
    settings = Settings.parse(lm_utils.simple_parse_args_string(model_args))
    return f"{use_cache}.{settings.fingerprint()}"


def _flag(argv: list[str], flag: str) -> str | None:
    """The value of ``flag`` in ``argv`` (``--flag V`` or ``--flag=V``), else None."""
    for k, arg in enumerate(argv):
        if arg == flag and k + 1 < len(argv):
            return argv[k + 1]
        if arg.startswith(flag + "="):
            return arg.split("=", 1)[1]
    return None


def _check_model_args(argv: list[str]) -> None:
    """For ``--model batchmax``: the settings and the model's configuration, checked before lm-eval indexes its
    tasks (tens of seconds) or loads anything; a ``ModelArgsError`` names the bad one."""
    if _flag(argv, "--model") == "batchmax":
        settings = Settings.parse(lm_utils.simple_parse_args_string(_flag(argv, "--model_args") or ""))
        BatchMaxLM._read_config(settings)


def _rewrite_use_cache(argv: list[str]) -> list[str]:
    """``--use_cache PATH`` -> PATH.<fingerprint> when the model is ``batchmax``."""
    if _flag(argv, "--model") != "batchmax" or _flag(argv, "--use_cache") is None:
        return argv
    path = cache_path(_flag(argv, "--use_cache"), _flag(argv, "--model_args") or "")
    out = []
    skip = False
    for arg in argv:
        if skip:
            skip = False
            continue
        if arg == "--use_cache":
            out += [arg, path]
            skip = True
        elif arg.startswith("--use_cache="):
            out.append(f"--use_cache={path}")
        else:
            out.append(arg)
    return out


def _launcher_args(argv: list[str]) -> list[str]:
    """``argv`` without the ``--local_rank N`` the ``deepspeed`` launcher adds (lm-eval's parser rejects it); the
    rank goes to ``LOCAL_RANK`` when the launcher has not set it."""
    out, k = [], 0
    while k < len(argv):
        arg = argv[k]
        if arg == "--local_rank" and k + 1 < len(argv):
            os.environ.setdefault("LOCAL_RANK", argv[k + 1])
            k += 2
            continue
        if arg.startswith("--local_rank="):
            os.environ.setdefault("LOCAL_RANK", arg.split("=", 1)[1])
        else:
            out.append(arg)
        k += 1
    return out


def main(argv: Sequence[str] | None = None) -> int:
    """``batchmax-lm-eval``: lm-eval's own command line with the ``batchmax`` model registered; a bad
    ``model_args`` is one ``error:`` line and exit 2."""
    from lm_eval.__main__ import cli_evaluate

    args = _launcher_args(list(sys.argv[1:] if argv is None else argv))
    try:
        _check_model_args(args)
        sys.argv = [sys.argv[0], *_rewrite_use_cache(args)]
        cli_evaluate()
    except ModelArgsError as err:
        if parallel.world_from_env()[0] == 0:  # every rank finds it: said once
            print(f"error: {' '.join(str(err).split())}", file=sys.stderr, flush=True)
        return 2
    return 0
