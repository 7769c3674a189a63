"""Engine and trainer agree on image prompts: the rollout carries each sample's images through shards, shuffles and
micro-batches, and the trainer's forward (train/models.py) scores the built-in engine's samples with the same
pixels, grids and 3-D positions, to float32 round-off -- also where the model generated an image token itself."""

from __future__ import annotations

import pytest
import torch
from vlm_colour_task import write_dataset

from hybrid_algos.train.data import load_prompt_set
from hybrid_algos.train.experience import Rollout
from hybrid_algos.train.model_files import load_tokenizer
from hybrid_algos.train.models import load_causal_lm, response_token_scores
from hybrid_algos.train.rollout_settings import RolloutSettings
from hybrid_algos.train.tiny_vlm import save_tiny_vlm
from hybrid_algos.train.vision import load_vision_processor
from hybrid_engines import SamplingParams
from hybrid_engines.hf_engine import HFEngine
from hybrid_engines.multimodal import with_pixels


@pytest.fixture(scope="module")
def sampled(tmp_path_factory):
    """Six colour-square prompts, 8 samples each of up to 4 tokens from the built-in engine."""
    root = tmp_path_factory.mktemp("vlm")
    path = save_tiny_vlm(str(root / "model"))
    tokenizer = load_tokenizer("pretrain", path, trust_remote_code=False)
    rollout = RolloutSettings(
        prompt_data=write_dataset(str(root / "data"), 6, seed=2),
        input_key="prompt",
        label_key="label",
        apply_chat_template=True,
        max_images_per_prompt=1,
        prompt_max_len=64,
        rollout_batch_size=6,
    )
    vision = load_vision_processor(path, tokenizer)
    prompts, _ = load_prompt_set(rollout, tokenizer, vision=vision)
    engine = HFEngine(path, device="cpu", dtype="float32")
    outs = engine.generate(
        [p.prompt_ids for p in prompts],
        SamplingParams(temperature=1.0, max_new_tokens=4, n=8, seed=3),
        [p.images for p in prompts],
    )
    batch = Rollout.from_generations(
        [p.prompt_ids for p in prompts],
        [[o.token_ids for o in group] for group in outs],
        tokenizer.pad_token_id,
        logprobs=[[o.logprobs for o in group] for group in outs],
        images=[p.images for p in prompts],
    )
    batch = batch.with_(images=with_pixels(batch.images, vision.image_processor))  # what a worker does
    model = load_causal_lm(path, dtype=torch.float32).eval()
    return batch, model, tokenizer


def scores(model, mb: Rollout, *, images=True) -> torch.Tensor:
    with torch.no_grad():
        return response_token_scores(
            model, mb.sequences, mb.attention_mask, mb.response_len, images=mb.images if images else None
        ).logprobs


def test_the_trainer_scores_the_engines_samples_with_their_images(sampled):
    batch, model, tokenizer = sampled
    mask = batch.action_mask
    gap = ((scores(model, batch) - batch.engine_logprobs).abs() * mask).max().item()
    assert gap < 1e-5
    # without the images the same tokens score otherwise: the agreement above is the images' doing
    blind = ((scores(model, batch, images=False) - batch.engine_logprobs).abs() * mask).max().item()
    assert blind > 1e-2
    # the model generated image tokens itself in some responses: text there, not placeholders
    image_id = tokenizer.convert_tokens_to_ids("<|image_pad|>")
    P = batch.sequences.shape[1] - batch.response_len
    assert bool(((batch.sequences[:, P:] == image_id) & mask.bool()).any())


def test_images_follow_their_samples_through_shards_shuffles_and_micro_batches(sampled):
    batch, model, _ = sampled
    order = torch.randperm(batch.batch_size, generator=torch.Generator().manual_seed(0))
    shuffled = batch.select(order)
    assert [id(m) for m in shuffled.images] == [id(batch.images[i]) for i in order.tolist()]
    shards = shuffled.split(2)
    assert Rollout.cat(shards).images == shuffled.images
    for shard in shards:
        for mb in shard.micro_batches(5):  # trimmed: fewer prompt columns, the images still line up
            got = scores(model, mb)
            assert ((got - mb.engine_logprobs).abs() * mb.action_mask).max().item() < 1e-5
    picked = batch.select(batch.group == 1)  # a boolean mask: one prompt's samples
    assert len(picked.images) == 8 and all(m is batch.images[8] for m in picked.images)
