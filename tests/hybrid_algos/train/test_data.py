"""Prompt datasets: JSONL / JSON / Parquet / datasets folders, input keys, chat templates, length, errors."""

import json
import sys

import pytest

from hybrid_algos.train.data import SYNTHETIC_PROMPTS, load_prompt_set, load_prompts, read_records
from hybrid_algos.train.model_settings import ModelSettings
from hybrid_algos.train.rollout_settings import RolloutSettings
from hybrid_algos.train.tasks import BOS, SEP, task_from_config
from hybrid_algos.train.tiny import build_tiny_tokenizer
from hybrid_core.errors import ConfigError

CHAT_TEMPLATE = (
    "{{ bos_token }} {% for m in messages %}{{ m['content'] }} {% endfor %}"
    "{% if add_generation_prompt %}<sep>{% endif %}"
)
RECORDS = [
    {"prompt": "s1 s2", "messages": [{"role": "user", "content": "s1 s2"}], "answer": [1, 2]},
    {
        "prompt": "s3 s0 s5",
        "messages": [{"role": "system", "content": "s7"}, {"role": "user", "content": "s3"}],
        "answer": [3],
    },
    {"prompt": " ".join(["s4"] * 40), "messages": [{"role": "user", "content": " ".join(["s4"] * 40)}], "answer": []},
]


#: The built-in task of the runs without prompt data (the models section's default: copy, 2 symbols).
TASK = task_from_config(ModelSettings())


def settings(path, **overrides):
    """The rollout section of a run reading ``path`` (None: the built-in task's prompts)."""
    values = dict(
        prompt_data=None if path is None else str(path),
        input_key="prompt",
        max_samples=1_000_000,
        prompt_max_len=32,
        rollout_batch_size=4,
        seed=0,
    )
    values.update(overrides)
    return RolloutSettings(**values)


def bos_tokenizer():
    """The tiny tokenizer, made to add <bos> to every encoded text (as Llama's does)."""
    from tokenizers import processors

    tok = build_tiny_tokenizer()
    tok.backend_tokenizer.post_processor = processors.TemplateProcessing(
        single="<bos> $A", special_tokens=[("<bos>", BOS)]
    )
    return tok


@pytest.fixture
def tokenizer():
    return bos_tokenizer()


@pytest.fixture
def chat_tokenizer():
    tok = bos_tokenizer()
    tok.chat_template = CHAT_TEMPLATE
    return tok


@pytest.fixture
def jsonl(tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in RECORDS) + "\n\n")
    return path


def test_jsonl_plain_text_prompts_are_encoded_with_special_tokens(jsonl, tokenizer):
    prompts, stats = load_prompt_set(settings(jsonl, label_key="answer"), tokenizer)
    # the third prompt is 40 symbols (+ BOS) > prompt_max_len=32: dropped, not truncated, and counted
    assert [p.prompt_ids for p in prompts] == [[BOS, 5, 6], [BOS, 7, 4, 9]]
    assert [p.text for p in prompts] == ["s1 s2", "s3 s0 s5"]
    assert [p.label for p in prompts] == [[1, 2], [3]]
    assert (stats.records, stats.kept, stats.dropped_too_long) == (3, 2, 1)
    assert "1 dropped" in stats.describe()


def test_chat_messages_go_through_the_template_without_a_second_bos(jsonl, chat_tokenizer):
    prompts = load_prompts(settings(jsonl, input_key="messages", apply_chat_template=True), chat_tokenizer)
    assert prompts[0].prompt_ids == [BOS, 5, 6, SEP]  # template: <bos> contents <sep>; no extra BOS
    assert prompts[1].prompt_ids == [BOS, 11, 7, SEP]
    assert prompts[0].text.startswith("<bos>")


def test_plain_text_with_chat_template_becomes_one_user_message(jsonl, chat_tokenizer):
    prompts = load_prompts(settings(jsonl, apply_chat_template=True), chat_tokenizer)
    assert prompts[0].prompt_ids == [BOS, 5, 6, SEP]


def test_missing_chat_template_is_a_clear_error(jsonl, tokenizer):
    with pytest.raises(ConfigError, match="no chat template") as e:
        load_prompts(settings(jsonl, input_key="messages", apply_chat_template=True), tokenizer)
    assert e.value.field == "apply_chat_template"


def test_messages_without_apply_chat_template_say_to_add_it(jsonl, tokenizer):
    with pytest.raises(ConfigError, match="--apply_chat_template") as e:
        load_prompts(settings(jsonl, input_key="messages"), tokenizer)
    assert e.value.field == "apply_chat_template"


def test_unknown_input_key_names_the_keys_that_exist(jsonl, tokenizer):
    with pytest.raises(ConfigError, match="answer, messages, prompt") as e:
        load_prompts(settings(jsonl, input_key="question"), tokenizer)
    assert e.value.field == "input_key"
    with pytest.raises(ConfigError) as e:
        load_prompts(settings(jsonl, label_key="solution"), tokenizer)
    assert e.value.field == "label_key"


def test_max_samples_keeps_the_first_records(jsonl, tokenizer):
    prompts, stats = load_prompt_set(settings(jsonl, max_samples=1), tokenizer)
    assert [p.text for p in prompts] == ["s1 s2"] and stats.records == 1


def test_all_prompts_too_long_is_an_error(jsonl, tokenizer):
    with pytest.raises(ConfigError, match="longer than prompt_max_len=2") as e:
        load_prompts(settings(jsonl, prompt_max_len=2), tokenizer)
    assert e.value.field == "prompt_max_len"


def test_json_array_file(tmp_path, tokenizer):
    path = tmp_path / "p.json"
    path.write_text(json.dumps(RECORDS[:2]))
    assert len(load_prompts(settings(path), tokenizer)) == 2


@pytest.mark.parametrize(
    "content, match",
    [("", "holds no records"), ('{"prompt": "s1"}\n{oops\n', "line 2"), ('["a"]', "not a JSON object")],
)
def test_bad_files(tmp_path, tokenizer, content, match):
    path = tmp_path / ("p.json" if content.startswith("[") else "p.jsonl")
    path.write_text(content)
    with pytest.raises(ConfigError, match=match) as e:
        load_prompts(settings(path), tokenizer)
    assert e.value.field == "prompt_data"


def test_missing_file_and_unknown_format(tmp_path, tokenizer):
    with pytest.raises(ConfigError, match="no file or folder"):
        read_records(str(tmp_path / "nope.jsonl"))
    (tmp_path / "p.csv").write_text("prompt\ns1\n")
    with pytest.raises(ConfigError, match="cannot tell the format"):
        read_records(str(tmp_path / "p.csv"))
    (tmp_path / "empty_dir").mkdir()
    with pytest.raises(ConfigError, match="neither a datasets folder"):
        read_records(str(tmp_path / "empty_dir"))


def test_folder_of_files_keeps_the_split(tmp_path, tokenizer):
    data = tmp_path / "hub" / "data"
    data.mkdir(parents=True)
    (data / "train-00000.jsonl").write_text(json.dumps(RECORDS[0]) + "\n")
    (data / "train-00001.jsonl").write_text(json.dumps(RECORDS[1]) + "\n")
    (data / "test-00000.jsonl").write_text(json.dumps({"prompt": "s7"}) + "\n")
    prompts = load_prompts(settings(tmp_path / "hub"), tokenizer)
    assert [p.text for p in prompts] == ["s1 s2", "s3 s0 s5"]


def test_parquet(tmp_path, tokenizer, chat_tokenizer):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    path = tmp_path / "p.parquet"
    pq.write_table(pa.Table.from_pylist(RECORDS), path)
    assert [p.text for p in load_prompts(settings(path), tokenizer)] == ["s1 s2", "s3 s0 s5"]
    chat = load_prompts(settings(path, input_key="messages", apply_chat_template=True), chat_tokenizer)
    assert chat[0].prompt_ids == [BOS, 5, 6, SEP]


def test_datasets_folder_and_dataset_dict_split(tmp_path, tokenizer, chat_tokenizer):
    datasets = pytest.importorskip("datasets")
    ds = datasets.Dataset.from_list(RECORDS)
    ds.save_to_disk(str(tmp_path / "ds"))
    assert [p.text for p in load_prompts(settings(tmp_path / "ds"), tokenizer)] == ["s1 s2", "s3 s0 s5"]
    chat = load_prompts(settings(tmp_path / "ds", input_key="messages", apply_chat_template=True), chat_tokenizer)
    assert chat[1].prompt_ids == [BOS, 11, 7, SEP]
    datasets.DatasetDict({"train": ds.select([0]), "test": ds.select([1])}).save_to_disk(str(tmp_path / "dd"))
    assert [p.text for p in load_prompts(settings(tmp_path / "dd"), tokenizer)] == ["s1 s2"]
    assert [p.text for p in load_prompts(settings(tmp_path / "dd", prompt_split="test"), tokenizer)] == ["s3 s0 s5"]
    with pytest.raises(ConfigError, match="has no split 'dev'; it has: train, test") as e:
        load_prompts(settings(tmp_path / "dd", prompt_split="dev"), tokenizer)
    assert e.value.field == "prompt_split"


def test_missing_optional_readers_name_the_extra(tmp_path, tokenizer, monkeypatch):
    (tmp_path / "p.parquet").write_bytes(b"PAR1")
    (tmp_path / "ds").mkdir()
    (tmp_path / "ds" / "state.json").write_text("{}")
    monkeypatch.setitem(sys.modules, "pyarrow", None)  # import pyarrow -> ImportError
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)
    monkeypatch.setitem(sys.modules, "datasets", None)
    for path, what in ((tmp_path / "p.parquet", "pyarrow"), (tmp_path / "ds", "datasets")):
        with pytest.raises(ConfigError, match=rf"needs .*{what}.*hybrid-cli\[data\]"):
            load_prompts(settings(path), tokenizer)


def test_builtin_task_prompts(tokenizer):
    prompts, stats = load_prompt_set(settings(None), tokenizer, TASK)
    assert len(prompts) == SYNTHETIC_PROMPTS and stats.kept == SYNTHETIC_PROMPTS
    assert all(p.prompt_ids[0] == BOS and p.prompt_ids[-1] == SEP and len(p.label) == 2 for p in prompts)
    # enough for --max_steps, capped by --max_samples
    assert len(load_prompts(settings(None, max_steps=3, rollout_batch_size=5), tokenizer, TASK)) == 15
    assert len(load_prompts(settings(None, max_samples=7), tokenizer, TASK)) == 7
    # the same seed gives the same prompts (resume sees the same order)
    again = load_prompts(settings(None), tokenizer, TASK)
    assert [p.prompt_ids for p in again] == [p.prompt_ids for p in prompts]


def test_builtin_task_refuses_a_foreign_vocabulary():
    class OtherTokenizer:
        def convert_tokens_to_ids(self, token):
            return 100

    with pytest.raises(ConfigError, match="tiny demo model's vocabulary") as e:
        load_prompts(settings(None), OtherTokenizer(), TASK)
    assert e.value.field == "prompt_data"
