"""Images through the engines (hybrid_engines/multimodal.py): the built-in engine generates from token ids plus each
prompt's images, its log-probs those of a direct forward pass with the same pixels; vLLM's and SGLang's adapters
give the images in their own words (``multi_modal_data``, ``image_data``) or refuse them, never drop them."""

from __future__ import annotations

import io

import pytest
import torch
from PIL import Image

from hybrid_core.errors import ConfigError
from hybrid_engines import MultimodalInput, SamplingParams
from hybrid_engines.hf_engine import HFEngine
from hybrid_engines.multimodal import decode_images, pixel_inputs, vision_forward_inputs
from hybrid_engines.sglang_engine import sglang_prompt_images
from hybrid_engines.vllm_engine import vllm_prompt_images


def png(colour) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (16, 16), colour).save(buf, format="PNG")
    return buf.getvalue()


@pytest.fixture(scope="module")
def vlm(tmp_path_factory):
    from hybrid_algos.train.model_files import load_tokenizer
    from hybrid_algos.train.tiny_vlm import save_tiny_vlm
    from hybrid_algos.train.vision import load_vision_processor

    path = save_tiny_vlm(str(tmp_path_factory.mktemp("vlm") / "model"))
    tokenizer = load_tokenizer("pretrain", path, trust_remote_code=False)
    vision = load_vision_processor(path, tokenizer)
    text = vision.render([{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "what colour"}]}])
    prompts = [vision.encode(text, [png(c)]) for c in ((255, 0, 0), (0, 0, 255))]
    return path, vision, prompts


@pytest.fixture(scope="module")
def engine(vlm):
    return HFEngine(vlm[0], device="cpu", dtype="float32")


def test_generation_sees_the_images_and_its_logprobs_are_a_direct_forwards(vlm, engine):
    _, vision, prompts = vlm
    ids = [p[0] for p in prompts]
    assert ids[0] == ids[1]  # the same text: only the images differ
    params = SamplingParams(temperature=0, max_new_tokens=3)
    outs = engine.generate(ids, params, [p[1] for p in prompts])
    text_only = engine.generate(ids, params)
    assert [o[0].logprobs for o in outs] != [o[0].logprobs for o in text_only]
    assert outs[0][0].logprobs != outs[1][0].logprobs  # red and blue squares: other distributions
    for (prompt, mm), out in zip(prompts, outs):
        seq = torch.tensor([prompt + out[0].token_ids])
        mask = torch.ones_like(seq)
        extra = vision_forward_inputs(engine.model, seq, mask, [pixel_inputs(vision.image_processor, mm)])
        with torch.no_grad():
            logits = engine.model(input_ids=seq, attention_mask=mask, **extra).logits[0].float()
        logp = torch.log_softmax(logits, -1)
        want = [logp[len(prompt) - 1 + t, tok].item() for t, tok in enumerate(out[0].token_ids)]
        assert out[0].logprobs == pytest.approx(want, abs=1e-5)


def test_sampled_rows_of_a_batch_with_and_without_images_keep_their_own_inputs(vlm, engine):
    _, vision, prompts = vlm
    ids, mm = [p[0] for p in prompts], [p[1] for p in prompts]
    text = vision.tokenizer(vision.render([{"role": "user", "content": "what colour"}]), add_special_tokens=False)
    params = SamplingParams(temperature=1.0, max_new_tokens=4, n=3, seed=7)
    together = engine.generate([ids[0], text["input_ids"]], params, [mm[0], None])  # padded to the longer one
    alone = engine.generate([ids[0]], params, [mm[0]])
    assert [o.token_ids for o in together[0]] == [o.token_ids for o in alone[0]]
    for a, b in zip(together[0], alone[0]):
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-5)


def test_a_bad_multimodal_argument_is_refused(vlm, engine):
    _, _, prompts = vlm
    with pytest.raises(ConfigError, match=r"one multimodal input .* per prompt"):
        engine.generate([prompts[0][0]], SamplingParams(max_new_tokens=1), [prompts[0][1], None])
    with pytest.raises(ConfigError, match="image tokens"):  # a prompt without its placeholders
        engine.generate([[1, 7, 9]], SamplingParams(max_new_tokens=1), [prompts[0][1]])


def test_a_text_model_is_refused_images():
    from transformers import LlamaConfig

    text = HFEngine(
        LlamaConfig(
            vocab_size=32,
            hidden_size=16,
            intermediate_size=32,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=1,
        ),
        device="cpu",
    )
    item = MultimodalInput((png((1, 2, 3)),), torch.zeros(16, 96), torch.tensor([[1, 4, 4]]))
    with pytest.raises(ConfigError, match="no vision tower"):
        text.generate([[1, 2, 3]], SamplingParams(max_new_tokens=1), [item])


def test_vllm_gets_the_images_as_multi_modal_data_and_refuses_them_in_partial_rollouts():
    item = MultimodalInput((png((255, 0, 0)), png((0, 255, 0))))
    extras = vllm_prompt_images([item, None], 2, pausable=False)
    images = extras[0]["multi_modal_data"]["image"]
    assert [img.getpixel((0, 0)) for img in images] == [(255, 0, 0), (0, 255, 0)] and extras[1] == {}
    assert vllm_prompt_images(None, 2, pausable=True) == [{}, {}]
    with pytest.raises(ConfigError, match=r"partial rollouts.*do not take images"):
        vllm_prompt_images([item, None], 2, pausable=True)


def test_sglang_gets_the_images_as_image_data_and_refuses_them_in_partial_rollouts():
    from hybrid_engines.sglang_engine import SGLANG_ENGINE_METHODS

    assert "image_data" in SGLANG_ENGINE_METHODS["generate"]  # contract-tested against SGLang's Engine.generate
    item = MultimodalInput((png((0, 0, 255)),))
    data = sglang_prompt_images([None, item], 2, pausable=False)
    assert data[0] is None and [img.getpixel((3, 3)) for img in data[1]] == [(0, 0, 255)]
    assert sglang_prompt_images([None, None], 2, pausable=True) is None
    with pytest.raises(ConfigError, match=r"partial rollouts.*do not take images"):
        sglang_prompt_images([item], 1, pausable=True)


def test_pixels_made_elsewhere_must_match_the_grid_the_prompt_was_encoded_for(vlm):
    _, vision, prompts = vlm
    mm = prompts[0][1]
    assert decode_images(mm)[0].size == (16, 16)
    wrong = MultimodalInput(mm.images, None, torch.tensor([[1, 8, 8]]))
    with pytest.raises(ConfigError, match="another processor configuration"):
        pixel_inputs(vision.image_processor, wrong)
