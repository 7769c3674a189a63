"""Vision-language prompts (train/images.py, train/vision.py): the layouts users have (OpenRLHF's image field with
paths, chat messages with image parts, base64 in JSONL, bytes in Parquet) all become the same token ids with each
image's placeholder expanded; every bad image is refused before Ray starts, naming the record and the fix."""

from __future__ import annotations

import base64
import io
import json

import pytest
from PIL import Image
from vlm_colour_task import QUESTION, write_dataset

from hybrid_algos.train import GRPOConfig, PPOConfig
from hybrid_algos.train.data import load_prompt_set
from hybrid_algos.train.model_files import load_tokenizer
from hybrid_algos.train.rollout_settings import RolloutSettings
from hybrid_algos.train.tiny import save_tiny_model
from hybrid_algos.train.tiny_vlm import save_tiny_vlm
from hybrid_algos.train.vision import load_vision_processor
from hybrid_core.errors import ConfigError

IMAGE_TOKENS = 4  # a 16 x 16 image: 4 x 4 patches of 4 pixels, merged 2 x 2


@pytest.fixture(scope="module")
def vlm(tmp_path_factory):
    path = save_tiny_vlm(str(tmp_path_factory.mktemp("vlm") / "model"))
    tokenizer = load_tokenizer("pretrain", path, trust_remote_code=False)
    return path, tokenizer, load_vision_processor(path, tokenizer)


def rollout(path, **overrides) -> RolloutSettings:
    values = dict(
        prompt_data=str(path),
        input_key="prompt",
        label_key="label",
        apply_chat_template=True,
        max_images_per_prompt=1,
        prompt_max_len=64,
        rollout_batch_size=1,
    )
    values.update(overrides)
    return RolloutSettings(**values)


def load(vlm, path, **overrides):
    _, tokenizer, vision = vlm
    return load_prompt_set(rollout(path, **overrides), tokenizer, vision=vision)[0]


def png(colour=(255, 0, 0)) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (16, 16), colour).save(buf, format="PNG")
    return buf.getvalue()


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def write_jsonl(path, records, *, blank_first=False):
    with open(path, "w") as f:
        if blank_first:
            f.write("\n")  # a blank line: record 0 is then on line 2
        for r in records:
            f.write(json.dumps(r) + "\n")
    return path


@pytest.mark.parametrize("layout", ["paths", "messages", "parquet"])
def test_every_layout_gives_the_images_and_their_expanded_placeholders(vlm, tmp_path, layout):
    _, tokenizer, _ = vlm
    prompts = load(vlm, write_dataset(str(tmp_path), 6, seed=3, layout=layout))
    reference = load(vlm, write_dataset(str(tmp_path / "ref"), 6, seed=3, layout="paths"))
    image_id = tokenizer.convert_tokens_to_ids("<|image_pad|>")
    assert [p.label for p in prompts] == ["red", "green", "blue"] * 2
    for p, ref in zip(prompts, reference):
        assert p.prompt_ids.count(image_id) == IMAGE_TOKENS  # one image, expanded to its grid's tokens
        assert p.prompt_ids == ref.prompt_ids  # the same prompt whatever the layout
        assert p.images.images == ref.images.images  # the same image bytes (PNG files read as they are)
        assert p.images.image_grid_thw.tolist() == [[1, 4, 4]]
        assert p.images.pixel_values is None  # pixels are made where the model runs, not kept on the driver
        assert "<|vision_start|><|image_pad|><|vision_end|>" in p.text and QUESTION in p.text


def test_a_text_prompt_places_its_images_at_its_marks_without_a_chat_template(vlm, tmp_path):
    _, tokenizer, _ = vlm
    path = write_jsonl(
        tmp_path / "d.jsonl", [{"prompt": "what <image> is <image>", "images": [b64(png()), b64(png())]}]
    )
    (p,) = load(vlm, path, apply_chat_template=False, max_images_per_prompt=2, label_key=None)
    image_id = tokenizer.convert_tokens_to_ids("<|image_pad|>")
    ids = p.prompt_ids
    assert ids.count(image_id) == 2 * IMAGE_TOKENS and len(p.images.images) == 2
    first = ids.index(image_id)
    assert tokenizer.convert_ids_to_tokens(ids[: first - 1]) == ["what"]  # the first image where it was marked
    (wrapped,) = load(
        vlm,
        path,
        apply_chat_template=False,
        max_images_per_prompt=2,
        label_key=None,
        input_template="user {} assistant",
    )
    assert wrapped.text == "user " + p.text + " assistant"  # --input_template wraps it, images and all
    assert wrapped.prompt_ids[1:-1] == ids


def test_a_missing_image_file_names_the_record_its_line_and_where_it_looked(vlm, tmp_path):
    records = [{"prompt": QUESTION, "images": [b64(png())], "label": "red"}] * 2
    records.append({"prompt": QUESTION, "images": ["img/nowhere.png"], "label": "red"})
    path = write_jsonl(tmp_path / "d.jsonl", records, blank_first=True)
    with pytest.raises(ConfigError) as e:
        load(vlm, path)
    assert e.value.field == "image_key"
    msg = str(e.value)
    assert "record 2 (line 4)" in msg and "image 1" in msg and "'img/nowhere.png'" in msg
    assert str(tmp_path / "img" / "nowhere.png") in msg  # relative to the dataset file's folder
    assert "Fix the path" in msg


def test_bytes_that_are_no_image_are_refused_by_record(vlm, tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = str(tmp_path / "d.parquet")
    records = [{"prompt": QUESTION, "images": [png()], "label": "red"}, {"prompt": QUESTION, "images": [b"not a png"]}]
    pq.write_table(pa.Table.from_pylist(records), path)
    with pytest.raises(ConfigError, match=r"record 1 of .*d\.parquet.*: image 1 \(9 bytes\) cannot be decoded") as e:
        load(vlm, path)
    assert "Replace it with a PNG or JPEG" in str(e.value)


def test_more_images_than_max_images_per_prompt_is_refused_with_the_number_to_use(vlm, tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [{"prompt": QUESTION, "images": [b64(png())] * 3, "label": "red"}])
    with pytest.raises(ConfigError) as e:
        load(vlm, path, max_images_per_prompt=2)
    assert e.value.field == "max_images_per_prompt"
    assert "record 0 (line 1)" in str(e.value) and "3 images" in str(e.value)
    assert "Raise --max_images_per_prompt to 3" in str(e.value)


def test_an_image_larger_than_the_prompt_budget_is_refused_not_silently_dropped(vlm, tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [{"prompt": QUESTION, "images": [b64(png())], "label": "red"}])
    with pytest.raises(ConfigError, match=r"record 0 .*an image takes 4 tokens, more than prompt_max_len=3"):
        load(vlm, path, prompt_max_len=3)


def test_web_addresses_are_refused_nothing_is_downloaded(vlm, tmp_path):
    part = {"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}}
    path = write_jsonl(tmp_path / "d.jsonl", [{"prompt": [{"role": "user", "content": [part]}]}])
    with pytest.raises(ConfigError, match=r"web address.*not downloaded at run time"):
        load(vlm, path, label_key=None)


def test_image_parts_without_a_payload_take_the_image_field_in_order_and_must_match_it(vlm, tmp_path):
    content = [{"type": "image"}, {"type": "text", "text": QUESTION}]
    ok = {"prompt": [{"role": "user", "content": content}], "images": [b64(png((0, 0, 255)))], "label": "blue"}
    (p,) = load(vlm, write_jsonl(tmp_path / "ok.jsonl", [ok]))
    assert p.images.images == (png((0, 0, 255)),)
    short = {
        "prompt": [{"role": "user", "content": [*content, {"type": "image"}]}],
        "images": [b64(png())],
        "label": "x",
    }
    with pytest.raises(ConfigError, match=r"record 0 .*2 image part\(s\) without an image.*holds only 1"):
        load(vlm, write_jsonl(tmp_path / "short.jsonl", [short]), max_images_per_prompt=2)


def test_text_training_refuses_records_that_hold_images_instead_of_dropping_them(vlm, tmp_path):
    _, tokenizer, _ = vlm
    path = write_jsonl(tmp_path / "d.jsonl", [{"prompt": QUESTION}, {"prompt": QUESTION, "images": ["a.png"]}])
    with pytest.raises(ConfigError) as e:
        load_prompt_set(rollout(path, max_images_per_prompt=0, label_key=None), tokenizer)
    assert e.value.field == "max_images_per_prompt" and "record 1 (line 2)" in str(e.value)
    assert "Set --max_images_per_prompt N" in str(e.value)


def test_a_text_model_cannot_take_images(tmp_path):
    path = save_tiny_model(str(tmp_path / "llama"))
    tokenizer = load_tokenizer("pretrain", path, trust_remote_code=False)
    with pytest.raises(ConfigError, match=r"is a text model .*no vision tower"):
        load_vision_processor(path, tokenizer)


@pytest.mark.parametrize(
    ("config", "flag"),
    [
        (dict(pretrain=None), "pretrain"),
        (dict(packing_samples=True), "packing_samples"),
        (dict(reward_pretrain="rm"), "reward_pretrain"),
        (dict(eval_dataset="held_out.jsonl"), "eval_dataset"),
        (dict(lora_rank=8), "lora_rank"),
        (dict(partial_rollout=True, async_train=True, backend="vllm"), "partial_rollout"),
    ],
)
def test_what_does_not_carry_images_yet_is_refused_before_the_run(tmp_path, config, flag):
    data = write_dataset(str(tmp_path), 3)
    values = dict(prompt_data=data, input_key="prompt", max_images_per_prompt=1, pretrain=str(tmp_path))
    with pytest.raises(ConfigError) as e:
        GRPOConfig(**{**values, **config}).validate()
    assert e.value.field == flag and "images" in str(e.value)


def test_ppos_critic_would_not_see_the_images_so_it_is_refused(tmp_path):
    data = write_dataset(str(tmp_path), 3)
    with pytest.raises(ConfigError, match=r"critic.*do not take images yet") as e:
        PPOConfig(prompt_data=data, input_key="prompt", max_images_per_prompt=1, pretrain=str(tmp_path)).validate()
    assert "GRPO or REINFORCE++" in str(e.value)


def test_openrlhfs_image_flags_are_the_settings_in_both_spellings(vlm, tmp_path):
    from hybrid_cli.main import load_config

    data = write_dataset(str(tmp_path), 3)
    common = ["--pretrain", vlm[0], "--prompt_data", data, "--input_key", "prompt", "--n_samples_per_prompt", "4"]
    for flags in (
        ["--data.image_key", "pics", "--data.max_images_per_prompt", "2"],
        ["--image_key", "pics", "--max_images_per_prompt", "2"],
    ):
        config, _, _ = load_config("grpo", [*common, *flags])
        assert (config.image_key, config.max_images_per_prompt) == ("pics", 2)
        assert config.rollout_settings().images
