"""The memory model sizes a vision-language model whole: its parameter count includes the vision tower (built on the
meta device like any model), and its layer shapes are the text model's."""

from __future__ import annotations

from hybrid_algos.train.tiny_vlm import tiny_vlm_config
from hybrid_core.residency.memory import model_shape


def test_a_qwen2_vl_config_counts_its_vision_tower_exactly():
    from transformers import Qwen2VLForConditionalGeneration

    config = tiny_vlm_config()
    shape = model_shape(config)
    model = Qwen2VLForConditionalGeneration(config)
    vision = sum(p.numel() for p in model.model.visual.parameters())
    assert vision > 0
    assert shape.num_params == sum(p.numel() for p in model.parameters())  # the tower included, exactly
    assert (shape.hidden_size, shape.num_layers, shape.vocab_size) == (64, 2, config.text_config.vocab_size)
