"""The actor role: the policy being trained, under its trainer backend (DeepSpeed or FSDP2), with sleep, log-probs,
PPO updates and weight export.

It reads the trainer and algorithm sections, the rollout's batch shape and temperature (``settings.rollout``), the
run's seed, deadline and ``save_hf_ckpt`` (``settings.run``) and ``settings.models.trust_remote_code``."""

from __future__ import annotations

import os
from collections import defaultdict
from collections.abc import Iterator
from typing import Any

import torch

from hybrid_engines.weight_sync import TrainerWeightSource

from ... import aggregate_loss, compute_policy_loss, kl_estimate, rollout_correction
from ..deepspeed_setup import close_rendezvous, init_distributed, local_device
from ..experience import Rollout
from ..models import load_causal_lm, response_token_scores
from ..rollout_settings import RolloutSettings
from ..trainer_backends.registry import (
    activation_checkpointing_by_loader,
    make_offloader,
    make_training_engine,
    model_dtype,
)
from ..update_guard import UpdateGuard
from ..vision import rollout_pixels
from .base import RoleWorker
from .settings import TrainerSettings

#: With run.save_hf_ckpt, each checkpoint's actor folder holds the policy in Hugging Face format here.
HF_CHECKPOINT_DIR = "huggingface"
#: Under LoRA, beside a saved model's merged weights: the adapter alone (PEFT's format)
ADAPTER_DIR = "adapter"


class PolicyWorker(TrainerWeightSource, RoleWorker):
    """One data-parallel rank of the actor (its weight-sync side: ``TrainerWeightSource``, the engines' transport)."""

    def setup(self, model_path: str, master_addr: str, master_port: int, total_steps: int) -> dict[str, Any]:
        settings, trainer = self.settings, self.trainer
        store = init_distributed(
            self.rank, self.world_size, master_addr, master_port, timeout_s=settings.run.call_timeout_s
        )
        model = load_causal_lm(  # on the host: DeepSpeed or fully_shard moves it (FSDP2: shard by shard)
            model_path,
            dtype=model_dtype(trainer),
            attn_implementation=attn_implementation(trainer),
            gradient_checkpointing=activation_checkpointing_by_loader(trainer),
            trust_remote_code=settings.models.trust_remote_code,
        )
        if trainer.lora:  # the adapters only train (hybrid_algos.train.lora); the engines get them or merged weights
            from ..lora import apply_lora

            model = apply_lora(model, trainer)
        self.model_path = model_path
        self.engine = make_training_engine(
            trainer,
            model,
            trainer.actor_lr,
            update_shape(settings.rollout, self.world_size, total_steps),
            local_device(),
        )
        if trainer.moves_states:  # the residency plan says when
            self.offloader = make_offloader(trainer, self.engine)
        close_rendezvous(store, self.rank, self.world_size)  # the group formed: its store stops listening
        self._raw_old: dict[bytes, torch.Tensor] = {}
        self.freeze_gc()
        return {"params": self.engine.num_params(), **self.where()}

    # ---- forward ---------------------------------------------------------------------------------------------------
    @torch.no_grad()
    def logprobs(self, rollout: Rollout) -> torch.Tensor:
        """Log-probs of the responses under the current policy (the 'old' policy of this step's PPO ratio).

        When the rollout correction needs the log-probs at temperature 1 (the engines report raw log-probs) and the
        sampling temperature is not 1, those are kept on this worker for ``train`` (by sample content).
        """
        need_raw = self._needs_raw_logprobs()
        self._raw_old = {}
        return self._response_logprobs(rollout, keep_raw=need_raw)

    @torch.no_grad()
    def base_logprobs(self, rollout: Rollout) -> torch.Tensor:
        """Under LoRA, the reference's log-probs from this worker's own frozen base: the same forward as
        :meth:`logprobs` with the adapters switched off (PEFT's ``disable_adapter``). The reference is the policy's
        folder untouched, which is exactly the base the adapters sit on, so no second copy of the weights is loaded
        (recipes.py: the ``reference_base`` phase)."""
        if not self.trainer.lora:
            raise RuntimeError("base_logprobs needs LoRA adapters on the actor (trainer.lora_rank > 0)")
        with self.engine.module.disable_adapter():
            return self._response_logprobs(rollout, keep_raw=False)

    def _response_logprobs(self, rollout: Rollout, *, keep_raw: bool) -> torch.Tensor:
        """The responses' log-probs through the engine, micro-batch by micro-batch; ``keep_raw``: the temperature-1
        log-probs kept in ``_raw_old`` too (by sample content)."""
        shape = self.settings.rollout
        self.engine.eval()
        out = torch.zeros(rollout.action_mask.shape, dtype=torch.float32)
        rollout = rollout_pixels(rollout, self)  # a vision-language rollout's pixel values (train/vision.py)
        for mb, index in forward_micro_batches(rollout, self.trainer, shape.micro_rollout_batch_size, self.device):
            dev = mb.to(self.device)
            scores = response_token_scores(
                self.engine,
                dev.sequences,
                dev.attention_mask,
                dev.response_len,
                temperature=shape.temperature,
                raw=keep_raw,
                packed=self.trainer.packing,
                images=mb.images,
            )
            out[index, : mb.response_len] = scores.logprobs.cpu()
            if keep_raw:
                for row, key in enumerate(sample_keys(mb)):
                    self._raw_old[key] = scores.raw()[row].cpu()
        return out

    # ---- update ----------------------------------------------------------------------------------------------------
    def train(self, rollout: Rollout, step: int, kl_coef: float) -> dict[str, float]:
        """Policy-loss epochs over this rank's shard, one optimizer update per ``rollout.train_batch_size`` samples.

        An update's samples go through in micro-batches of ``rollout.micro_train_batch_size`` samples, or of at most
        ``trainer.train_token_budget`` tokens (``trainer.dynamic_batch``; each micro-batch's loss is then weighted by
        its share of the update's tokens or sequences, so the update's loss is the one over all of its samples).

        Without ``old_logprobs`` (a single update: see ``TrainSettings.needs_old_logprobs``) each micro-batch's own
        detached log-probs are the old ones; with a reference, the k1 KL sums of the step's metrics ("_kl_*") are
        then taken from them too. With the engine's log-probs in the rollout, the engine/trainer mismatch is
        measured ("mismatch/*") and, with ``algorithm.correction``, corrected (:mod:`hybrid_algos.mismatch`).
        """
        shape, algo = self.settings.rollout, self.algorithm
        if rollout.old_logprobs is None and not shape.single_update:
            raise ValueError(
                "train without old_logprobs needs a single optimizer update per step (max_epochs = 1, "
                "train_batch_size = samples per step); after the first, the weights have moved"
            )
        self.engine.train()
        low, high = algo.clip_range
        agg_mode = algo.policy_agg_mode
        has_engine_logprobs = engine_logprobs_given(rollout)
        if algo.correction and not has_engine_logprobs and bool(rollout.action_mask.any()):
            raise ValueError(
                "--enable_vllm_is_correction needs the engine's log-probs of the sampled tokens, but the "
                "rollout has none (the engine returned no logprobs); turn it off with "
                "--no_enable_vllm_is_correction"
            )
        need_raw = self._needs_raw_logprobs()
        rollout = rollout_pixels(rollout, self)  # a vision-language rollout's pixel values (train/vision.py)
        guard = UpdateGuard(self.role, self.rank)  # in place of DeepSpeed's per-tensor overflow scan
        stats = DeviceMeans()  # read once at the end: a read per micro-batch would stall the backward's launch
        kl_sums = DeviceMeans()
        mismatch = MismatchStats()
        gen = torch.Generator().manual_seed(self.settings.run.seed * 100003 + step * 131 + self.rank)
        per_update = shape.train_batch_size // self.world_size
        for epoch in range(shape.max_epochs):
            order = torch.randperm(rollout.batch_size, generator=gen)
            shuffled = rollout.select(order)
            for start in range(0, shuffled.batch_size, per_update):
                update = shuffled.select(slice(start, start + per_update))
                plan = train_micro_batches(
                    update, self.trainer, shape.micro_train_batch_size, self.device, by_tokens=agg_mode == "token-mean"
                )
                for i, (mb, weight) in enumerate(plan):
                    mb = mb.to(self.device)
                    mask = mb.loss_mask
                    need_entropy = algo.entropy_coef > 0
                    raw_now = need_raw and mb.old_logprobs is None
                    scores = response_token_scores(
                        self.engine,
                        mb.sequences,
                        mb.attention_mask,
                        mb.response_len,
                        temperature=shape.temperature,
                        entropy=need_entropy,
                        raw=raw_now,
                        packed=self.trainer.packing,
                        images=mb.images,
                    )
                    logp = scores.logprobs
                    old = mb.old_logprobs
                    if old is None:  # the weights have not moved yet this step: these are the old log-probs
                        old = logp.detach()
                        if mb.ref_logprobs is not None:
                            _add_k1_sums(kl_sums, old, mb.ref_logprobs, mb.action_mask)
                    is_weights = None
                    if has_engine_logprobs:
                        trainer = (
                            old if not need_raw else (scores.raw().detach() if raw_now else self._cached_raw_old(mb))
                        )
                        low_is, high_is = algo.correction_bounds
                        corr = rollout_correction(
                            trainer, mb.engine_logprobs, mask, algo.correction_name, low=low_is, high=high_is
                        )
                        if epoch == 0:
                            mismatch.add(corr.stats)
                        if algo.correction:
                            is_weights = corr.weights
                    loss, info = compute_policy_loss(
                        algo.policy_loss,
                        logp,
                        old,
                        mb.advantages,
                        mask,
                        clip_low=low,
                        clip_high=high,
                        dual_clip=algo.dual_clip,
                        agg_mode=agg_mode,
                        norm_len=shape.generate_max_len,
                        is_weights=is_weights,
                    )
                    stats.add("actor/pg_loss", loss)
                    stats.add("actor/clip_frac", info.get("clip_frac", 0.0))
                    stats.add("actor/approx_kl", info["approx_kl"])
                    if algo.kl_loss and mb.ref_logprobs is not None:
                        kl = kl_estimate(logp, mb.ref_logprobs, algo.kl_estimator, mask=mask)
                        kl_loss = aggregate_loss(kl, mask, agg_mode, norm_len=shape.generate_max_len)
                        loss = loss + kl_coef * kl_loss
                        stats.add("actor/kl_loss", kl_loss)
                    if scores.entropy is not None:
                        ent = aggregate_loss(scores.entropy, mask, agg_mode, norm_len=shape.generate_max_len)
                        loss = loss - algo.entropy_coef * ent
                        stats.add("actor/entropy", ent)
                    guard.add_loss(loss)
                    # this micro-batch's share of the update (train_micro_batches), and the boundary is ours
                    self.engine.set_gradient_accumulation_boundary(i == len(plan) - 1)
                    self.engine.backward(loss * weight)
                    guard.step(self.engine, step)
                stats.add("actor/micro_batches", len(plan))
        stats.add("actor/lr", self.engine.get_lr()[0])
        return {**stats.result(), **mismatch.result(self.device), **kl_sums.sums()}

    def _needs_raw_logprobs(self) -> bool:
        """The engines report log-probs at temperature 1; the trainer's are tempered unless the temperature is 1."""
        return self.settings.rollout.temperature not in (0.0, 1.0)

    def _cached_raw_old(self, mb: Rollout) -> torch.Tensor:
        """The temperature-1 old log-probs the log-prob pass kept for ``mb``'s samples, ``[B, R]``."""
        width = mb.response_len
        rows = []
        for key in sample_keys(mb.to("cpu")):
            raw = self._raw_old.get(key)
            if raw is None:
                raise RuntimeError(
                    "actor: no temperature-1 log-probs kept for a training sample; the log-prob pass "
                    "must run on the same samples before train"
                )
            rows.append(torch.nn.functional.pad(raw, (0, width - raw.numel())) if raw.numel() < width else raw[:width])
        return torch.stack(rows).to(self.device)

    # ---- weights out -----------------------------------------------------------------------------------------------
    def named_weights(self, gather_bytes: int = 1 << 30) -> Iterator[tuple[str, torch.Tensor]]:
        """Full (gathered) weights, ``gather_bytes`` at a time; with sharded weights (ZeRO-3, FSDP2) every rank must
        iterate together. Each tensor is valid until the next one is requested, which is how the senders consume
        them."""
        return self.engine.full_weights(gather_bytes)

    def weight_metas(self) -> list:
        from hybrid_core.weight_sync import TensorMeta

        return [
            TensorMeta(name, str(dtype).removeprefix("torch."), shape)
            for name, dtype, shape in self.engine.weight_metas()
        ]

    def adapter_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Under LoRA, the adapter's tensors alone, full, under PEFT's saved-adapter names (an adapter-only sync:
        ``hybrid_engines.weight_sync.adapter``), in the dtype the backend's full weights go out in; every rank
        iterates together."""
        from ..trainer_backends.peft_weights import adapter_weights

        return adapter_weights(self.engine.module, self._adapter_names(), getattr(self.engine, "weights_dtype", None))

    def adapter_metas(self) -> list:
        from hybrid_core.weight_sync import TensorMeta

        from ..trainer_backends.peft_weights import adapter_metas

        cast = getattr(self.engine, "weights_dtype", None)
        return [
            TensorMeta(name, str(dtype).removeprefix("torch."), shape)
            for name, dtype, shape in adapter_metas(self.engine.module, self._adapter_names(), cast)
        ]

    def _adapter_names(self) -> dict[str, str]:
        names = getattr(self, "_adapter_map", None)
        if names is None:
            from ..trainer_backends.peft_weights import adapter_names

            names = self._adapter_map = adapter_names(self.engine.module)
        return names

    # ---- checkpoints -----------------------------------------------------------------------------------------------
    def save_checkpoint(self, path: str, tag: str) -> None:
        """The backend's state under ``path`` (DeepSpeed's, or FSDP2's DCP shards); with ``run.save_hf_ckpt`` also
        the policy in Hugging Face format under ``path/huggingface`` (loadable by transformers / vLLM as it is)."""
        self.engine.save_checkpoint(path, tag)
        if self.settings.run.save_hf_ckpt:
            import os

            self.save_pretrained(os.path.join(path, HF_CHECKPOINT_DIR), self.model_path)

    def load_checkpoint(self, path: str, tag: str) -> None:
        try:
            self.engine.load_checkpoint(path, tag)
        except FileNotFoundError as e:
            raise FileNotFoundError(f"actor rank {self.rank}: {e}") from e

    def save_pretrained(self, path: str, tokenizer_path: str) -> None:
        """Hugging Face format (loadable by transformers and vLLM); rank 0 writes, all ranks gather. Under LoRA the
        folder holds the merged model, and ``adapter/`` the adapter alone (PEFT's format: ``PeftModel.from_pretrained``
        over the base model)."""
        state = {}
        for name, tensor in self.named_weights():
            if self.rank == 0:
                state[name] = tensor.detach().to("cpu", copy=True)
        if self.trainer.lora:
            adapter = {}
            for name, tensor in self.engine.full_weights(1 << 30, merged=False):
                if self.rank == 0 and "lora_" in name:
                    adapter[name] = tensor.detach().to("cpu", copy=True)
            if self.rank == 0:
                self.engine.module.save_pretrained(os.path.join(path, ADAPTER_DIR), state_dict=adapter)
        if self.rank == 0:
            from transformers import AutoTokenizer

            from ..trainer_backends.peft_weights import hf_model

            # a PEFT model's merged weights go in a plain model's folder (PeftModel would save the adapter only)
            hf_model(self.engine.module).save_pretrained(path, state_dict=state)
            AutoTokenizer.from_pretrained(
                tokenizer_path, trust_remote_code=self.settings.models.trust_remote_code
            ).save_pretrained(path)


def attn_implementation(trainer: TrainerSettings) -> str | None:
    """flash_attn: FlashAttention-2 kernels when flash-attn is installed, else PyTorch SDPA (its own flash kernel)."""
    if not trainer.flash_attn:
        return None
    import importlib.util
    import logging

    if importlib.util.find_spec("flash_attn"):
        return "flash_attention_2"
    logging.getLogger(__name__).warning(
        "--flash_attn: the flash-attn package is not installed; the trainers use "
        "PyTorch SDPA (which has its own flash kernel) instead"
    )
    return "sdpa"


def update_shape(rollout: RolloutSettings, world_size: int, total_steps: int) -> dict[str, int]:
    """A trained role's optimizer updates from the rollout section's batch shape: the micro-batch, the gradient
    accumulation of one update over ``world_size`` ranks, and the updates of the whole run (``total_steps`` steps)."""
    return {
        "micro_batch": rollout.micro_train_batch_size,
        "grad_accum": rollout.train_batch_size // (rollout.micro_train_batch_size * world_size),
        "total_updates": total_steps * (rollout.samples_per_step // rollout.train_batch_size) * rollout.max_epochs,
    }


def forward_micro_batches(
    rollout: Rollout, trainer: TrainerSettings, micro_batch: int, device
) -> list[tuple[Rollout, torch.Tensor]]:
    """Micro-batches of a no-gradient pass (log-probs, values) and the sample indices of each: by token budget with
    ``dynamic_batch`` (count agreed across the ranks of a DeepSpeed role), else of ``micro_batch`` samples."""
    if trainer.dynamic_batch:
        mbs, index = rollout.token_micro_batches(trainer.rollout_token_budget, packed=trainer.packing, device=device)
        return list(zip(mbs, index))
    return [
        (mb, torch.arange(i, min(i + micro_batch, rollout.batch_size)))
        for i, mb in zip(range(0, rollout.batch_size, micro_batch), rollout.micro_batches(micro_batch))
    ]


def train_micro_batches(
    update: Rollout,
    trainer: TrainerSettings,
    micro_batch: int,
    device,
    *,
    by_tokens: bool,
    mask_of=lambda r: r.loss_mask,
) -> list[tuple[Rollout, float]]:
    """The micro-batches of one optimizer update, each with its loss weight, in every batching mode.

    The weight is the micro-batch's share of the update's loss tokens (``by_tokens``: token-mean aggregation) or of
    its sequences with at least one loss token (the per-sequence modes), counted over every data-parallel rank of the
    role: the weighted micro-batch losses, averaged over the ranks as DeepSpeed averages their gradients, are the loss
    over all of the update's samples. Without it, token-mean would be a mean of per-micro-batch (and per-rank) means,
    which weighs the tokens of short micro-batches more (DAPO's token-level loss is over the whole batch).
    Micro-batches are ``micro_batch`` samples, or at most the trainer's ``train_token_budget`` tokens
    (``dynamic_batch``)."""
    if trainer.dynamic_batch:
        mbs, _ = update.token_micro_batches(trainer.train_token_budget, packed=trainer.packing, device=device)
    else:
        mbs = list(update.micro_batches(micro_batch))

    def size(r: Rollout) -> float:
        m = mask_of(r).bool()
        return float(m.sum()) if by_tokens else float(m.any(-1).sum())

    total, ranks = _over_ranks(size(update), device)
    mean_share = total / ranks  # what one rank's update weighs when the ranks' gradients are averaged
    return [(mb, size(mb) / mean_share if total else 0.0) for mb in mbs]


def _over_ranks(count: float, device) -> tuple[float, int]:
    """The sum of ``count`` over the data-parallel ranks of this process's group, and their number (1 when alone)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return count, 1
    t = torch.tensor([count], dtype=torch.float64, device=device)
    dist.all_reduce(t)
    return float(t.item()), dist.get_world_size()


def engine_logprobs_given(rollout: Rollout) -> bool:
    """Whether the engine reported log-probs (an engine without them leaves zeros)."""
    e = rollout.engine_logprobs
    return e is not None and bool((e * rollout.action_mask).abs().sum() > 0)


def sample_keys(rollout: Rollout) -> list[bytes]:
    """One key per sample from its real tokens: equal samples share a key, and so their log-probs."""
    valid = rollout.attention_mask.bool()
    keys = [rollout.sequences[i][valid[i]].numpy().tobytes() for i in range(rollout.batch_size)]
    if rollout.images is not None:  # the same tokens about other images are other samples
        import hashlib

        keys = [
            k + hashlib.blake2b(b"".join(m.images), digest_size=16).digest() if m is not None else k
            for k, m in zip(keys, rollout.images)
        ]
    return keys


class MismatchStats:
    """The rollout-correction statistics of a step: token-weighted means, min / max, over micro-batches and ranks.

    Kept as device tensors until :meth:`result`: reading a value after every micro-batch's forward would stall the
    host until the GPU catches up, instead of letting it queue the backward pass meanwhile."""

    MEANS = ("ratio_mean", "weight_mean", "clipped_frac", "masked_frac", "kl", "k3_kl")

    def __init__(self) -> None:
        self.sums: torch.Tensor | None = None  # float64: the MEANS weighted by tokens, then the tokens
        self.extremes: torch.Tensor | None = None  # float64: -min, max of the ratio (over micro-batches with tokens)

    def add(self, stats: dict[str, torch.Tensor]) -> None:
        n = stats["tokens"].detach().to(torch.float64)
        sums = torch.stack([*(stats[k].detach().to(torch.float64) * n for k in self.MEANS), n])
        extremes = torch.stack([-stats["ratio_min"].detach(), stats["ratio_max"].detach()]).to(torch.float64)
        extremes = torch.where(n > 0, extremes, torch.full_like(extremes, -torch.inf))  # no tokens: no extremes
        self.sums = sums if self.sums is None else self.sums + sums
        self.extremes = extremes if self.extremes is None else torch.maximum(self.extremes, extremes)

    def result(self, device) -> dict[str, float]:
        import torch.distributed as dist

        sums = (
            torch.zeros(len(self.MEANS) + 1, dtype=torch.float64, device=device)
            if self.sums is None
            else self.sums.to(device)
        )
        extremes = (
            torch.full((2,), -torch.inf, dtype=torch.float64, device=device)
            if self.extremes is None
            else self.extremes.to(device)
        )
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(sums)
            dist.all_reduce(extremes, op=dist.ReduceOp.MAX)
        values = sums.tolist()
        tokens = values[-1]
        if tokens == 0:
            return {}
        out = {f"mismatch/{k}": v / tokens for k, v in zip(self.MEANS, values[:-1])}
        low, high = extremes.tolist()
        out["mismatch/ratio_min"], out["mismatch/ratio_max"] = -low, high
        return out


class DeviceMeans:
    """Per-key means of per-micro-batch values that stay on the device until :meth:`result` reads them all at once
    (one host sync per step instead of several per micro-batch)."""

    def __init__(self) -> None:
        self.values: dict[str, list] = defaultdict(list)

    def add(self, key: str, value) -> None:
        self.values[key].append(value.detach().float() if isinstance(value, torch.Tensor) else float(value))

    def sums(self) -> dict[str, float]:
        return self._read(sum)

    def result(self) -> dict[str, float]:
        return self._read(lambda xs: sum(xs) / len(xs))

    def _read(self, reduce) -> dict[str, float]:
        keys = [k for k, v in self.values.items() if v]
        flat = [x for k in keys for x in self.values[k]]
        on_device = [x.reshape(()) for x in flat if isinstance(x, torch.Tensor)]
        read = iter(torch.stack(on_device).tolist() if on_device else [])  # every value of the worker's device
        host = [next(read) if isinstance(x, torch.Tensor) else x for x in flat]
        out, i = {}, 0
        for k in keys:
            n = len(self.values[k])
            out[k] = reduce(host[i : i + n])
            i += n
        return out


def _add_k1_sums(sums: DeviceMeans, logp: torch.Tensor, ref_logprobs: torch.Tensor, mask: torch.Tensor) -> None:
    """Accumulate what step._metrics needs for the k1 KL(actor || reference): its sum, tokens and sequences."""
    kl_tokens = (logp.float() - ref_logprobs.float()) * mask
    sums.add("_kl_sum", kl_tokens.sum())
    sums.add("_kl_tokens", mask.sum())
    sums.add("_kl_seqs", float(mask.size(0)))
