"""Version floors, checked where the feature that needs them starts.

The pyprojects declare each floor (packages/*/pyproject.toml) and pip keeps to it. These checks are for installs
that did not: ``pip install --no-deps``, an environment pinned by hand, a copy of the source on the path. Such an
install would otherwise fail deep inside Ray or DeepSpeed -- or, worse, run without the behaviour hybrid relies on
(Ray without token authentication, a DeepSpeed that reports an overflowed gradient norm as finite). The error names
the package, the version found, the floor, what needs it, and the command that fixes it.
"""

from __future__ import annotations

import re

from .errors import ConfigError


def release(version: str) -> tuple[int, ...]:
    """The release numbers at the start of a version string: ``"2.52.0rc1"`` -> (2, 52, 0), ``"2.13.0+cpu"`` ->
    (2, 13, 0); ``()`` when it starts with none (a source build that reports no version)."""
    m = re.match(r"\s*v?(\d+(?:\.\d+)*)", str(version))
    return tuple(int(p) for p in m.group(1).split(".")) if m else ()


def at_least(version: str, floor: str) -> bool:
    """Whether ``version`` is ``floor`` or newer, by release numbers (``"2.52"`` == ``"2.52.0"``). A pre-release of the
    floor counts as the floor (it carries the feature, in every case checked here); an unreadable version passes,
    because nothing can be said about it."""
    have, need = release(version), release(floor)
    if not have:
        return True
    width = max(len(have), len(need))
    return have + (0,) * (width - len(have)) >= need + (0,) * (width - len(need))


def require(package: str, version: str, floor: str, needed_for: str) -> None:
    """Raise :class:`ConfigError` (field: the package) unless ``version`` of ``package`` is at least ``floor``."""
    if not at_least(version, floor):
        raise ConfigError(
            package,
            f"{needed_for} needs {package} >= {floor}; this environment has {package} {version}.",
            f"pip install '{package}>={floor}' (the floor hybrid declares; an install with --no-deps "
            "or a pinned environment skipped it).",
        )
