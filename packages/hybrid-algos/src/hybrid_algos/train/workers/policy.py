"""The actor role: the policy being trained, under DeepSpeed, with sleep, log-probs, PPO updates and weight export."""

from __future__ import annotations

from collections import defaultdict
from typing import Any, Callable, Iterator

import torch

from hybrid_core.offload import DeepSpeedOffloader
from hybrid_core.stats import TransferStats

from ... import aggregate_loss, kl_estimate, ppo_policy_loss
from ..deepspeed_setup import deepspeed_config, init_distributed, make_engine
from ..experience import Rollout
from ..models import load_causal_lm, response_logprobs
from .base import RoleWorker


class PolicyWorker(RoleWorker):
    """One data-parallel rank of the actor."""

    def setup(self, model_path: str, master_addr: str, master_port: int, total_steps: int) -> dict[str, Any]:
        cfg = self.config
        init_distributed(self.rank, self.world_size, master_addr, master_port, timeout_s=cfg.call_timeout_s)
        dtype = torch.bfloat16 if cfg.bf16 else torch.float32
        model = load_causal_lm(model_path, dtype=dtype, attn_implementation=attn_implementation(cfg),
                               gradient_checkpointing=cfg.gradient_checkpointing, trust_remote_code=cfg.trust_remote_code)
        updates_per_step = cfg.samples_per_step // cfg.train_batch_size * cfg.max_epochs
        self.engine = make_engine(model, deepspeed_config(
            zero_stage=cfg.zero_stage, bf16=cfg.bf16, micro_batch=cfg.micro_train_batch_size,
            grad_accum=cfg.train_batch_size // (cfg.micro_train_batch_size * self.world_size),
            lr=cfg.actor_learning_rate, betas=tuple(cfg.adam_betas), weight_decay=cfg.l2, max_norm=cfg.max_norm,
            num_params=sum(p.numel() for p in model.parameters()), adam_offload=cfg.adam_offload, warmup_steps=int(cfg.lr_warmup_ratio * total_steps * updates_per_step)))
        if cfg.deepspeed_enable_sleep:
            self.offloader = DeepSpeedOffloader(self.engine)
        self._sync = None
        self.settle()
        return {"params": sum(p.ds_numel if hasattr(p, "ds_numel") else p.numel() for p in model.parameters()),
                **self.where()}

    # ---- forward ---------------------------------------------------------------------------------------------------
    @torch.no_grad()
    def logprobs(self, rollout: Rollout) -> torch.Tensor:
        """Log-probs of the responses under the current policy (the 'old' policy of this step's PPO ratio)."""
        self.engine.eval()
        out = []
        for mb in rollout.micro_batches(self.config.micro_rollout_batch_size):
            mb = mb.to(self.device)
            lp = response_logprobs(self.engine, mb.sequences, mb.attention_mask, mb.response_len,
                                   temperature=self.config.temperature)
            out.append(_pad_right(lp, rollout.response_len).cpu())
        return torch.cat(out)

    # ---- update ----------------------------------------------------------------------------------------------------
    def train(self, rollout: Rollout, step: int, kl_coef: float) -> dict[str, float]:
        """PPO epochs over this rank's shard, in micro-batches; DeepSpeed accumulates gradients across them.

        Without ``old_logprobs`` (a single update: see ``RLConfig.needs_old_logprobs``) each micro-batch's own
        detached log-probs are the old ones; with a reference, the k1 KL sums of the step's metrics ("_kl_*") are
        then taken from them too.
        """
        cfg = self.config
        if rollout.old_logprobs is None and not cfg.single_update:
            raise ValueError("train without old_logprobs needs a single optimizer update per step (max_epochs = 1, "
                             "train_batch_size = samples per step); after the first, the weights have moved")
        self.engine.train()
        low, high = cfg.clip_range
        stats: dict[str, list[float]] = defaultdict(list)
        kl_sums: dict[str, float] = {}
        gen = torch.Generator().manual_seed(cfg.seed * 100003 + step * 131 + self.rank)
        for _ in range(cfg.max_epochs):
            order = torch.randperm(rollout.batch_size, generator=gen)
            for mb in rollout.select(order).micro_batches(cfg.micro_train_batch_size):
                mb = mb.to(self.device)
                need_entropy = cfg.entropy_loss_coef > 0
                res = response_logprobs(self.engine, mb.sequences, mb.attention_mask, mb.response_len,
                                        temperature=cfg.temperature, return_entropy=need_entropy)
                logp, entropy = res if need_entropy else (res, None)
                old = mb.old_logprobs
                if old is None:  # the weights have not moved yet this step: these are the old log-probs
                    old = logp.detach()
                    if mb.ref_logprobs is not None:
                        _add_k1_sums(kl_sums, old, mb.ref_logprobs, mb.action_mask)
                loss, info = ppo_policy_loss(logp, old, mb.advantages, mb.action_mask, clip_low=low,
                                             clip_high=high, dual_clip=cfg.dual_clip, agg_mode=cfg.loss_agg_mode,
                                             norm_len=cfg.generate_max_len)
                stats["actor/pg_loss"].append(loss.item())
                stats["actor/clip_frac"].append(float(info["clip_frac"]))
                stats["actor/approx_kl"].append(float(info["approx_kl"]))
                if cfg.use_kl_loss and mb.ref_logprobs is not None:
                    kl = kl_estimate(logp, mb.ref_logprobs, cfg.kl_estimator, mask=mb.action_mask)
                    kl_loss = aggregate_loss(kl, mb.action_mask, cfg.loss_agg_mode, norm_len=cfg.generate_max_len)
                    loss = loss + kl_coef * kl_loss
                    stats["actor/kl_loss"].append(kl_loss.item())
                if entropy is not None:
                    ent = aggregate_loss(entropy, mb.action_mask, cfg.loss_agg_mode, norm_len=cfg.generate_max_len)
                    loss = loss - cfg.entropy_loss_coef * ent
                    stats["actor/entropy"].append(ent.item())
                self.engine.backward(loss)
                self.engine.step()
        stats["actor/lr"].append(self.engine.get_lr()[0])
        return {**{k: sum(v) / len(v) for k, v in stats.items()}, **kl_sums}

    # ---- weights out -----------------------------------------------------------------------------------------------
    def named_weights(self, gather_bytes: int = 1 << 30) -> Iterator[tuple[str, torch.Tensor]]:
        """Full (gathered) weights; under ZeRO-3 every rank must iterate together.

        ZeRO-3 shards are gathered in groups of up to ``gather_bytes`` (one all-gather per group instead of one per
        parameter); each tensor is valid until the next one is requested, which is how the senders consume them.
        """
        named = list(self.engine.module.named_parameters())
        if self.config.zero_stage != 3:
            for name, p in named:
                yield name, p.data
            return
        import deepspeed

        group: list[tuple[str, torch.nn.Parameter]] = []
        size = 0
        for name, p in named + [("", None)]:
            full = p.ds_numel * p.element_size() if p is not None else 0
            if group and (p is None or size + full > gather_bytes):
                with deepspeed.zero.GatheredParameters([q for _, q in group], modifier_rank=None):
                    for gname, q in group:
                        yield gname, q.data
                group, size = [], 0
            if p is not None:
                group.append((name, p))
                size += full

    def weight_metas(self) -> list:
        from hybrid_core.weight_sync import TensorMeta

        metas = []
        for name, p in self.engine.module.named_parameters():
            shape = tuple(p.ds_shape) if hasattr(p, "ds_shape") else tuple(p.shape)
            metas.append(TensorMeta(name, str(p.dtype).removeprefix("torch."), shape))
        return metas

    def init_sync_group(self, master_addr: str, master_port: int, world_size: int, backend: str) -> None:
        """Rank 0 joins the weight-sync group as its sender (rank 0 of that group)."""
        from hybrid_core.weight_sync import create_sync_group

        if self.rank == 0:
            self._sync = create_sync_group(master_addr, master_port, 0, world_size, backend=backend,
                                           timeout_s=self.config.call_timeout_s, device=self.device)

    def send_weights(self, bucket_bytes: int) -> dict:
        """Broadcast the weights to every engine worker (rank 0 sends; other ranks only help gather ZeRO-3 shards)."""
        from hybrid_core.weight_sync import WeightSender

        weights = self.named_weights()
        if self.rank != 0:
            for _ in weights:
                pass
            return TransferStats(0, 0.0, "sync").as_dict()
        return WeightSender(self._sync, bucket_bytes=bucket_bytes).send(weights).as_dict()

    def send_weights_ipc(self, engine: Any, bucket_bytes: int, timeout_s: float, peers: list[int] | None = None) -> dict:
        """Colocated: hand CUDA-IPC (or shared-memory on CPU) buckets to the engine on this rank's GPU.

        ``peers``: the actor ranks whose GPUs one tensor-parallel engine spans (this rank among them); they hand
        each bucket over together and the first of them calls the engine (``engine_group_callbacks``)."""
        from hybrid_core.remote import get_with_timeout
        from hybrid_core.weight_sync import IpcBucketSender, engine_group_callbacks

        sender = IpcBucketSender(bucket_bytes=bucket_bytes, device=self.device)
        what = f"rollout engine on actor rank {self.rank}'s GPU: update_weights_from_ipc"

        def submit(bucket):
            return engine.update_weights_from_ipc.remote(bucket)

        def wait(ref):
            get_with_timeout(ref, timeout_s, what)

        deliver = submit
        if peers is not None and len(peers) > 1:
            deliver, wait = engine_group_callbacks(peers, submit, wait)
        try:
            return sender.send(self.named_weights(), deliver=deliver, wait=wait).as_dict()
        finally:
            sender.close()  # the buckets' memory goes back before the actor sleeps

    # ---- checkpoints -----------------------------------------------------------------------------------------------
    def save_checkpoint(self, path: str, tag: str) -> None:
        self.engine.save_checkpoint(path, tag=tag, save_latest=False)

    def load_checkpoint(self, path: str, tag: str) -> None:
        load_path, _ = self.engine.load_checkpoint(path, tag=tag, load_optimizer_states=True, load_lr_scheduler_states=True)
        if load_path is None:
            raise FileNotFoundError(f"actor rank {self.rank}: no DeepSpeed checkpoint {tag!r} under {path}")

    def save_pretrained(self, path: str, tokenizer_path: str) -> None:
        """Hugging Face format (loadable by transformers and vLLM); rank 0 writes, all ranks gather."""
        state = {}
        for name, tensor in self.named_weights():
            if self.rank == 0:
                state[name] = tensor.detach().to("cpu", copy=True)
        if self.rank == 0:
            from transformers import AutoTokenizer

            self.engine.module.save_pretrained(path, state_dict=state)
            AutoTokenizer.from_pretrained(tokenizer_path, trust_remote_code=self.config.trust_remote_code
                                          ).save_pretrained(path)


def attn_implementation(cfg) -> str | None:
    """--flash_attn: FlashAttention-2 kernels when flash-attn is installed, else PyTorch SDPA (its own flash kernel)."""
    if not cfg.flash_attn:
        return None
    import importlib.util

    return "flash_attention_2" if importlib.util.find_spec("flash_attn") else "sdpa"


def _add_k1_sums(sums: dict[str, float], logp: torch.Tensor, ref_logprobs: torch.Tensor, mask: torch.Tensor) -> None:
    """Accumulate what step._metrics needs for the k1 KL(actor || reference): its sum, tokens and sequences."""
    kl_tokens = (logp.float() - ref_logprobs.float()) * mask
    sums["_kl_sum"] = sums.get("_kl_sum", 0.0) + kl_tokens.sum().item()
    sums["_kl_tokens"] = sums.get("_kl_tokens", 0.0) + mask.sum().item()
    sums["_kl_seqs"] = sums.get("_kl_seqs", 0.0) + float(mask.size(0))


def _pad_right(x: torch.Tensor, width: int) -> torch.Tensor:
    return torch.nn.functional.pad(x, (0, width - x.size(1))) if x.size(1) < width else x
