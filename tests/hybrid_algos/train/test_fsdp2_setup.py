"""How the FSDP2 backend cuts a model into units, without starting a process group: one unit per decoder layer of
the policy, critic and reward model classes the workers load, and a clear refusal where it would gather everything
at once or has no group to shard over."""

from __future__ import annotations

import pytest
import torch

from hybrid_algos.train.trainer_backends.fsdp2_engine import FSDP2Engine
from hybrid_algos.train.trainer_backends.fsdp2_setup import FSDP2Options, decoder_layers, device_mesh
from hybrid_core.errors import ConfigError


def _config(kind: str):
    from transformers import LlamaConfig, Qwen2Config

    cls = LlamaConfig if kind == "llama" else Qwen2Config
    return cls(
        vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=3, num_attention_heads=2,
        num_key_value_heads=1, pad_token_id=0,
    )  # fmt: skip


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
@pytest.mark.parametrize("auto", ["AutoModelForCausalLM", "AutoModelForTokenClassification"])
def test_every_decoder_layer_is_a_unit_of_the_policy_and_critic_classes(kind, auto) -> None:
    import transformers

    model = getattr(transformers, auto).from_config(_config(kind))
    layers = decoder_layers(model)
    assert len(layers) == 3 and all(type(m).__name__.endswith("DecoderLayer") for m in layers)


def test_a_model_without_declared_layers_is_refused() -> None:
    with pytest.raises(ConfigError, match="gather the whole model at once") as err:
        decoder_layers(torch.nn.Sequential(torch.nn.Linear(4, 4)))
    assert err.value.field == "trainer"


def test_sharding_without_a_process_group_is_refused() -> None:
    import torch.distributed as dist

    assert not dist.is_initialized()
    with pytest.raises(ConfigError, match=r"torch\.distributed initialized"):
        device_mesh(torch.device("cpu"))


def test_the_engine_refuses_a_model_fsdp2_did_not_shard() -> None:
    with pytest.raises(ConfigError, match="not sharded by FSDP2"):
        FSDP2Engine(torch.nn.Linear(4, 4), lr=1e-3)


def test_the_default_options_are_fp32_master_and_bf16_compute() -> None:
    # the mode the memory model counts as 16 bytes per parameter of a rank's shard (4 + 4 + 8)
    opts = FSDP2Options()
    assert (opts.master_dtype, opts.compute_dtype, opts.reduce_dtype) == (torch.float32, torch.bfloat16, torch.float32)
