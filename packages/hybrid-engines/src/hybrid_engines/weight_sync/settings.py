"""The run's weight-sync section, in the sync's own words: what :func:`~.choice.choose_sync` decides the path and the
group backend from, and what :class:`~.driver.WeightSync` sends with.

The training config maps its flags onto these fields (``RLConfig.sync_settings()``); errors name them as
``sync.<field>`` and the config says them in its flags' words.
"""

from __future__ import annotations

from dataclasses import dataclass

from hybrid_core.errors import ConfigError

#: The sync paths one can ask for: auto (ipc when the engines share the trainer's GPUs, else broadcast), or either.
TRANSPORTS = ("auto", "ipc", "broadcast")
#: How much of each sync the engines check against the trainer's checksums (``hybrid_core.weight_sync.sampling``).
VERIFY_MODES = ("sampled", "full", "off")
#: The broadcast group's collective backends.
GROUP_BACKENDS = ("nccl", "gloo")
#: What a LoRA run's syncs carry (``adapter.py``): auto (the adapter alone where the engines take it, else merged
#: full weights), adapter (refused where the engines cannot take it) or merged.
LORA_MODES = ("auto", "adapter", "merged")


@dataclass(frozen=True)
class SyncSettings:
    """How the trainer's weights reach the engines after each update."""

    bucket_mb: int = 512  # one bucket of weights on the wire (and the staging memory it takes on each side)
    transport: str = "auto"  # one of TRANSPORTS
    # sampled: the first sync checks every tensor, later ones a rotating 1/32 | full: every sync all | off
    verify: str = "sampled"
    group_backend: str | None = None  # the broadcast group's (GROUP_BACKENDS); None: nccl with CUDA, gloo without
    lora: str = "auto"  # under LoRA (LORA_MODES): auto | adapter (the adapter alone each sync) | merged full weights

    @property
    def bucket_bytes(self) -> int:
        return self.bucket_mb << 20

    def validate(self) -> SyncSettings:
        """Refuse, as a :class:`ConfigError` naming the setting and the fix, values no sync can run; return self.
        What a placement or an engine cannot take is :func:`~.choice.choose_sync`'s (it needs the plan)."""
        size = self.bucket_mb
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise ConfigError(
                "sync.bucket_mb",
                f"must be a positive integer, got {size!r}.",
                "Give sync.bucket_mb a whole number >= 1.",
            )
        for name, value, choices in (
            ("transport", self.transport, TRANSPORTS),
            ("verify", self.verify, VERIFY_MODES),
            ("lora", self.lora, LORA_MODES),
        ):
            if value not in choices:
                raise ConfigError(
                    f"sync.{name}",
                    f"{value!r} is not one of {', '.join(choices)}.",
                    f"Use one of: {', '.join(choices)}.",
                )
        if self.group_backend not in (None, *GROUP_BACKENDS):
            raise ConfigError(
                "sync.group_backend",
                f"must be nccl or gloo, got {self.group_backend!r}.",
                "Use sync.group_backend nccl on GPUs (gloo is picked by itself on CPU).",
            )
        return self
