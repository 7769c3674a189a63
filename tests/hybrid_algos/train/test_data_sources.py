"""Where prompts come from, OpenRLHF's way: several datasets (``--prompt_data a,b``), mixed by
``--prompt_data_probs``, ``name@subfolder``, ``--input_template``, and Hugging Face ids resolved from the local cache
(a fake cache layout built here: no network)."""

from __future__ import annotations

import json
import os
from collections import Counter

import pytest

from hybrid_algos.train.data import cached_snapshot, interleave, load_prompt_set, resolve_local_paths
from hybrid_algos.train.prompt_sources import parse_probs, split_sources
from hybrid_algos.train.rollout_settings import RolloutSettings
from hybrid_algos.train.tiny import build_tiny_tokenizer
from hybrid_core.errors import ConfigError


def _jsonl(path, texts, key="prompt"):
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        for t in texts:
            f.write(json.dumps({key: t}) + "\n")
    return str(path)


def _config(prompt_data, **kw):
    base = dict(prompt_data=prompt_data, input_key="prompt", prompt_max_len=64, seed=1)
    return RolloutSettings(**{**base, **kw})


TOKENIZER = build_tiny_tokenizer(8)


def test_several_datasets_are_concatenated_without_probs(tmp_path):
    a = _jsonl(tmp_path / "a.jsonl", ["s1"] * 3)
    b = _jsonl(tmp_path / "b.jsonl", ["s2"] * 2)
    prompts, stats = load_prompt_set(_config(f"{a},{b}"), TOKENIZER)
    assert [p.text for p in prompts] == ["s1"] * 3 + ["s2"] * 2
    assert stats.records == 5 and stats.kept == 5


def test_probs_mix_the_datasets_like_openrlhf(tmp_path):
    a = _jsonl(tmp_path / "a.jsonl", [f"s1 s{i % 8}" for i in range(300)])
    b = _jsonl(tmp_path / "b.jsonl", [f"s2 s{i % 8}" for i in range(100)])
    prompts, stats = load_prompt_set(_config(f"{a},{b}", prompt_data_probs="0.5,0.5"), TOKENIZER)
    first = Counter(p.text.split()[0] for p in prompts)
    # "all exhausted": b (100) restarts until a (300) has been seen whole; draws ~50/50, so ~600 prompts
    assert first["s1"] >= 300 and first["s2"] >= 100
    assert 0.4 < first["s1"] / len(prompts) < 0.6
    again, _ = load_prompt_set(_config(f"{a},{b}", prompt_data_probs="0.5,0.5"), TOKENIZER)
    assert [p.text for p in again] == [p.text for p in prompts]  # seeded
    other, _ = load_prompt_set(_config(f"{a},{b}", prompt_data_probs="0.5,0.5", seed=2), TOKENIZER)
    assert [p.text for p in other] != [p.text for p in prompts]
    assert "mixed 0.5,0.5" in stats.describe()


def test_max_samples_applies_to_each_dataset(tmp_path):
    a = _jsonl(tmp_path / "a.jsonl", ["s1"] * 10)
    b = _jsonl(tmp_path / "b.jsonl", ["s2"] * 10)
    prompts, stats = load_prompt_set(_config(f"{a},{b}", max_samples=4), TOKENIZER)
    assert [p.text for p in prompts] == ["s1"] * 4 + ["s2"] * 4 and stats.records == 8


def test_interleave_weights_and_exhaustion():
    out = interleave([["a"] * 10, ["b"] * 1000], [0.9, 0.1], seed=0)
    counts = Counter(out)
    assert counts["b"] >= 1000 and counts["a"] >= 10 and 0.85 < counts["a"] / len(out) < 0.95


@pytest.mark.parametrize(
    "probs, fragment",
    [
        ("0.5", "1 weights for 2 dataset"),
        ("0.5,x", "comma-separated numbers"),
        ("1,0", "positive"),
        ("1,-1", "positive"),
    ],
)
def test_bad_probs_name_the_setting(probs, fragment):
    with pytest.raises(ConfigError, match=fragment) as e:
        parse_probs(probs, 2)
    assert e.value.field == "prompt_data_probs"


def test_at_subfolder_and_missing_parts_are_named(tmp_path):
    _jsonl(tmp_path / "ds" / "math" / "train.jsonl", ["s3"])
    assert split_sources(f"{tmp_path / 'ds'}@math")[0].path == str(tmp_path / "ds" / "math")
    prompts, _ = load_prompt_set(_config(f"{tmp_path / 'ds'}@math"), TOKENIZER)
    assert [p.text for p in prompts] == ["s3"]
    from hybrid_algos.train.prompt_sources import check_prompt_sources

    with pytest.raises(ConfigError, match=r"no file or folder at .*nope.jsonl.*from") as e:
        check_prompt_sources(f"{tmp_path / 'ds'}@math,{tmp_path / 'nope.jsonl'}")
    assert e.value.field == "prompt_data"


def test_input_template_wraps_plain_prompts(tmp_path):
    a = _jsonl(tmp_path / "a.jsonl", ["s1 s2"])
    prompts, _ = load_prompt_set(_config(a, input_template="s7 {} s0"), TOKENIZER)
    assert prompts[0].text == "s7 s1 s2 s0"
    with pytest.raises(ConfigError, match=r"has no {} to put the prompt in") as e:
        load_prompt_set(_config(a, input_template="no slot"), TOKENIZER)
    assert e.value.field == "input_template"


# ---- Hugging Face ids from the local cache ---------------------------------------------------------------------------
def _fake_hub_repo(cache, kind, repo_id, files, commit="0123abc"):
    repo = cache / f"{kind}s--{repo_id.replace('/', '--')}"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    snapshot = repo / "snapshots" / commit
    for name, text in files.items():
        (snapshot / name).parent.mkdir(parents=True, exist_ok=True)
        (snapshot / name).write_text(text)
    return snapshot


def test_ids_resolve_to_the_local_cache(tmp_path, monkeypatch):
    cache = tmp_path / "hub"
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    model = _fake_hub_repo(cache, "model", "OpenRLHF/Llama-3-8b-sft-mixture", {"config.json": "{}"})
    data = _fake_hub_repo(
        cache,
        "dataset",
        "OpenRLHF/prompt-collection-v0.1",
        {"data/train-00000.jsonl": json.dumps({"prompt": "s1"}) + "\n"},
    )
    changes, notes = resolve_local_paths(
        {
            "pretrain": "OpenRLHF/Llama-3-8b-sft-mixture",
            "prompt_data": "OpenRLHF/prompt-collection-v0.1,./local.jsonl",
            "reward_pretrain": None,
        }
    )
    assert changes == {"pretrain": str(model), "prompt_data": f"{data},./local.jsonl"}
    assert any(str(model) in n for n in notes) and any(str(data) in n for n in notes)
    prompts, _ = load_prompt_set(_config(str(data)), TOKENIZER)  # hub-style folder of data files
    assert [p.text for p in prompts] == ["s1"]


def test_hf_home_and_newest_snapshot_without_refs(tmp_path, monkeypatch):
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.delenv("HUGGINGFACE_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    repo = tmp_path / "hf" / "hub" / "models--org--m" / "snapshots" / "abc"
    repo.mkdir(parents=True)
    path, looked = cached_snapshot("org/m", "model")
    assert path == str(repo) and looked == str(tmp_path / "hf" / "hub" / "models--org--m")


def test_an_id_not_in_the_cache_names_the_cache_folder(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    with pytest.raises(ConfigError) as e:
        resolve_local_paths({"pretrain": "meta-llama/Llama-2-70b-hf"})
    assert e.value.field == "pretrain"
    assert str(tmp_path / "hub" / "models--meta-llama--Llama-2-70b-hf") in e.value.problem
    assert "not downloaded at run time" in e.value.problem and "hf download meta-llama/Llama-2-70b-hf" in e.value.fix
    with pytest.raises(ConfigError) as e:
        resolve_local_paths({"prompt_data": "org/data"})
    assert e.value.field == "prompt_data" and "datasets--org--data" in e.value.problem
    assert "--repo-type dataset" in e.value.fix


def test_local_paths_are_never_taken_for_ids(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.chdir(tmp_path)
    os.makedirs("models/tiny")
    assert resolve_local_paths({"pretrain": "models/tiny", "prompt_data": "data/p.jsonl"}) == ({}, [])
