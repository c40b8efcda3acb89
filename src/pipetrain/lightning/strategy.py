"""`PipelineStrategy`: Lightning's `Trainer` runs a LightningModule's `BlockModel` as a dp × pp × tp pipeline.

Lightning's launcher starts the processes (its subprocess launcher, or torchrun / srun / mpirun through its
cluster environments); the strategy joins them into pipetrain's process group and mesh, builds only this rank's
blocks when the module's `configure_model` calls `pipetrain.lightning.pipeline`, and turns each `training_step`
into one pipelined step (see `pipetrain.lightning.model`). Lightning's automatic optimisation runs as usual:
`zero_grad`, then `backward`, which here hands over the gradients the step computed (divided by
`accumulate_grad_batches`, as Lightning divides the loss), gradient clipping by norm over every stage
(`gradient_clip_val`), the optimizer and LR scheduler steps, callbacks and `self.log`. The DistributedSampler
splits the data over the `dp` replicas only: every rank of one pipeline reads the same batch.

Checkpoints are pipetrain checkpoints (see `pipetrain.lightning.checkpoint`): layout-free, loadable under any
other layout, by `pipetrain export`, and back into this strategy with `Trainer.fit(ckpt_path=...)`.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies.launchers.subprocess_script import _SubprocessScriptLauncher
from lightning.pytorch.strategies.parallel import ParallelStrategy
from lightning.pytorch.utilities.rank_zero import rank_zero_only
from lightning_utilities.core.rank_zero import rank_zero_only as utils_rank_zero_only
from torch.optim import Optimizer

from pipetrain.blocks import BlockModel
from pipetrain.config import ParallelConfig, PipelineConfig
from pipetrain.errors import ConfigError
from pipetrain.launch.ranks import RankSpec
from pipetrain.lightning.checkpoint import load_lightning_checkpoint, save_lightning_checkpoint
from pipetrain.lightning.model import PipelinedModel
from pipetrain.recipe.clip import clip_grad_norm_
from pipetrain.session import Session, build_session, close_session, join_job

__all__ = ["PipelineStrategy"]


class PipelineStrategy(ParallelStrategy):
    """Pipeline parallelism for a Lightning `Trainer`: `Trainer(strategy=PipelineStrategy(pp=2), devices=2)`.

    `pp` pipeline ranks, `dp` replicas of the pipeline (DDP, or FSDP2 with `dp_mode="fsdp"`), `tp` tensor-parallel
    ranks per stage (the `BlockModel` needs a `tp_plan` hook); `devices` × `num_nodes` of the Trainer must be
    dp × pp × tp. `schedule` ("gpipe", "1f1b", "interleaved-1f1b", ...), `chunks` micro-batches per batch (default
    `pp`), `checkpoint` the activation recomputation policy ("never", "except_last", "always"), `balance` blocks
    per stage. fp32 only (`Trainer(precision="32-true")`, the default).
    """

    strategy_name = "pipetrain"

    def __init__(self, pp: int = 2, dp: int = 1, tp: int = 1, *, schedule: str = "gpipe", chunks: int | None = None,
                 checkpoint: str = "never", balance: list[int] | None = None, dp_mode: str = "ddp",
                 accelerator: Any = None, parallel_devices: list[torch.device] | None = None,
                 cluster_environment: Any = None, checkpoint_io: Any = None) -> None:
        super().__init__(accelerator=accelerator, parallel_devices=parallel_devices,
                         cluster_environment=cluster_environment, checkpoint_io=checkpoint_io)
        pipeline = PipelineConfig(pp=pp, schedule=schedule, n_microbatches=chunks or pp, checkpoint=checkpoint,
                                  balance=tuple(balance) if balance else None)
        self.parallel = ParallelConfig(dp=dp, dp_mode=dp_mode, pipeline=pipeline, tp=tp)  # refuses bad values now
        self.num_nodes = 1
        self.session: Session | None = None
        self.pipelined: PipelinedModel | None = None
        self._joined = False

    # ---- processes and the mesh -----------------------------------------------------------------------------

    @property
    def root_device(self) -> torch.device:
        assert self.parallel_devices is not None
        return self.parallel_devices[self.local_rank]

    @property
    def num_processes(self) -> int:
        return len(self.parallel_devices) if self.parallel_devices is not None else 0

    @property
    def is_distributed(self) -> bool:
        """Lightning adds a DistributedSampler to the dataloaders of a distributed strategy."""
        return True

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        """The data is split over the replicas only: the ranks of one pipeline read the same batch."""
        per_replica = self.parallel.pp * self.parallel.tp
        return {"num_replicas": self.parallel.dp, "rank": self.global_rank // per_replica}

    @property
    def restore_checkpoint_after_setup(self) -> bool:
        return True  # the stages exist only after setup

    @property
    def lightning_restore_optimizer(self) -> bool:
        return False  # loaded with the model, under layout-free keys

    def _configure_launcher(self) -> None:
        # called when the Trainer is made, in the process that starts the others: say a bad setting once, here
        _check_precision(self.precision_plugin)
        world = self.num_processes * self.num_nodes
        if world != self.parallel.world_size:
            raise ConfigError(
                f"dp={self.parallel.dp} x pp={self.parallel.pp} x tp={self.parallel.tp} = {self.parallel.world_size} "
                f"ranks, but the Trainer has {self.num_processes} device(s) x {self.num_nodes} node(s) = {world}",
                hint=f"pass Trainer(devices={self.parallel.world_size // self.num_nodes}), or change pp/dp/tp")
        assert self.cluster_environment is not None
        if not self.cluster_environment.creates_processes_externally:
            self._launcher = _SubprocessScriptLauncher(self.cluster_environment, self.num_processes, self.num_nodes)

    def setup_environment(self) -> None:
        super().setup_environment()
        assert self.cluster_environment is not None
        self.set_world_ranks()
        env = self.cluster_environment
        join_job(RankSpec(rank=self.global_rank, local_rank=self.local_rank, world_size=self.world_size,
                          master_addr=env.main_address, master_port=env.main_port, device=self.root_device.type,
                          nodes=self.num_nodes), cpu_threads=None)
        self._joined = True
        self.precision_plugin = _PipelinePrecision(self)

    def set_world_ranks(self) -> None:
        if self.cluster_environment is not None:
            self.cluster_environment.set_global_rank(self.node_rank * self.num_processes + self.local_rank)
            self.cluster_environment.set_world_size(self.num_nodes * self.num_processes)
        rank_zero_only.rank = utils_rank_zero_only.rank = self.global_rank  # as Lightning's own strategies do

    def build_pipeline(self, blocks: BlockModel, *, seed: int = 0) -> PipelinedModel:
        """This rank's stages of `blocks` (what `pipetrain.lightning.pipeline` returns under this strategy)."""
        if self.session is not None:
            return self.pipelined
        self.session = build_session(blocks, self.parallel, self.root_device, seed=seed)
        self.pipelined = PipelinedModel(self.session.engine, self.session.device)
        return self.pipelined

    def setup(self, trainer: Any) -> None:
        assert self.lightning_module is not None
        if self.pipelined is None:
            raise ConfigError(f"{type(self.lightning_module).__name__} built no pipeline for PipelineStrategy",
                              hint="in its configure_model, set self.model = pipetrain.lightning.pipeline(self, "
                                   "YourBlockModel()) (see docs/lightning.md)")
        own = {id(param) for param in self.pipelined.parameters()}
        outside = [name for name, param in self.lightning_module.named_parameters() if id(param) not in own]
        if outside:
            raise ConfigError(f"{type(self.lightning_module).__name__} has parameters outside its pipeline: "
                              f"{', '.join(outside[:3])}", hint="make them blocks of the BlockModel")
        super().setup(trainer)
        if len(self.optimizers) > 1:
            raise ConfigError(f"configure_optimizers returned {len(self.optimizers)} optimizers",
                              hint="PipelineStrategy trains with one optimizer over the pipeline's parameters")

    def model_to_device(self) -> None:
        pass  # the stages were built on their device

    # ---- the step -------------------------------------------------------------------------------------------

    def backward(self, closure_loss: torch.Tensor, optimizer: Optimizer | None, *args: Any, **kwargs: Any
                 ) -> torch.Tensor:
        """Hand over the gradients the pipelined step of `training_step` computed (Lightning zeroed the
        parameters' gradients in between), divided by `accumulate_grad_batches` as Lightning divides the loss."""
        assert self.lightning_module is not None and self.pipelined is not None
        self.pre_backward(closure_loss)
        closure_loss = self.precision_plugin.pre_backward(closure_loss, self.lightning_module)
        self.pipelined.hand_over_grads(1.0 / self.lightning_module.trainer.accumulate_grad_batches)
        closure_loss = self.precision_plugin.post_backward(closure_loss, self.lightning_module)
        self.post_backward(closure_loss)
        return closure_loss

    # ---- collectives Lightning asks for ---------------------------------------------------------------------

    def barrier(self, name: str | None = None) -> None:
        if dist.is_initialized():
            dist.barrier()

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        if not dist.is_initialized():
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src)
        return box[0]

    def reduce(self, tensor: Any, group: Any | None = None, reduce_op: Any | None = "mean") -> Any:
        if not isinstance(tensor, torch.Tensor) or not dist.is_initialized():
            return tensor
        total = tensor.detach().clone()
        dist.all_reduce(total, group=group)
        mean = reduce_op is None or (isinstance(reduce_op, str) and reduce_op.lower() in ("mean", "avg"))
        return total / dist.get_world_size(group) if mean else total

    # ---- checkpoints ----------------------------------------------------------------------------------------

    def lightning_module_state_dict(self) -> dict[str, Any]:
        return {}  # written by save_checkpoint under layout-free keys

    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        return {}

    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        pass  # loaded by load_checkpoint

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None) -> None:
        assert self.session is not None and self.lightning_module is not None
        path = Path(self.broadcast(str(filepath)))
        save_lightning_checkpoint(path, checkpoint, self.session.engine, self.optimizers[0] if self.optimizers else
                                  None, model_name=type(self.lightning_module).__name__)

    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        assert self.session is not None
        path = Path(self.broadcast(str(checkpoint_path)))
        return load_lightning_checkpoint(path, self.session.engine, self.optimizers[0] if self.optimizers else None)

    def remove_checkpoint(self, filepath: Any) -> None:
        if self.is_global_zero:
            self.checkpoint_io.remove_checkpoint(filepath)

    def teardown(self) -> None:
        super().teardown()
        if self._joined:  # the process group this strategy joined
            close_session()
            self._joined = False
        self.session = None
        self.pipelined = None


class _PipelinePrecision(Precision):
    """fp32, with `gradient_clip_val` clipping by the norm of every stage's gradients (no rank sees them all)."""

    def __init__(self, strategy: PipelineStrategy) -> None:
        super().__init__()
        self._strategy = strategy

    def clip_grad_by_norm(self, optimizer: Optimizer, clip_val: int | float) -> None:
        assert self._strategy.session is not None
        clip_grad_norm_(self._strategy.session.engine, float(clip_val))


def _check_precision(plugin: Precision) -> None:
    """Only Lightning's fp32 (`precision="32-true"`, its plain `Precision` plugin) is supported."""
    if type(plugin) in (Precision, _PipelinePrecision):
        return
    name = getattr(plugin, "precision", type(plugin).__name__)
    raise ConfigError(f"PipelineStrategy does not support Trainer(precision={name!r}) "
                      f"({type(plugin).__name__})", hint="train in fp32: Trainer(precision='32-true'), the default")
