"""OpenRLHF's ``--input_template``: the text a prompt is put into, ``{}`` marking where.

Its own module, below :mod:`.data` (text prompts) and :mod:`.vision` (prompts with images), which both apply it."""

from __future__ import annotations

from hybrid_core.errors import ConfigError


def apply_input_template(template: str, text: str) -> str:
    """``template`` with its first ``{}`` replaced by ``text``; a template without one is refused."""
    if "{}" not in template:
        raise ConfigError(
            "input_template",
            f"{template!r} has no {{}} to put the prompt in.",
            'E.g. --input_template "User: {}\\nAssistant: ".',
        )
    return template.replace("{}", text, 1)
