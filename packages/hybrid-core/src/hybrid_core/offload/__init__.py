"""Offload and reload of a role's state: a plain torch module/optimizer, or a DeepSpeed engine.

``StateOffloader(module, optimizer).sleep()`` / ``.wake()`` and ``DeepSpeedOffloader(engine)`` both satisfy
:class:`Sleepable` and return :class:`hybrid_core.stats.TransferStats` for the step timeline.
"""

from .deepspeed_offload import DeepSpeedOffloader
from .host_buffers import HostBuffer, can_pin_memory
from .protocol import Sleepable, StateMover
from .torch_offload import AsleepError, StateOffloader

__all__ = [
    "AsleepError",
    "DeepSpeedOffloader",
    "HostBuffer",
    "Sleepable",
    "StateMover",
    "StateOffloader",
    "can_pin_memory",
]
