"""Tensor parallelism: DeepSpeed inference AutoTP applied to an unchanged HF model, from any launcher.

AutoTP splits attention heads (and MLP columns) across the ranks of a tensor-parallel group. The Batch-Max cache
sizes its buffers from the key tensors it receives, so each rank holds and evicts only its own KV heads: eviction
needs no communication. Every rank runs the same schedule (it depends only on host integers derived from the
shared inputs), so the all-reduces AutoTP inserts stay in lock-step.

Launchers: ``deepspeed`` (env + ``--local_rank``), ``torchrun`` (env), MPI (``mpirun``/``mpiexec``: DeepSpeed's
MPI discovery through mpi4py, which also finds the master address) and SLURM (``srun``: SLURM_PROCID/
SLURM_NTASKS/SLURM_LOCALID mapped to RANK/WORLD_SIZE/LOCAL_RANK when those are absent). A plain ``python`` run
is a world of one.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)

# Collective timeouts by phase. Set-up (checkpoint loading, AutoTP slicing, the first meetings) may take many
# minutes on shared storage, so the default group waits long; generation runs on the tensor-parallel groups, which
# wait at most GENERATION_TIMEOUT_S, so a dead or stuck rank still ends the job within a minute.
SETUP_TIMEOUT_S = 1800
GENERATION_TIMEOUT_S = 60


@dataclass(frozen=True)
class Layout:
    """Where this process sits: ``world = dp * tp``; replica r owns ranks ``[r*tp, (r+1)*tp)``."""

    rank: int = 0
    world: int = 1
    local_rank: int = 0
    tp: int = 1

    @property
    def dp(self) -> int:
        return self.world // self.tp

    @property
    def replica(self) -> int:
        return self.rank // self.tp

    @property
    def tp_rank(self) -> int:
        return self.rank % self.tp

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def launcher_env() -> dict[str, str]:
    """RANK/WORLD_SIZE/LOCAL_RANK as set by deepspeed/torchrun, else mapped from SLURM or MPI variables."""
    env = {}
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        return env
    for ours, theirs in (
        ("RANK", ("SLURM_PROCID", "OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK")),
        ("WORLD_SIZE", ("SLURM_NTASKS", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE")),
        ("LOCAL_RANK", ("SLURM_LOCALID", "OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID", "PMI_LOCAL_RANK")),
    ):
        for name in theirs:
            if name in os.environ:
                env[ours] = os.environ[name]
                break
    return env


def world_from_env() -> tuple[int, int, int]:
    """(rank, world, local_rank) the launcher announced, without initialising anything."""
    env = {**os.environ, **launcher_env()}
    return int(env.get("RANK", 0)), int(env.get("WORLD_SIZE", 1)), int(env.get("LOCAL_RANK", 0))


def resolve_tp_size(tp_size: int | None, world: int, num_kv_heads: int) -> int:
    """``tp_size`` null: every rank of the world splits one model (DeepSpeed inference's convention), heads divided
    over the processes ``deepspeed --num_gpus N`` or ``torchrun --nproc_per_node N`` starts, where the model's KV
    heads allow it (every rank needs one); otherwise the largest size that divides the world and does not exceed
    the KV heads, the rest of the world as data-parallel replicas (:func:`layout_note` says so). A given
    ``tp_size`` is returned as it is (:func:`check_tp_size` judges it)."""
    if tp_size is not None:
        return tp_size
    return max(k for k in range(1, min(world, max(num_kv_heads, 1)) + 1) if world % k == 0)


def layout_note(tp_size: int | None, world: int, num_kv_heads: int) -> str | None:
    """The one line rank 0 logs when a null ``tp_size`` could not split the model over the whole world (None
    otherwise)."""
    tp = resolve_tp_size(tp_size, world, num_kv_heads)
    if tp_size is not None or tp == world:
        return None
    return (
        f"tp_size: {world} processes cannot split the model's {num_kv_heads} KV heads (every rank needs one): "
        f"running {world // tp} data-parallel replicas of tp_size {tp} (--tp-size K chooses)"
    )


def check_tp_size(tp: int, world: int, num_kv_heads: int) -> None:
    """Reject layouts AutoTP cannot serve, before any weight is loaded."""
    if tp < 1:
        raise ValueError(f"tp_size must be >= 1, got {tp}")
    if world % tp:
        raise ValueError(f"world size {world} is not a multiple of tp_size {tp}")
    if tp > num_kv_heads:
        raise ValueError(
            f"tp_size {tp} exceeds the model's {num_kv_heads} KV heads: every rank needs one (without --tp-size "
            f"the largest size that fits runs, the rest as data-parallel replicas)"
        )


def resolve_device(requested: str | None, *, strict: bool = True) -> str:
    """The device to run on, one rule for the job and the lm-eval model: ``auto`` (or None) is CUDA where present,
    else the CPU. A CUDA device without CUDA is a ValueError when ``strict`` (the user named it), else the CPU with a
    warning (lm-eval's default ``cuda:0``, as lm-eval's own ``hf`` model does)."""
    if requested is None or requested == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if requested.startswith("cuda") and not torch.cuda.is_available():
        if strict:
            raise ValueError(f"{requested} requested but CUDA is not available")
        logger.warning("device %s: CUDA is not available, running on the CPU", requested)
        return "cpu"
    return requested


def process_device(device: str, world: int, local_rank: int) -> str:
    """This process's device: one process runs on ``device`` as given; several take each its own GPU (the local
    rank's, :func:`local_device`: a ``cuda:N`` that a default named is dropped, or every rank would stack on N)."""
    if world == 1:
        return device
    return local_device("cuda" if device.startswith("cuda") else device, local_rank)


def local_device(device: str, local_rank: int) -> str:
    """The device of this process: on CUDA the launcher's local rank picks the GPU, modulo the GPUs it can see
    (one task may see all of a node's GPUs, or only its own under ``srun --gpus-per-task=1``)."""
    if not device.startswith("cuda"):
        return device
    if ":" in device:
        return device
    return f"cuda:{local_rank % max(1, torch.cuda.device_count())}"


def _mpi_launch() -> bool:
    """Started by mpirun/mpiexec (and not by a launcher that already set RANK)."""
    return (
        "RANK" not in os.environ
        and "SLURM_PROCID" not in os.environ
        and any(v in os.environ for v in ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK"))
    )


def rendezvous_env() -> bool:
    """Set RANK/WORLD_SIZE/LOCAL_RANK and MASTER_ADDR/MASTER_PORT from the launcher (idempotent), before any process
    group exists; returns whether the store's address is known now (under MPI it is found by DeepSpeed's discovery,
    inside ``init_distributed``). ValueError: a multi-node SLURM job without MASTER_ADDR."""
    if _mpi_launch():
        return False
    os.environ.update(launcher_env())
    if "MASTER_ADDR" not in os.environ:
        if int(os.environ.get("SLURM_NNODES", "1")) > 1:
            raise ValueError(
                "MASTER_ADDR is not set on a multi-node SLURM job: export MASTER_ADDR=$(scontrol show "
                "hostnames $SLURM_JOB_NODELIST | head -n 1) before srun"
            )
        os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ.setdefault("MASTER_PORT", "29500")
    return True


def rendezvous_step(device: str) -> str:
    """What :func:`init_distributed` waits in, for a line that names it (``eval.replicas.SetupBound``)."""
    backend = "nccl" if device.startswith("cuda") else "gloo"
    where = f"{os.environ.get('MASTER_ADDR', 'MPI discovery')}:{os.environ.get('MASTER_PORT', '29500')}"
    return f"the process group's rendezvous and DeepSpeed's set-up ({backend}, {where})"


def init_distributed(tp: int, device: str = "cpu", timeout_s: int = SETUP_TIMEOUT_S) -> Layout:
    """Initialise torch.distributed (through DeepSpeed) from whichever launcher started us; returns the layout.

    World of one: nothing is initialised. CPU uses gloo, CUDA nccl; on CUDA the process binds to its local GPU.
    ``timeout_s`` bounds the default group's collectives (set-up: loading, the meetings around it); the model's
    tensor-parallel groups get ``GENERATION_TIMEOUT_S`` (:class:`ModelParallelUnit`).
    - deepspeed/torchrun: their RANK/WORLD_SIZE/LOCAL_RANK/MASTER_* are used as they are;
    - MPI: DeepSpeed's MPI discovery (mpi4py) sets them, MASTER_ADDR being rank 0's address (multi-node safe);
      MASTER_PORT, if set, is kept;
    - SLURM: SLURM_PROCID/SLURM_NTASKS/SLURM_LOCALID are mapped; on several nodes MASTER_ADDR must be set (the
      sbatch recipe does), on one node it defaults to 127.0.0.1.
    """
    rank, world, local_rank = world_from_env()
    if world == 1:
        return Layout(tp=tp)
    import deepspeed  # only multi-process runs need it (seconds to import; absent on some GPU images)

    port = int(os.environ.get("MASTER_PORT", "29500"))
    rendezvous_env()
    if device.startswith("cuda"):
        torch.cuda.set_device(torch.device(local_device(device, local_rank)))
    if not dist.is_initialized():
        skip_unused_ops()
        for lock, age in extension_locks():
            logger.warning(
                "rank %d: %s (%.0f s old) is the lock of a torch extension build that is running or was killed; "
                "this job builds none, but a job that builds that extension waits until the file is gone: delete it "
                "when no build is running",
                rank,
                lock,
                age,
            )
        deepspeed.init_distributed(
            dist_backend="nccl" if device.startswith("cuda") else "gloo",
            auto_mpi_discovery=True,
            distributed_port=port,
            timeout=datetime.timedelta(seconds=timeout_s),
            verbose=False,
        )
    local_rank = int(os.environ.get("LOCAL_RANK", local_rank))
    layout = Layout(rank=dist.get_rank(), world=dist.get_world_size(), local_rank=local_rank, tp=tp)
    if layout.world % tp:
        raise ValueError(f"world size {layout.world} is not a multiple of tp_size {tp}")
    if not layout.is_main:
        logging.getLogger("batchmax_tp").setLevel(logging.WARNING)
    return layout


#: DeepSpeed ops a job would JIT-build while it initialises and never uses: its CPU shared-memory all-reduce, which
#: ``deepspeed.init_distributed`` builds (~1 min on a fresh machine, under a lock file that a killed build leaves
#: behind for every later job to wait on) and whose kernel segfaults on our CPU machines. Without it AutoTP's
#: ``inference_all_reduce`` is ``torch.distributed.all_reduce`` (gloo on CPU, NCCL on CUDA).
UNUSED_OPS = ("deepspeed_shm_comm",)


def skip_unused_ops() -> None:
    """Mark :data:`UNUSED_OPS` incompatible, so DeepSpeed neither builds nor loads them (its ``build_shm_op`` returns
    None for an op it finds incompatible); no job builds a DeepSpeed op."""
    import deepspeed.ops

    deepspeed.ops.__compatible_ops__.update(dict.fromkeys(UNUSED_OPS, False))


def extension_locks(root: str | os.PathLike[str] | None = None) -> list[tuple[Path, float]]:
    """The lock files of torch extension builds (``<root>/<extension>/lock``; root: ``TORCH_EXTENSIONS_DIR`` or
    torch's default folder) with their ages in seconds. A killed build leaves its lock behind, and every later
    build of that extension waits on it forever (``torch.utils.file_baton.FileBaton.wait``)."""
    if root is None:
        root = os.environ.get("TORCH_EXTENSIONS_DIR")
        if root is None:
            from torch.utils.cpp_extension import get_default_build_root

            root = get_default_build_root()
    now, found = time.time(), []
    for lock in sorted(Path(root).glob("*/lock")):
        with contextlib.suppress(OSError):  # removed meanwhile: a build that just finished
            found.append((lock, now - lock.stat().st_mtime))
    return found


class ModelParallelUnit:
    """The ``mpu`` DeepSpeed asks for: this rank's TP group (its replica) and DP group (same TP rank, all replicas).

    Every rank must construct it (``new_group`` is collective); ranks of replica r are ``[r*tp, (r+1)*tp)``. Both
    groups carry the model's collectives during generation, so they wait at most ``timeout_s``.
    """

    def __init__(self, layout: Layout, timeout_s: int = GENERATION_TIMEOUT_S):
        self.layout = layout
        timeout = datetime.timedelta(seconds=timeout_s)
        for r in range(layout.dp):
            group = dist.new_group(list(range(r * layout.tp, (r + 1) * layout.tp)), timeout=timeout)
            if r == layout.replica:
                self.tp_group = group
        for t in range(layout.tp):
            group = dist.new_group(list(range(t, layout.world, layout.tp)), timeout=timeout)
            if t == layout.tp_rank:
                self.dp_group = group

    def get_model_parallel_group(self):
        return self.tp_group

    def get_model_parallel_rank(self) -> int:
        return self.layout.tp_rank

    def get_model_parallel_world_size(self) -> int:
        return self.layout.tp

    def get_data_parallel_group(self):
        return self.dp_group

    # The data-parallel group holds this rank's heads in every replica: its rank is the replica, its size dp.
    def get_data_parallel_rank(self) -> int:
        return dist.get_rank(group=self.dp_group)

    def get_data_parallel_world_size(self) -> int:
        return dist.get_world_size(group=self.dp_group)


class LocalHeadsConfig:
    """A model config seen through one rank's share of the heads: ``num_attention_heads`` and
    ``num_key_value_heads`` are the rank's, everything else (``_attn_implementation`` included, which the engine
    switches on the model's own config) reads through to the shared config."""

    def __init__(self, base, num_attention_heads: int, num_key_value_heads: int, head_dim: int):
        self.__dict__.update(
            _base=base,
            num_attention_heads=num_attention_heads,
            num_key_value_heads=num_key_value_heads,
            head_dim=head_dim,
        )

    def __getattr__(self, name: str):
        if name == "_base":  # not set yet (copy/unpickle): no recursion
            raise AttributeError(name)
        return getattr(self._base, name)


def localise_head_counts(model: torch.nn.Module) -> int:
    """Give every attention module whose forward reads the GLOBAL head count from ``self.config`` a config with its
    rank-local counts; returns how many modules were changed.

    AutoTP slices the projections and rewrites head-count attributes of the modules themselves
    (``num_key_value_heads``), but ``Phi3Attention`` splits its fused ``qkv_proj`` output at
    ``config.num_attention_heads * head_dim``: after sharding that offset runs past the local query width and the
    value slice comes out empty. The local query heads follow from the local KV heads (AutoTP keeps whole GQA
    groups on a rank). So only Phi-3/3.5 modules are changed: Llama, Mistral and Qwen2 attention modules have no
    ``num_key_value_heads`` attribute and read no head count from the config in their forward.
    """
    changed = 0
    for module in model.modules():
        config = getattr(module, "config", None)
        local_kv = getattr(module, "num_key_value_heads", None)
        if (
            config is not None
            and isinstance(local_kv, int)
            and hasattr(config, "num_attention_heads")
            and not isinstance(config, LocalHeadsConfig)
            and local_kv < (getattr(config, "num_key_value_heads", None) or config.num_attention_heads)
        ):
            total_kv = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
            groups = config.num_attention_heads // total_kv
            head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
            module.config = LocalHeadsConfig(config, local_kv * groups, local_kv, head_dim)
            changed += 1
    return changed


def apply_tensor_parallel(
    model: torch.nn.Module, layout: Layout, dtype: torch.dtype, device: str | None = None
) -> torch.nn.Module:
    """Split ``model``'s heads over this replica's TP group with AutoTP (no kernel injection); returns the model.

    Under tensor parallelism the model should arrive on the host (CPU): AutoTP slices each weight there and moves
    only this rank's shard to its accelerator, so no rank ever holds the whole model there; the rest (embeddings,
    norms) follows to ``device``. With ``tp == 1`` the model is returned as it is.
    """
    if layout.tp == 1:
        return model
    import deepspeed

    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    check_tp_size(layout.tp, layout.world, getattr(config, "num_key_value_heads", None) or config.num_attention_heads)
    skip_unused_ops()  # DeepSpeed initialises its communication here if the process group came from elsewhere
    mpu = ModelParallelUnit(layout)
    # DeepSpeed reads the group from ``mpu`` in its engine and from ``tp_group`` when slicing layers: pass both.
    engine = deepspeed.init_inference(
        model,
        tensor_parallel={"tp_size": layout.tp, "mpu": mpu, "tp_group": mpu.tp_group},
        dtype=dtype,
        replace_with_kernel_inject=False,
    )
    model = engine.module
    model.batchmax_tp_group = mpu.tp_group  # for continuous batching's token broadcast and schedule checks
    changed = localise_head_counts(model)
    logger.debug("tensor parallel: %d attention modules given their local head counts", changed)
    return model if device is None else model.to(device)
