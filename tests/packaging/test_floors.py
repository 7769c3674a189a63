"""Dependency floors: the versions the pyprojects declare are the ones the code checks where a feature needs them
(hybrid_core.versions), the ones the ``floors`` hatch environment installs exactly (hatch.toml), and an install that
skipped them (``--no-deps``) is refused with the package, the version found, the floor and the fix -- before Ray
starts or DeepSpeed builds an engine. The old versions are given as fake version strings (the real old packages
cannot be installed beside the current ones in one process)."""

from __future__ import annotations

from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from hybrid_core import versions
from hybrid_core.errors import ConfigError

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    tomllib = pytest.importorskip("tomli")

ROOT = Path(__file__).resolve().parents[2]


def _toml(path: str) -> dict:
    return tomllib.loads((ROOT / path).read_text())


def declared_floor(dist: str, package: str, extra: str = "") -> str:
    """The ``>=`` bound a package's pyproject gives ``package`` (in ``extra``, or its dependencies)."""
    project = _toml(f"packages/{dist}/pyproject.toml")["project"]
    reqs = project["optional-dependencies"][extra] if extra else project["dependencies"]
    (req,) = [Requirement(r) for r in reqs if canonicalize_name(Requirement(r).name) == package]
    (floor,) = [s.version for s in req.specifier if s.operator == ">="]
    return floor


def floors_env_pin(package: str) -> str:
    """The exact version the ``floors`` environment of hatch.toml installs of ``package``."""
    reqs = [Requirement(r) for r in _toml("hatch.toml")["envs"]["floors"]["extra-dependencies"]]
    (req,) = [r for r in reqs if canonicalize_name(r.name) == package]
    (pin,) = [s.version for s in req.specifier if s.operator == "=="]
    return pin


def same_release(a: str, b: str) -> bool:
    return versions.at_least(a, b) and versions.at_least(b, a)


@pytest.mark.parametrize(
    "version, floor, ok",
    [
        ("2.52.0", "2.52", True),
        ("2.52", "2.52.0", True),
        ("2.60.0", "2.52", True),
        ("3.0", "2.52", True),
        ("2.51.2", "2.52", False),
        ("2.9.3", "2.52", False),
        ("2.52.0rc1", "2.52", True),
        ("0.19.8", "0.19.8", True),
        ("0.19.7", "0.19.8", False),
        ("0.19.10", "0.19.8", True),
        ("0.19.8+cpu", "0.19.8", True),
        ("2.13.0+cpu", "2.6", True),
        ("0.18.9", "0.19.8", False),
        ("unknown", "2.52", True),  # a source build that reports no version: nothing can be said, so it passes
    ],
)
def test_at_least_compares_release_numbers(version, floor, ok) -> None:
    assert versions.at_least(version, floor) is ok


def test_require_names_the_package_the_versions_the_need_and_the_fix() -> None:
    versions.require("ray", "2.52.0", "2.52", "token authentication")  # at the floor: nothing raised
    with pytest.raises(ConfigError) as e:
        versions.require("ray", "2.51.2", "2.52", "token authentication of the cluster")
    assert e.value.field == "ray"
    assert (
        "ray >= 2.52" in e.value.problem and "ray 2.51.2" in e.value.problem and "token authentication" in str(e.value)
    )
    assert "pip install 'ray>=2.52'" in e.value.fix


def test_the_checks_floors_are_the_declared_floors_and_the_floors_env_installs_them() -> None:
    from hybrid_algos.train.deepspeed_setup import DEEPSPEED_FLOOR
    from hybrid_core.cluster import RAY_FLOOR

    assert declared_floor("hybrid-core", "ray") == RAY_FLOOR
    assert declared_floor("hybrid-algos", "deepspeed", "train") == DEEPSPEED_FLOOR
    assert declared_floor("hybrid-core", "deepspeed", "deepspeed") == DEEPSPEED_FLOOR
    transformers = declared_floor("hybrid-engines", "transformers")
    assert declared_floor("hybrid-algos", "transformers", "train") == transformers
    for package, floor in (("ray", RAY_FLOOR), ("deepspeed", DEEPSPEED_FLOOR), ("transformers", transformers)):
        assert same_release(floors_env_pin(package), floor), (
            f"hatch.toml's floors env installs {package}=={floors_env_pin(package)}, the pyprojects declare "
            f"{package}>={floor}: pin the floor there (or the lowest {floor}.x on the index)"
        )


def test_connect_refuses_a_ray_without_token_authentication_before_anything_starts(monkeypatch) -> None:
    ray = pytest.importorskip("ray")
    from hybrid_core import cluster

    monkeypatch.setattr(ray, "__version__", "2.51.2")  # what `pip install --no-deps` over an old Ray leaves
    was_up = ray.is_initialized()
    with pytest.raises(ConfigError) as e:  # an unreachable address: without the check it fails on "address"
        cluster.connect("127.0.0.1:1")
    assert e.value.field == "ray" and "2.51.2" in str(e.value) and "RAY_AUTH_MODE" in str(e.value)
    assert ray.is_initialized() == was_up


def test_a_trained_role_refuses_a_deepspeed_that_hides_an_overflowed_gradient(monkeypatch) -> None:
    deepspeed = pytest.importorskip("deepspeed")
    import torch

    from hybrid_algos.train.deepspeed_setup import make_engine

    monkeypatch.setattr(deepspeed, "__version__", "0.19.7")
    with pytest.raises(ConfigError) as e:  # raised before deepspeed.initialize is reached
        make_engine(torch.nn.Linear(2, 2), {"train_micro_batch_size_per_gpu": 1})
    assert e.value.field == "deepspeed" and "deepspeed >= 0.19.8" in str(e.value) and "0.19.7" in str(e.value)
