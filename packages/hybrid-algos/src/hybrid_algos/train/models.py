"""Loading the role models and the forward passes the loop needs (log-probs of responses, per-token values).

Sequences are laid out as ``[left-padded prompt (P) | right-padded response (R)]``: every prompt ends at column P,
so the hidden states that predict the response are columns ``P-1 .. P+R-2`` of every row.

Two things keep a trainer's memory bounded by what it really needs:

* **No full-vocabulary logits for a micro-batch.** The backbone runs once; the LM head then runs over the
  response positions only, a chunk of positions at a time (``LOGITS_CHUNK_BYTES`` of float32 logits), and each
  chunk is reduced to its log-probs (and entropy) at once. With gradients, each chunk is checkpointed: its logits
  are recomputed in the backward pass instead of being kept. A ``[micro_batch x len x vocab]`` tensor never exists.
* **Packing** (``packed=True``, ``--packing_samples``): the rows' real tokens are concatenated into one row with
  position ids restarting at 0 for every sample and no attention mask, so padding costs nothing. Attention must
  then stay within each sample: left to transformers, sdpa would build a dense ``N x N`` block-diagonal mask and
  compute every score of the row (more attention work than the padded batch). A packed forward therefore switches
  an sdpa model to :mod:`hybrid_algos.train.packed_attention` (one varlen flash call on CUDA, a causal SDPA per
  sample otherwise; calls with a padding mask still go to sdpa as before); flash-attention models
  (``--flash_attn``) use transformers' own varlen path. The sample boundaries are attached to the position ids
  here, from lengths already on the host. Results equal the padded path's
  (tests/hybrid_algos/train/test_packing.py).

Images (vision-language rollouts): a micro-batch's samples' images (``Rollout.images``, pixel values made by the
worker: :func:`hybrid_engines.multimodal.with_pixels`) go into the forward with their grids and the model's 3-D
rotary positions, from the same function the built-in engine's prefill uses
(:func:`hybrid_engines.multimodal.vision_forward_inputs`), so both score the same inputs. Packing does not take
images yet (refused before the run starts).

The chunked head runs *inside* the model's forward (an extra ``token_scores=`` argument installed on the
transformers model by :func:`install_token_scores`), so a DeepSpeed engine's forward and backward hooks see it as
part of the model. Logit transforms some architectures apply after the head (soft-capping, scaling) are applied;
the first call on a model compares with its own forward on a few positions and falls back to full logits (with
a warning) if an unknown transform makes them differ.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import Literal, overload

import torch

from hybrid_engines.multimodal import apply_placeholder_ids, vision_forward_inputs

from .packed_attention import attach_segments, segments_from_lengths
from .packed_attention import install as install_packed_attention

log = logging.getLogger(__name__)

#: Float32 logits computed at once: a chunk of positions x vocabulary of at most this many bytes.
LOGITS_CHUNK_BYTES = 64 << 20


def position_ids_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """Positions that skip left padding, as the engines use when they generate."""
    pos = attention_mask.long().cumsum(-1) - 1
    return pos.clamp_(min=0)


# ---- which hidden states predict which response tokens ----------------------------------------------------------
@dataclass
class ModelInputs:
    """What the model is called with, and where its outputs go back in ``[B, R]``."""

    input_ids: torch.Tensor  # [B, T] padded, or [1, N] packed
    attention_mask: torch.Tensor | None  # None when packed (the position ids delimit the samples)
    position_ids: torch.Tensor
    positions: torch.Tensor  # [M] flat index into the model's [rows * T] outputs: the ones predicting a target
    targets: torch.Tensor  # [M] the response token each of them predicts
    rows: torch.Tensor  # [M] where each result goes in [B, R]
    cols: torch.Tensor
    shape: tuple[int, int]  # (B, R)
    extra: dict = dataclasses.field(default_factory=dict)  # more forward arguments: pixel values, image grids


def model_inputs(
    sequences: torch.Tensor,
    attention_mask: torch.Tensor,
    response_len: int,
    *,
    packed: bool = False,
    model: torch.nn.Module | None = None,
    images: list | None = None,
) -> ModelInputs:
    """The forward's inputs for ``[B, P+R]`` sequences, padded as they are or packed into one row; with
    ``images`` (per row, of a vision-language ``model``) the pixel values, grids and 3-D positions too."""
    B, T = sequences.shape
    R, P = response_len, sequences.shape[1] - response_len
    valid = attention_mask.bool()
    resp_valid = valid[:, P:]
    rows, cols = resp_valid.nonzero(as_tuple=True)  # every real response token, row-major
    targets = sequences[:, P:][rows, cols]
    vision = vision_forward_inputs(model, sequences, attention_mask, images, prompt_len=P) if images else {}
    if vision and packed:
        raise ValueError("packed micro-batches do not take images yet (--packing_samples is refused with images)")
    if not packed:
        positions = rows * T + (P - 1 + cols)
        position_ids = vision.pop("position_ids") if vision else position_ids_from_mask(attention_mask)
        return ModelInputs(sequences, attention_mask, position_ids, positions, targets, rows, cols, (B, R), vision)
    lengths = valid.sum(-1)
    if bool((valid[:, :P].sum(-1) == 0).any()):
        raise ValueError("packing needs a prompt token before every response (a row has an empty prompt)")
    offsets = torch.cumsum(lengths, 0) - lengths  # where each sample starts in the packed row
    ids = sequences[valid].unsqueeze(0)
    host_lengths = lengths.tolist()
    pos = torch.cat([torch.arange(int(n), device=sequences.device) for n in host_lengths]).unsqueeze(0)
    attach_segments(pos, segments_from_lengths(host_lengths, sequences.device))  # read by the packed attention
    prompt_len = valid[:, :P].sum(-1)
    positions = offsets[rows] + prompt_len[rows] + cols - 1
    return ModelInputs(ids, None, pos, positions, targets, rows, cols, (B, R))


def _scatter(values: torch.Tensor, inputs: ModelInputs) -> torch.Tensor:
    out = values.new_zeros(inputs.shape)
    return out.index_put((inputs.rows, inputs.cols), values)


# ---- the chunked LM head ----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class TokenScoresRequest:
    """Passed to a model's forward as ``token_scores=``: score these positions instead of returning logits."""

    positions: torch.Tensor
    targets: torch.Tensor
    temperature: float = 1.0
    entropy: bool = False
    raw: bool = False  # also the log-probs at temperature 1 (the engines report those)
    chunk_bytes: int = LOGITS_CHUNK_BYTES


def _logit_transform(config) -> tuple:
    """What some architectures do to the head's output (Gemma soft-capping, Cohere / Granite scaling)."""
    steps = []
    for attr in ("logit_scale",):
        value = getattr(config, attr, None)
        if isinstance(value, (int, float)) and value != 1:
            steps.append(("mul", float(value)))
    value = getattr(config, "logits_scaling", None)
    if isinstance(value, (int, float)) and value != 1:
        steps.append(("div", float(value)))
    value = getattr(config, "final_logit_softcapping", None)
    if isinstance(value, (int, float)) and value > 0:
        steps.append(("softcap", float(value)))
    return tuple(steps)


def _apply_transform(logits: torch.Tensor, steps: tuple) -> torch.Tensor:
    for op, value in steps:
        if op == "mul":
            logits = logits * value
        elif op == "div":
            logits = logits / value
        else:
            logits = torch.tanh(logits / value) * value
    return logits


def _score_chunk(
    head, hidden: torch.Tensor, targets: torch.Tensor, temperature: float, entropy: bool, raw: bool, transform: tuple
) -> tuple[torch.Tensor, ...]:
    logits = _apply_transform(head(hidden).float(), transform)
    out = []
    tempered = logits / temperature if temperature != 1.0 else logits
    lse = torch.logsumexp(tempered, dim=-1)
    out.append(tempered.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - lse)
    if entropy:
        out.append(lse - (torch.softmax(tempered, dim=-1) * tempered).sum(-1))
    if raw:
        out.append(
            out[0]
            if temperature == 1.0
            else logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(logits, dim=-1)
        )
    return tuple(out)


def chunked_token_scores(
    head: torch.nn.Module, hidden: torch.Tensor, req: TokenScoresRequest, transform: tuple = ()
) -> tuple[torch.Tensor, ...]:
    """``(logprobs, [entropy], [raw logprobs])`` of ``req.targets`` from ``hidden`` ``[M, H]``, a chunk at a time."""
    weight = getattr(head, "weight", None)
    # ZeRO-3 partitions the weight (its local shape is empty); the full shape is kept in ds_shape
    vocab = (
        32000 if weight is None else int(weight.ds_shape[0]) if hasattr(weight, "ds_shape") else int(weight.shape[0])
    )
    chunk = max(1, req.chunk_bytes // (4 * vocab))
    checkpoint = torch.is_grad_enabled() and hidden.requires_grad
    parts: list[tuple[torch.Tensor, ...]] = []
    for start in range(0, hidden.shape[0], chunk):
        h, t = hidden[start : start + chunk], req.targets[start : start + chunk]
        if checkpoint:  # recompute this chunk's logits in the backward pass instead of keeping them
            parts.append(
                torch.utils.checkpoint.checkpoint(
                    _score_chunk, head, h, t, req.temperature, req.entropy, req.raw, transform, use_reentrant=False
                )
            )
        else:
            parts.append(_score_chunk(head, h, t, req.temperature, req.entropy, req.raw, transform))
    n = 1 + req.entropy + req.raw
    if not parts:
        empty = hidden.new_zeros((0,), dtype=torch.float32)
        return tuple(empty for _ in range(n))
    return tuple(torch.cat([p[i] for p in parts]) for i in range(n))


def install_token_scores(model: torch.nn.Module) -> torch.nn.Module:
    """Give a transformers causal LM a ``token_scores=`` forward argument (idempotent; returns the model).

    A PEFT wrapper gets the argument itself (its call is the one FSDP2's and DeepSpeed's hooks are on); the backbone
    and head are those of the transformers model inside it, adapters included."""
    from .trainer_backends.peft_weights import hf_model

    if getattr(model, "_hybrid_token_scores", False):
        return model
    original = model.forward
    m = hf_model(model)  # the transformers model (inside a PEFT wrapper, or the model itself)
    base, head = m.base_model, m.get_output_embeddings()
    if base is m or head is None:
        raise ValueError(f"{type(m).__name__} has no separate backbone and LM head to score tokens in chunks")
    transform = _logit_transform(m.config)

    def forward(*args, token_scores: TokenScoresRequest | None = None, **kwargs):
        kwargs = apply_placeholder_ids(m, kwargs)  # a response's generated image tokens are text (multimodal.py)
        if token_scores is None:
            return original(*args, **kwargs)
        kwargs.pop("use_cache", None)
        hidden = base(*args, use_cache=False, **kwargs).last_hidden_state
        hidden = hidden.reshape(-1, hidden.shape[-1]).index_select(0, token_scores.positions)
        return chunked_token_scores(head, hidden, token_scores, transform)

    model.forward = forward
    model._hybrid_token_scores = True
    model._hybrid_chunked_ok = None  # checked against the model's own logits on the first call
    return model


def _unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The transformers model inside a DeepSpeed engine (or the model itself)."""
    inner = getattr(model, "module", None)
    return inner if isinstance(inner, torch.nn.Module) else model


def _chunked_matches_full(model, hf, inputs: ModelInputs, temperature: float) -> bool:
    """Compare the chunked scores of the last positions of the first row with the model's own logits there.

    Runs once per model, on every rank alike (so ZeRO-3's gathers stay in step), in eval mode (no dropout).
    ``logits_to_keep`` keeps the model's own logits to those positions; a model without it is trusted.
    """
    T = inputs.input_ids.shape[1]
    keep = torch.arange(max(0, T - 4), T, device=inputs.input_ids.device)
    targets = inputs.input_ids[0, keep]
    was_training = hf.training
    hf.eval()
    try:
        with torch.no_grad():
            req = TokenScoresRequest(keep, targets, temperature)
            # text positions of the first row (M-RoPE's [3, B, T] too): what the head sees is all this compares
            first_pos = inputs.position_ids[:, :1] if inputs.position_ids.dim() == 3 else inputs.position_ids[:1]
            mine = model(
                input_ids=inputs.input_ids[:1],
                attention_mask=_first(inputs.attention_mask),
                position_ids=first_pos,
                token_scores=req,
            )[0]
            try:
                out = model(
                    input_ids=inputs.input_ids[:1],
                    attention_mask=_first(inputs.attention_mask),
                    position_ids=first_pos,
                    use_cache=False,
                    logits_to_keep=keep,
                )
            except TypeError:
                return True
            logits = out.logits[0].float() / temperature
            theirs = logits.gather(-1, targets[:, None]).squeeze(-1) - torch.logsumexp(logits, -1)
    finally:
        hf.train(was_training)
    ok = bool(torch.allclose(mine, theirs, rtol=1e-3, atol=1e-3))
    if not ok:
        log.warning(
            "%s: chunked log-probs differ from the model's own logits (an output transform this code does "
            "not know); computing full logits for this model",
            type(hf).__name__,
        )
    return ok


def _hf(model: torch.nn.Module) -> torch.nn.Module:
    """The transformers model inside a PEFT wrapper (or the model itself): the one with the config and rope index."""
    from .trainer_backends.peft_weights import hf_model

    return hf_model(model)


def _first(mask: torch.Tensor | None) -> torch.Tensor | None:
    return None if mask is None else mask[:1]


# ---- the forward passes ------------------------------------------------------------------------------------------
@dataclass
class TokenScores:
    """Per response token ``[B, R]`` (0 at padding): log-probs at the sampling temperature, and if asked the
    entropy of that distribution and the log-probs at temperature 1."""

    logprobs: torch.Tensor
    entropy: torch.Tensor | None = None
    raw_logprobs: torch.Tensor | None = None

    def raw(self) -> torch.Tensor:
        """``raw_logprobs``, of a forward that was asked for them (``raw=True``)."""
        if self.raw_logprobs is None:
            raise RuntimeError("no temperature-1 log-probs: the forward was not asked for them (raw=True)")
        return self.raw_logprobs


def response_token_scores(
    model: torch.nn.Module,
    sequences: torch.Tensor,
    attention_mask: torch.Tensor,
    response_len: int,
    *,
    temperature: float = 1.0,
    entropy: bool = False,
    raw: bool = False,
    packed: bool = False,
    chunk_bytes: int = LOGITS_CHUNK_BYTES,
    images: list | None = None,
) -> TokenScores:
    """Log-probs (and entropy, raw log-probs) of the response tokens under ``model`` (a transformers causal LM
    or a DeepSpeed engine holding one), in float32, without full-vocabulary logits for the micro-batch.
    ``images``: per row its ``MultimodalInput`` with pixel values, or None (see the module docstring)."""
    hf = install_token_scores(_unwrap(model))
    inputs = model_inputs(sequences, attention_mask, response_len, packed=packed, model=_hf(hf), images=images)
    temperature = temperature if temperature > 0 else 1.0  # greedy sampling has no tempered distribution: score raw
    if packed:
        install_packed_attention(hf)
    if hf._hybrid_chunked_ok is None:
        hf._hybrid_chunked_ok = _chunked_matches_full(model, hf, inputs, temperature)
    if hf._hybrid_chunked_ok is False:
        out = _full_logits_scores(model, inputs, temperature, entropy, raw)
    else:
        req = TokenScoresRequest(inputs.positions, inputs.targets, temperature, entropy, raw, chunk_bytes)
        out = model(
            input_ids=inputs.input_ids,
            attention_mask=inputs.attention_mask,
            position_ids=inputs.position_ids,
            token_scores=req,
            **inputs.extra,
        )
    out = [_scatter(x, inputs) for x in out]
    return TokenScores(out[0], out[1] if entropy else None, out[-1] if raw else None)


def _full_logits_scores(model, inputs: ModelInputs, temperature: float, entropy: bool, raw: bool):
    """The fallback for models with an unknown output transform: full logits, then the same reductions."""
    out = model(
        input_ids=inputs.input_ids,
        attention_mask=inputs.attention_mask,
        position_ids=inputs.position_ids,
        use_cache=False,
        **inputs.extra,
    )
    logits = out.logits.reshape(-1, out.logits.shape[-1]).index_select(0, inputs.positions)
    return _score_chunk(lambda h: h, logits, inputs.targets, temperature, entropy, raw, ())


@overload
def response_logprobs(
    model: torch.nn.Module,
    sequences: torch.Tensor,
    attention_mask: torch.Tensor,
    response_len: int,
    *,
    temperature: float = ...,
    return_entropy: Literal[False] = ...,
    packed: bool = ...,
    images: list | None = ...,
) -> torch.Tensor: ...
@overload
def response_logprobs(
    model: torch.nn.Module,
    sequences: torch.Tensor,
    attention_mask: torch.Tensor,
    response_len: int,
    *,
    temperature: float = ...,
    return_entropy: Literal[True],
    packed: bool = ...,
    images: list | None = ...,
) -> tuple[torch.Tensor, torch.Tensor]: ...


def response_logprobs(
    model: torch.nn.Module,
    sequences: torch.Tensor,
    attention_mask: torch.Tensor,
    response_len: int,
    *,
    temperature: float = 1.0,
    return_entropy: bool = False,
    packed: bool = False,
    images: list | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Log-probabilities ``[B, R]`` of the response tokens (the last ``response_len`` columns) under ``model``.

    Logits are divided by the sampling temperature, so the ratio in the PPO loss compares the distribution the
    samples were drawn from (temperature 0, greedy, is scored at 1). Float32, in chunks (see the module
    docstring); 0 at padding.
    """
    scores = response_token_scores(
        model,
        sequences,
        attention_mask,
        response_len,
        temperature=temperature,
        entropy=return_entropy,
        packed=packed,
        images=images,
    )
    return (scores.logprobs, scores.entropy) if return_entropy else scores.logprobs


def response_values(
    critic: torch.nn.Module,
    sequences: torch.Tensor,
    attention_mask: torch.Tensor,
    response_len: int,
    *,
    packed: bool = False,
) -> torch.Tensor:
    """Per-token values ``[B, R]``: the critic's estimate at the state before each response token (0 at padding)."""
    inputs = model_inputs(sequences, attention_mask, response_len, packed=packed)
    if packed:
        install_packed_attention(_unwrap(critic))
    out = critic(
        input_ids=inputs.input_ids,
        attention_mask=inputs.attention_mask,
        position_ids=inputs.position_ids,
        use_cache=False,
    )
    values = out.logits[..., 0].reshape(-1).index_select(0, inputs.positions).float()
    return _scatter(values, inputs)


def sequence_scores(
    reward_model: torch.nn.Module, sequences: torch.Tensor, attention_mask: torch.Tensor
) -> torch.Tensor:
    """One scalar per sequence from a sequence-classification reward model, read at the last real token."""
    out = reward_model(
        input_ids=sequences,
        attention_mask=attention_mask,
        position_ids=position_ids_from_mask(attention_mask),
        use_cache=False,
    )
    return out.logits[:, 0].float()


def load_causal_lm(
    path: str,
    *,
    dtype: torch.dtype,
    attn_implementation: str | None = None,
    gradient_checkpointing: bool = False,
    trust_remote_code: bool = False,
) -> torch.nn.Module:
    from transformers import AutoConfig

    from hybrid_engines.multimodal import auto_model_class

    config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
    model = auto_model_class(config).from_pretrained(  # a vision-language folder: its image-text-to-text class
        path, dtype=dtype, attn_implementation=attn_implementation, trust_remote_code=trust_remote_code
    )
    if gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.config.use_cache = False
    return install_token_scores(model)


def load_critic(
    path: str,
    *,
    dtype: torch.dtype,
    attn_implementation: str | None = None,
    gradient_checkpointing: bool = False,
    trust_remote_code: bool = False,
) -> torch.nn.Module:
    """A value model: the backbone of ``path`` with a one-output token head (new head when ``path`` is a policy)."""
    from transformers import AutoModelForTokenClassification

    model = AutoModelForTokenClassification.from_pretrained(
        path, num_labels=1, dtype=dtype, attn_implementation=attn_implementation, trust_remote_code=trust_remote_code
    )
    if gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model


def load_reward_model(
    path: str, *, dtype: torch.dtype, attn_implementation: str | None = None, trust_remote_code: bool = False
) -> torch.nn.Module:
    from transformers import AutoModelForSequenceClassification

    model = AutoModelForSequenceClassification.from_pretrained(
        path, dtype=dtype, attn_implementation=attn_implementation, trust_remote_code=trust_remote_code
    )
    if model.config.pad_token_id is None:
        raise ValueError(f"reward model at {path} has no pad_token_id; it cannot find the last token of a batch.")
    return model.eval().requires_grad_(False)
