"""OpenRLHF's rewards in real CPU runs of ``hybrid grpo``: an HTTP reward server (a local one, started here) given as
``--remote_rm_url URL``, and a reward file in OpenRLHF's shape given as ``--reward.remote_url FILE.py``. Each run
trains two steps of the tiny model on its own prompts; the rewards the run logs are the ones the reward returned."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from hybrid_cli.main import main

pytestmark = [pytest.mark.slow, pytest.mark.timeout(480)]

SMALL = [
    "--max_steps",
    "2",
    "--rollout_batch_size",
    "4",
    "--n_samples_per_prompt",
    "2",
    "--train_batch_size",
    "8",
    "--micro_train_batch_size",
    "8",
    "--micro_rollout_batch_size",
    "8",
    "--generate_max_len",
    "3",
    "--prompt_max_len",
    "16",
    "--init_kl_coef",
    "0",
    "--actor_learning_rate",
    "1e-3",
    "--seed",
    "11",
    "--call_timeout_s",
    "120",
    "--step_timeout_s",
    "240",
]


def _score(query: str, prompt: str) -> float:
    """What both rewards return: the completion's share of the symbol 's1' (deterministic, varied)."""
    completion = query[len(prompt) :]
    words = completion.split()
    return sum(w == "s1" for w in words) / max(len(words), 1)


@pytest.fixture
def prompts(tmp_path):
    path = tmp_path / "prompts.jsonl"
    with open(path, "w") as f:
        for i in range(16):
            f.write(json.dumps({"prompt": f"s{i % 8} s{(i // 8) % 8}", "label": "s1"}) + "\n")
    return str(path)


@pytest.fixture
def reward_server():
    answers: list[list[float]] = []
    requests: list[dict] = []

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            scores = [_score(q, p) for q, p in zip(body["query"], body["prompts"])]
            requests.append(body)
            answers.append(scores)
            data = json.dumps({"rewards": scores}).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args):
            pass

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}/get_reward", requests, answers
    httpd.shutdown()
    httpd.server_close()


def _metrics(run):
    with open(run / "metrics.jsonl") as f:
        return [json.loads(line) for line in f]


def _prepare_cpu_ops():
    from hybrid_algos.train.deepspeed_ops import ensure_cpu_ops_built

    ensure_cpu_ops_built()  # compiled once per machine; not this test's subject


def test_http_reward_server_trains_a_cpu_run(tmp_path, tiny_model_dir, prompts, reward_server):
    import ray

    _prepare_cpu_ops()
    url, requests, answers = reward_server
    run = tmp_path / "run"
    argv = [
        "grpo",
        "--pretrain",
        tiny_model_dir,
        "--prompt_data",
        prompts,
        "--input_key",
        "prompt",
        "--label_key",
        "label",
        "--remote_rm_url",
        url,
        "--save_path",
        str(run),
        *SMALL,
    ]
    assert main(argv) == 0
    assert not ray.is_initialized()
    assert len(requests) == 2  # one request per step, the whole batch
    for body in requests:
        assert len(body["query"]) == 8 and body["labels"] == ["s1"] * 8
        assert all(q.startswith(p) for q, p in zip(body["query"], body["prompts"]))
    lines = _metrics(run)
    assert [m["step"] for m in lines] == [0, 1]
    for m, scores in zip(lines, answers):  # what the run trained on is what the server answered
        assert m["reward"] == pytest.approx(sum(scores) / len(scores), abs=1e-6)


def test_openrlhf_reward_file_trains_a_cpu_run(tmp_path, tiny_model_dir, prompts):
    _prepare_cpu_ops()
    calls = tmp_path / "calls.jsonl"
    reward = tmp_path / "reward_func.py"
    reward.write_text(
        "import json, torch\n"
        "def reward_func(queries, prompts, labels):\n"
        "    scores = [sum(w == 's1' for w in q[len(p):].split()) / max(len(q[len(p):].split()), 1)"
        " for q, p in zip(queries, prompts)]\n"
        f"    with open({str(calls)!r}, 'a') as f:\n"
        "        f.write(json.dumps({'n': len(queries), 'labels': labels, 'scores': scores}) + '\\n')\n"
        "    return torch.tensor(scores)\n"
    )
    run = tmp_path / "run"
    # OpenRLHF 0.11.2's spelling: an OpenRLHF command line (its defaults: no engines, so the built-in engine on the
    # actor's one GPU; bf16 turned off for the CPU)
    argv = [
        "grpo",
        "--actor.model_name_or_path",
        tiny_model_dir,
        "--data.prompt_dataset",
        prompts,
        "--data.input_key",
        "prompt",
        "--data.label_key",
        "label",
        "--reward.remote_url",
        str(reward),
        "--actor.num_gpus_per_node",
        "1",
        "--no_bf16",
        "--ckpt.output_dir",
        str(run),
        *SMALL,
    ]
    assert main(argv) == 0
    recorded = [json.loads(line) for line in calls.read_text().splitlines()]
    assert [r["n"] for r in recorded] == [8, 8] and all(r["labels"] == ["s1"] * 8 for r in recorded)
    for m, r in zip(_metrics(run), recorded):
        assert m["reward"] == pytest.approx(sum(r["scores"]) / len(r["scores"]), abs=1e-6)
    # OpenRLHF's default of no engines ran as the built-in engine on the actor's GPU
    layout = json.loads((run / "logs" / "placement.json").read_text())
    assert layout["roles"]["rollout"][0]["plan_gpus"] == layout["roles"]["actor"][0]["plan_gpus"] == [0]
