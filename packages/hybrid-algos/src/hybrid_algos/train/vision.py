"""The processor path of vision-language prompts: a record's prompt and images (:mod:`.images`) -> token ids with
each image's placeholder expanded, and the images as the engines and trainer take them
(:class:`~hybrid_engines.protocol.MultimodalInput`).

The model folder's own processor does it (transformers' ``AutoProcessor``: its chat template with image parts, its
image processor's grid, its placeholder expansion). Where that processor class cannot be built -- Qwen2-VL's
processor also builds a video processor, which needs torchvision -- the same three steps run from the folder's
parts: the tokenizer's chat template, ``AutoImageProcessor`` (the PIL backend) and the placeholder expanded to
``grid.prod() / merge_size**2`` image tokens, exactly what ``Qwen2VLProcessor`` does for images.

Each prompt keeps the images' encoded bytes and grids, not their pixel values (a data set's pixels would not fit in
the driver's memory): the built-in engine and the trainer make the pixels where the model runs
(:func:`hybrid_engines.multimodal.with_pixels`), checked against the grid kept here. A worker's rollout gets them by
:func:`rollout_pixels`.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from hybrid_core.errors import ConfigError
from hybrid_engines.multimodal import decode_images, is_vision_config, load_image_processor, with_pixels
from hybrid_engines.protocol import MultimodalInput

from .images import IMAGE_MARK, Place, record_images, refuse_unrequested_images
from .input_template import apply_input_template
from .tasks import Prompt

log = logging.getLogger(__name__)


class VisionProcessor:
    """A vision-language model folder's prompt processor (see the module docstring)."""

    def __init__(self, tokenizer: Any, image_processor: Any, *, processor: Any = None, model_path: str = "") -> None:
        self.tokenizer = tokenizer
        self.image_processor = image_processor
        self.processor = processor  # transformers' own, when it could be built
        self.model_path = model_path
        self.image_token = getattr(processor, "image_token", None) or "<|image_pad|>"
        if tokenizer.convert_tokens_to_ids(self.image_token) in (None, tokenizer.unk_token_id):
            raise ConfigError(
                "pretrain",
                f"the tokenizer of {model_path!r} has no image token {self.image_token!r}.",
                "Use a Qwen2-VL / Qwen2.5-VL model folder (its tokenizer holds the vision tokens).",
            )
        self.merge_size = int(getattr(image_processor, "merge_size", 1) or 1)
        start, end = "<|vision_start|>", "<|vision_end|>"
        vocab = tokenizer.get_vocab()
        self.placeholder = f"{start}{self.image_token}{end}" if start in vocab and end in vocab else self.image_token

    def render(self, messages: list[dict]) -> str:
        """Chat messages (image parts as ``{"type": "image"}``) through the model's chat template, with the
        generation prompt."""
        owner = self.processor if getattr(self.processor, "chat_template", None) else self.tokenizer
        return owner.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)

    def encode(self, text: str, images: Sequence[bytes]) -> tuple[list[int], MultimodalInput]:
        """Token ids of ``text`` (one placeholder per image, in order) with each image's tokens expanded, and the
        images with their grids."""
        pil = decode_images(MultimodalInput(tuple(images)))
        if self.processor is not None:
            out = self.processor(text=[text], images=pil, return_tensors="pt")
            ids, grid = out["input_ids"][0].tolist(), out["image_grid_thw"]
        else:
            grid = self.image_processor(images=pil, return_tensors="pt")["image_grid_thw"]
            pieces = text.split(self.image_token)
            if len(pieces) - 1 != len(images):
                raise ValueError(f"{len(pieces) - 1} image placeholders for {len(images)} images")
            counts = (grid.prod(-1) // self.merge_size**2).tolist()
            expanded = pieces[0] + "".join(self.image_token * int(c) + rest for c, rest in zip(counts, pieces[1:]))
            ids = list(self.tokenizer(expanded, add_special_tokens=False)["input_ids"])
        return ids, MultimodalInput(tuple(images), None, grid.long())


def load_vision_processor(model_path: str, tokenizer: Any, *, trust_remote_code: bool = False) -> VisionProcessor:
    """The folder's processor (``AutoProcessor``), or its parts where the processor class cannot be built here."""
    from transformers import AutoConfig, AutoProcessor

    config = AutoConfig.from_pretrained(model_path, trust_remote_code=trust_remote_code)
    if not is_vision_config(config):
        raise ConfigError(
            "max_images_per_prompt",
            f"--pretrain {model_path!r} is a text model ({type(config).__name__}: no vision tower), so it cannot "
            "take the prompts' images.",
            "Use a vision-language model (Qwen2-VL / Qwen2.5-VL), or --max_images_per_prompt 0 and text prompts.",
        )
    image_processor = load_image_processor(model_path, trust_remote_code=trust_remote_code)
    try:
        processor = AutoProcessor.from_pretrained(model_path, trust_remote_code=trust_remote_code)
    except Exception as e:  # e.g. Qwen2-VL's video processor needs torchvision
        log.info(
            "%s: its processor cannot be built here (%s: %s); using its tokenizer and image processor",
            model_path,
            type(e).__name__,
            e,
        )
        processor = None
    if processor is not None and not callable(getattr(processor, "image_processor", None)):
        processor = None  # AutoProcessor fell back to the tokenizer alone
    return VisionProcessor(tokenizer, image_processor, processor=processor, model_path=model_path)


def encode_image_records(
    records: Sequence[dict[str, Any]],
    vision: VisionProcessor,
    *,
    input_key: str,
    image_key: str,
    max_images: int,
    label_key: str | None = None,
    apply_chat_template: bool = False,
    prompt_max_len: int = 1024,
    source: str = "prompt_data",
    path: str | None = None,
    input_template: str | None = None,
) -> tuple[list[Prompt], int]:
    """Every record's prompt with its images (:func:`.images.record_images`) through the processor; returns the
    prompts and how many were dropped for length (as :func:`.data.encode_records`). An image whose tokens alone
    exceed ``prompt_max_len`` is refused by its record: dropping every such prompt would hide a resolution setting
    that makes all images too large."""
    prompts, dropped = [], 0
    for i, record in enumerate(records):
        place = Place(source, i, path)
        got = record_images(record, input_key=input_key, image_key=image_key, max_images=max_images, place=place)
        text = _render(got.prompt, vision, apply_chat_template, place)
        if input_template and not apply_chat_template:  # OpenRLHF's --input_template, as for text prompts
            text = apply_input_template(input_template, text)
        try:
            ids, mm = vision.encode(text, got.images)
        except ConfigError:
            raise
        except Exception as e:  # the image processor's own refusals (an extreme aspect ratio, ...)
            raise ConfigError(
                "image_key",
                f"{place}: the model's processor refuses its images: {type(e).__name__}: {e}.",
                "Resize the image (or fix the prompt's image placeholders), or drop it from the record.",
            ) from None
        per_image = (mm.image_grid_thw.prod(-1) // vision.merge_size**2).tolist() if got.images else []
        if per_image and max(per_image) > prompt_max_len:
            raise ConfigError(
                "prompt_max_len",
                f"{place}: an image takes {max(per_image)} tokens, more than prompt_max_len={prompt_max_len}.",
                f"Raise --prompt_max_len above {max(per_image)}, or give smaller images (or a smaller max_pixels in "
                "the model's preprocessor_config.json).",
            )
        if len(ids) > prompt_max_len:
            dropped += 1
            continue
        label = record[label_key] if label_key else None
        prompts.append(Prompt(ids, text, label=label, images=mm if got.images else None))
    if not prompts:
        raise ConfigError(
            "prompt_max_len",
            f"all {len(records)} prompts of {source!r} are longer than prompt_max_len={prompt_max_len} tokens "
            "(image tokens included).",
            "Raise --prompt_max_len.",
        )
    return prompts, dropped


def _render(prompt: Any, vision: VisionProcessor, apply_chat_template: bool, place: Place) -> str:
    if isinstance(prompt, list):
        if not apply_chat_template:
            raise ConfigError(
                "apply_chat_template",
                f"{place} holds chat messages, not text.",
                "Add --apply_chat_template to render them with the model's chat template.",
            )
        return vision.render(prompt)
    if not isinstance(prompt, str):
        raise ConfigError("input_key", f"{place}: the prompt is a {type(prompt).__name__}, not text or messages.")
    if apply_chat_template:  # a text prompt with images: one user message, the images first (or where marked)
        pieces = prompt.split(IMAGE_MARK)
        content: list[dict] = []
        for j, piece in enumerate(pieces):
            if j:
                content.append({"type": "image"})
            if piece:
                content.append({"type": "text", "text": piece})
        return vision.render([{"role": "user", "content": content}])
    return prompt.replace(IMAGE_MARK, vision.placeholder)


def check_text_records(records: Sequence[dict[str, Any]], rollout: Any, source: str, path: str | None) -> None:
    """Text training: refuse records that hold images (:func:`.images.refuse_unrequested_images`)."""
    refuse_unrequested_images(
        records, input_key=rollout.input_key, image_key=rollout.image_key, source=source, path=path
    )


# ---- a worker's side ---------------------------------------------------------------------------------------------
def rollout_pixels(rollout: Any, worker: Any) -> Any:
    """``rollout`` with its images' pixel values, made with the worker's model folder's image processor (loaded
    once, on first use); a text rollout as it is."""
    if getattr(rollout, "images", None) is None:
        return rollout
    processor = getattr(worker, "_image_processor", None)
    if processor is None:
        processor = load_image_processor(worker.model_path, trust_remote_code=worker.settings.models.trust_remote_code)
        worker._image_processor = processor
    import dataclasses

    return dataclasses.replace(rollout, images=with_pixels(rollout.images, processor))
