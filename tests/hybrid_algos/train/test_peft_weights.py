"""trainer_backends/peft_weights.py on unsharded models: the merged export of a LoRA model is PEFT's own
``merge_and_unload()`` under the base model's names (rsLoRA's scaling, several adapters), metas without
tensors name the same weights, a plain model has no plan, and what cannot be merged exactly is refused."""

from __future__ import annotations

import peft  # the hatch-test extra: a missing install fails here, it is not skipped
import pytest
import torch
from fsdp2_worker import model

from hybrid_algos.train.trainer_backends.peft_weights import hf_model, peft_export
from hybrid_core.errors import ConfigError


def lora(**kw):
    config = dict(r=4, lora_alpha=16, target_modules=["q_proj", "v_proj", "down_proj"], lora_dropout=0.0, **kw)
    wrapped = peft.get_peft_model(model(0), peft.LoraConfig(**config))
    torch.manual_seed(3)
    for n, p in wrapped.named_parameters():
        if "lora_B" in n:  # B starts at 0: give the merge something to add
            p.data.normal_()
    return wrapped


def exported(module) -> dict[str, torch.Tensor]:
    plan = peft_export(module)
    assert plan is not None
    return dict(plan.merged(iter(list(module.named_parameters()))))


def test_the_merged_export_is_peft_merge_and_unload_under_base_names() -> None:
    wrapped = lora(use_rslora=True)  # scaling alpha / sqrt(r): the layer's own scaling is used
    mine = exported(wrapped)
    theirs = dict(wrapped.merge_and_unload().named_parameters())
    assert list(mine) == [n for n, _ in model(0).named_parameters()] == list(theirs)
    for name, t in theirs.items():
        assert torch.allclose(mine[name], t, atol=1e-6), name


def test_metas_name_the_exported_weights_without_tensors() -> None:
    wrapped = lora()
    metas = [(n, p.dtype, tuple(p.shape)) for n, p in wrapped.named_parameters()]
    names = peft_export(wrapped).names(metas)  # type: ignore[union-attr]
    assert [(n, tuple(t.shape)) for n, t in exported(wrapped).items()] == [(n, s) for n, _, s in names]


def test_two_active_adapters_add_both_deltas_and_an_inactive_one_is_left_out() -> None:
    wrapped = lora()
    wrapped.add_adapter("second", peft.LoraConfig(r=2, lora_alpha=2, target_modules=["q_proj"], lora_dropout=0.0))
    for n, p in wrapped.named_parameters():
        if "lora_B.second" in n:
            p.data.normal_()
    inactive = exported(wrapped)  # "second" exists but is not active: the model computes without it
    layer = wrapped.base_model.model.model.layers[0].self_attn.q_proj
    w, a, b = layer.base_layer.weight, layer.lora_A["default"].weight, layer.lora_B["default"].weight
    assert torch.allclose(inactive["model.layers.0.self_attn.q_proj.weight"], w + 4 * b @ a, atol=1e-6)
    wrapped.base_model.set_adapter(["default", "second"])
    both = exported(wrapped)
    a2, b2 = layer.lora_A["second"].weight, layer.lora_B["second"].weight
    assert torch.allclose(both["model.layers.0.self_attn.q_proj.weight"], w + 4 * b @ a + 1 * b2 @ a2, atol=1e-6)


def test_a_plain_model_has_no_plan_and_is_its_own_hf_model() -> None:
    plain = model(0)
    assert peft_export(plain) is None
    assert hf_model(plain) is plain
    wrapped = lora()
    assert hf_model(wrapped) is wrapped.base_model.model


@pytest.mark.parametrize(
    "kw, why",
    [
        (dict(use_dora=True), "LoRA variant"),
        (dict(lora_bias=True), "LoRA bias"),
        (dict(modules_to_save=["lm_head"]), "no merged form"),
    ],
)
def test_what_cannot_be_merged_exactly_is_refused_by_name(kw, why) -> None:
    with pytest.raises(ConfigError, match=why):
        peft_export(lora(**kw))


def test_an_adapted_embedding_is_refused() -> None:
    wrapped = peft.get_peft_model(model(0), peft.LoraConfig(r=2, target_modules=["embed_tokens"]))
    with pytest.raises(ConfigError, match=r"embed_tokens.*not a LoRA linear layer"):
        peft_export(wrapped)
