"""Loading the role models and the forward passes the loop needs (log-probs of responses, per-token values).

Sequences are laid out as ``[left-padded prompt (P) | right-padded response (R)]``: every prompt ends at column P,
so the logits that predict the response are columns ``P-1 .. P+R-2`` for every row — one slice, no gather loops.
"""

from __future__ import annotations

import torch


def position_ids_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """Positions that skip left padding, as the engines use when they generate."""
    pos = attention_mask.long().cumsum(-1) - 1
    return pos.clamp_(min=0)


def response_logprobs(
    model: torch.nn.Module,
    sequences: torch.Tensor,
    attention_mask: torch.Tensor,
    response_len: int,
    *,
    temperature: float = 1.0,
    return_entropy: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Log-probabilities ``[B, R]`` of the response tokens (the last ``response_len`` columns) under ``model``.

    Logits are divided by the sampling temperature, so the ratio in the PPO loss compares the distribution the
    samples were drawn from. Computed in float32 from the slice that predicts the response only.
    """
    out = model(input_ids=sequences, attention_mask=attention_mask, position_ids=position_ids_from_mask(attention_mask),
                use_cache=False)
    logits = out.logits[:, -response_len - 1 : -1].float()
    if temperature != 1.0:
        logits = logits / temperature
    logp_all = torch.log_softmax(logits, dim=-1)
    targets = sequences[:, -response_len:]
    logp = logp_all.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    if not return_entropy:
        return logp
    entropy = -(logp_all.exp() * logp_all).sum(-1)
    return logp, entropy


def response_values(critic: torch.nn.Module, sequences: torch.Tensor, attention_mask: torch.Tensor, response_len: int) -> torch.Tensor:
    """Per-token values ``[B, R]``: the critic's estimate at the state before each response token."""
    out = critic(input_ids=sequences, attention_mask=attention_mask, position_ids=position_ids_from_mask(attention_mask),
                 use_cache=False)
    return out.logits[:, -response_len - 1 : -1, 0].float()


def sequence_scores(reward_model: torch.nn.Module, sequences: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """One scalar per sequence from a sequence-classification reward model, read at the last real token."""
    out = reward_model(input_ids=sequences, attention_mask=attention_mask,
                       position_ids=position_ids_from_mask(attention_mask), use_cache=False)
    return out.logits[:, 0].float()


def load_causal_lm(path: str, *, dtype: torch.dtype, attn_implementation: str | None = None,
                   gradient_checkpointing: bool = False, trust_remote_code: bool = False) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation=attn_implementation,
                                                 trust_remote_code=trust_remote_code)
    if gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.config.use_cache = False
    return model


def load_critic(path: str, *, dtype: torch.dtype, attn_implementation: str | None = None,
                gradient_checkpointing: bool = False, trust_remote_code: bool = False) -> torch.nn.Module:
    """A value model: the backbone of ``path`` with a one-output token head (new head when ``path`` is a policy)."""
    from transformers import AutoModelForTokenClassification

    model = AutoModelForTokenClassification.from_pretrained(path, num_labels=1, dtype=dtype,
                                                            attn_implementation=attn_implementation,
                                                            trust_remote_code=trust_remote_code)
    if gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model


def load_reward_model(path: str, *, dtype: torch.dtype, attn_implementation: str | None = None,
                      trust_remote_code: bool = False) -> torch.nn.Module:
    from transformers import AutoModelForSequenceClassification

    model = AutoModelForSequenceClassification.from_pretrained(path, dtype=dtype, attn_implementation=attn_implementation,
                                                               trust_remote_code=trust_remote_code)
    if model.config.pad_token_id is None:
        raise ValueError(f"reward model at {path} has no pad_token_id; it cannot find the last token of a batch.")
    return model.eval().requires_grad_(False)
