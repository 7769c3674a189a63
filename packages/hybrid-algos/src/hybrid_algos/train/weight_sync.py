"""Weight sync for the training loop: the engines own it (:mod:`hybrid_engines.weight_sync`); this is the loop's name
for it. ``choose_mode(config, plan)`` runs before Ray (in ``prepare`` and ``--dry-run``); ``WeightSync`` is made once
per run (``setup()``, ``sync(wake_engines=...)``, ``close()``)."""

from hybrid_engines.weight_sync import (WeightSync, choose_sync_mode as choose_mode, describe_sync, sync_backend,
                                       sync_backend_note, verify_note)

__all__ = ["WeightSync", "choose_mode", "describe_sync", "sync_backend", "sync_backend_note", "verify_note"]
