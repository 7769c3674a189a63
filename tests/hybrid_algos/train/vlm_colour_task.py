"""The visual task of the vision-language tests: "what colour is the square?" over generated 16 x 16 images (a red,
green or blue square on a grey background, its shade, size and place drawn at random), and its rule reward, which
reads the sample's images (the reward signature of vision-language runs: ``images=`` per completion)."""

from __future__ import annotations

import io
import json
import os
import random

from PIL import Image

COLOURS = {"red": (220, 30, 30), "green": (30, 200, 30), "blue": (30, 30, 220)}
QUESTION = "what colour is the square ?"


def square_image(colour: str, rng: random.Random) -> Image.Image:
    grey = rng.randrange(90, 170)
    img = Image.new("RGB", (16, 16), (grey, grey, grey))
    size = rng.randrange(8, 13)
    x, y = rng.randrange(0, 17 - size), rng.randrange(0, 17 - size)
    shade = [max(0, min(255, c + rng.randrange(-25, 26))) for c in COLOURS[colour]]
    img.paste(tuple(shade), (x, y, x + size, y + size))
    return img


def write_dataset(folder: str, count: int, *, seed: int = 0, layout: str = "paths") -> str:
    """``count`` records in ``folder``: ``layout`` "paths" (JSONL, PNG files beside it, OpenRLHF's ``images``
    field), "messages" (JSONL, chat messages with the image inline as base64 parts) or "parquet" (image bytes)."""
    import base64

    rng = random.Random(seed)
    os.makedirs(os.path.join(folder, "img"), exist_ok=True)
    records = []
    for i in range(count):
        colour = list(COLOURS)[i % 3]
        img = square_image(colour, rng)
        buf = io.BytesIO()
        img.save(buf, format="PNG")
        if layout == "paths":
            name = f"img/{i}.png"
            img.save(os.path.join(folder, name))
            records.append({"prompt": QUESTION, "images": [name], "label": colour})
        elif layout == "messages":
            part = {"type": "image", "image": base64.b64encode(buf.getvalue()).decode()}
            content = [part, {"type": "text", "text": QUESTION}]
            records.append({"prompt": [{"role": "user", "content": content}], "label": colour})
        else:
            records.append({"prompt": QUESTION, "images": [buf.getvalue()], "label": colour})
    if layout == "parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        path = os.path.join(folder, "data.parquet")
        pq.write_table(pa.Table.from_pylist(records), path)
        return path
    path = os.path.join(folder, "data.jsonl")
    with open(path, "w") as f:
        for r in records:
            f.write(json.dumps(r) + "\n")
    return path


def seen_colour(image: Image.Image) -> str:
    """The square's colour, read off the image itself (the most saturated pixel's strongest channel)."""
    pixels = list(image.convert("RGB").getdata())
    r, g, b = max(pixels, key=lambda p: max(p) - min(p))
    return ("red", "green", "blue")[max(range(3), key=lambda c: (r, g, b)[c])]


def reward(prompts, completions, *, prompt_ids, completion_ids, labels, images, **_):
    """1 when the answer's first word names the square's colour -- taken from the sample's own image, which the
    label must agree with (so the test also shows the reward got each sample's images)."""
    out = []
    for text, label, imgs in zip(completions, labels, images):
        assert len(imgs) == 1 and seen_colour(imgs[0]) == label, "the reward got another sample's image"
        words = text.split()
        out.append(1.0 if words and words[0] == label else 0.0)
    return out
