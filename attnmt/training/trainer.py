"""One optimizer update: micro-batches under autocast, normalisation by the global token count, clipping, step.

Nothing here touches files; the loop (``loop.py``) decides when to log, validate and save.

Loss normalisation: the criterion returns a loss SUMMED over target tokens. Before the first micro-batch of an
update the trainer knows how many target tokens the whole update holds on all ranks (:func:`global_sum`, an
all-reduce when ``torch.distributed`` is initialised), and every micro-batch's loss is scaled by
``world_size / total_tokens`` before ``backward``. The accumulated gradient is therefore the gradient of the mean
per-token loss of the whole update, whatever ``--update-freq`` and the number of ranks (DDP averages gradients
over ranks, hence the ``world_size`` factor).

Several processes (``attnmt/training/distributed.py``): the model given as ``ddp_model`` (DistributedDataParallel)
runs the forward and backward passes; ``model`` is the plain module that evaluation and checkpoints use. DDP
all-reduces gradients during the backward pass of the LAST micro-batch only (``no_sync`` on the others). Just
before that backward the ranks agree that none of them failed in this update (:func:`distributed.check_peers`):
an out-of-memory batch on one rank then stops all ranks with a message naming the batch's shape, instead of
leaving the others blocked in the gradient all-reduce.

Precision (resolved before, ``attnmt.backends.resolve_precision``): ``bf16`` runs forward and loss under the
backend's autocast (native bf16 on the CPU, tensor cores on CUDA) with fp32 master weights and no loss scaling;
``fp16`` (CUDA only) adds dynamic loss scaling with ``torch.amp.GradScaler``: an update whose gradients overflow
is skipped and does not count. Everything device-specific (the model's fused layers, the attention kernel,
process settings) was set up by the backend before the trainer is built.
"""

from __future__ import annotations

import contextlib

import torch

from attnmt.backends import Backend
from attnmt.backends.devices import is_out_of_memory
from attnmt.data.pairs import move_to
from attnmt.errors import UserError
from attnmt.training import distributed


def global_sum(values: list[float], device: torch.device) -> list[float]:
    """Sum ``values`` over all ranks (identity in a single process): THE place where the loss normaliser is made."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return [float(v) for v in values]
    t = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(t)
    return t.tolist()


def _total_norm(grads: list[torch.Tensor]) -> torch.Tensor:
    if hasattr(torch.nn.utils, "get_total_norm"):
        return torch.nn.utils.get_total_norm(grads, 2.0, foreach=True)
    return torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g.float()) for g in grads]))


class Trainer:
    """Holds model, criterion, optimizer, LR schedule and loss scaler; :meth:`train_step` does one update."""

    def __init__(self, model: torch.nn.Module, criterion, optimizer: torch.optim.Optimizer, lr_scheduler, *,
                 backend: Backend, clip_norm: float = 0.0, world_size: int = 1,
                 ddp_model: torch.nn.Module | None = None):
        self.backend = backend  # the run's, which prepared the model and the criterion
        self.model = model
        self.ddp_model = ddp_model
        self.train_model = ddp_model if ddp_model is not None else model  # what forward/backward run through
        self.criterion = criterion
        self.optimizer = optimizer
        self.lr_scheduler = lr_scheduler
        self.device = backend.device
        self.precision = backend.precision
        self.clip_norm = clip_norm
        self.world_size = world_size
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.scaler = backend.loss_scaler()
        self.num_updates = 0
        self.num_overflows = 0
        self._dummy: dict | None = None
        self.lr = self.lr_scheduler.step_update(self.optimizer, 0)

    # ----------------------------------------------------------------------------------------------- helpers

    def autocast(self):
        return self.backend.autocast()

    def set_num_updates(self, n: int) -> None:
        self.num_updates = n
        self.lr = self.lr_scheduler.step_update(self.optimizer, n)

    def follow_clock(self, train_time: float) -> None:
        """Give the schedule the training clock (seconds, the same on every rank) and set the next update's lr."""
        self.lr = self.lr_scheduler.step_update(self.optimizer, self.num_updates, train_time)

    def prime_padding_batch(self, sample: dict) -> None:
        """The batch that stands in (with weight 0) for an empty padding batch before this rank has seen one."""
        self._dummy = move_to(sample, self.device)

    def _no_sync(self, last: bool):
        """Skip DDP's gradient all-reduce on all but the last micro-batch of an update."""
        if not last and self.ddp_model is not None:
            return self.ddp_model.no_sync()
        return contextlib.nullcontext()

    # ----------------------------------------------------------------------------------------------- steps

    def train_step(self, samples: list[dict | None]) -> dict | None:
        """Forward/backward every micro-batch of ``samples``, then clip and step; returns the update's logging.

        ``None`` in ``samples`` is an empty padding batch from rank sharding: it runs the last real batch with
        weight 0 when there are several ranks (every rank must join the same all-reduces) and is skipped otherwise.
        Returns None when no rank had any target token.
        """
        self.train_model.train()
        local_tokens = sum(s["ntokens"] for s in samples if s is not None)
        (total_tokens,) = global_sum([local_tokens], self.device)
        if total_tokens == 0:
            return None
        grad_scale = self.world_size / total_tokens
        loss_sum = torch.zeros((), device=self.device)
        nll_sum = torch.zeros((), device=self.device)
        nsentences = 0
        agreed = self.world_size == 1  # multi-process: ranks agree nobody failed before the gradient all-reduce
        sample = None
        try:
            for i, sample in enumerate(samples):
                weight = grad_scale
                if sample is None:
                    if self.world_size == 1 or self._dummy is None:
                        continue
                    sample, weight = self._dummy, 0.0
                else:
                    sample = move_to(sample, self.device)
                    self._dummy = sample
                    nsentences += sample["nsentences"]
                last = i == len(samples) - 1
                with self._no_sync(last=last):
                    with self.autocast():
                        loss, log = self.criterion(self.train_model, sample)
                    scaled = loss * weight
                    if self.scaler is not None:
                        scaled = self.scaler.scale(scaled)
                    if last and not agreed:
                        agreed = True
                        distributed.check_peers(None, self.device)
                    scaled.backward()
                if weight:
                    loss_sum += log["loss"]
                    nll_sum += log["nll_loss"]
        except Exception as e:
            if not is_out_of_memory(e):
                raise
            message = distributed.oom_message(sample, self.num_updates + 1, self.device)
            if not agreed:  # the others are (or will be) waiting in check_peers: tell them, then stop together
                distributed.check_peers(message, self.device)
            raise UserError(message) from None

        if self.scaler is not None:
            self.scaler.unscale_(self.optimizer)
        grads = [p.grad for p in self.params if p.grad is not None]
        gnorm = _total_norm(grads) if grads else torch.zeros((), device=self.device)
        finite = bool(torch.isfinite(gnorm))
        if finite and self.clip_norm > 0 and grads:
            if hasattr(torch.nn.utils, "clip_grads_with_norm_"):
                torch.nn.utils.clip_grads_with_norm_(self.params, self.clip_norm, gnorm, foreach=True)
            else:
                torch.nn.utils.clip_grad_norm_(self.params, self.clip_norm)

        overflow = False
        if self.scaler is not None:
            self.scaler.step(self.optimizer)  # skips the step itself when gradients are not finite
            self.scaler.update()
            overflow = not finite
        elif not finite:
            self.optimizer.zero_grad(set_to_none=True)
            raise FloatingPointError(
                f"the gradient norm is {float(gnorm)} at update {self.num_updates + 1}; training diverged. "
                f"Lower --lr, raise --warmup-updates or set --clip-norm")
        else:
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        if overflow:
            self.num_overflows += 1
        else:
            self.set_num_updates(self.num_updates + 1)
        return {
            "loss": loss_sum.detach(), "nll_loss": nll_sum.detach(), "ntokens": local_tokens,
            "nsentences": nsentences, "gnorm": gnorm.detach() if finite else None, "overflow": overflow,
        }

    @torch.no_grad()
    def valid_step(self, sample: dict) -> dict:
        """Loss sums of one validation batch (eval mode: no dropout)."""
        self.model.eval()
        sample = move_to(sample, self.device)
        with self.autocast():
            _, log = self.criterion(self.model, sample)
        return log

    # ----------------------------------------------------------------------------------------------- state

    def state_dict(self) -> dict:
        return {
            "num_updates": int(self.num_updates),
            "num_overflows": int(self.num_overflows),
            "optimizer": self.optimizer.state_dict(),
            "lr_scheduler": self.lr_scheduler.state_dict(),
            "scaler": self.scaler.state_dict() if self.scaler is not None else None,
        }

    def load_state_dict(self, state: dict, *, reset_optimizer: bool = False, reset_lr_scheduler: bool = False,
                        reset_num_updates: bool = False) -> None:
        """``reset_num_updates``: count updates from 0 again (fine-tuning from another run's state)."""
        num_updates = 0 if reset_num_updates else int(state["num_updates"])
        self.num_overflows = 0 if reset_num_updates else int(state.get("num_overflows", 0))
        if not reset_optimizer:
            self.optimizer.load_state_dict(state["optimizer"])
            if self.scaler is not None and state.get("scaler"):
                self.scaler.load_state_dict(state["scaler"])
        if reset_lr_scheduler or reset_num_updates:
            self.lr_scheduler.restart(num_updates)
        else:
            self.lr_scheduler.load_state_dict(state["lr_scheduler"])
        self.set_num_updates(num_updates)
