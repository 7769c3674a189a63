"""OpenRLHF's rewards (``--remote_rm_url``): a file defining ``reward_func(queries, prompts, labels)``, and HTTP
reward servers (a real local server started by each test): the protocol, timeouts, retries and clear errors."""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from hybrid_algos.train.remote_rewards import HttpReward, RewardFile, RewardServerError, scores_of
from hybrid_algos.train.rewards import load_reward_fn
from hybrid_core.errors import ConfigError
from timing_bounds import HANG_S

PROMPTS = ["s1 s2", "s3 s4", "s5 s6"]
COMPLETIONS = [" s1", " s3 s3", ""]
LABELS = ["a", "b", None]


class RewardServer:
    """A local reward server speaking OpenRLHF's protocol; ``behaviour`` scripts its answers."""

    def __init__(self, behaviour=None):
        self.requests: list[dict] = []
        self.behaviour = behaviour or (lambda n, body: (200, {"rewards": [len(q) for q in body["query"]]}))
        server = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):  # noqa: N802 - http.server's name
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                server.requests.append(body)
                status, answer = server.behaviour(len(server.requests), body)
                if status == "hang":
                    time.sleep(answer)
                    status, answer = 200, {"rewards": [0.0] * len(body["query"])}
                data = answer.encode() if isinstance(answer, str) else json.dumps(answer).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args):
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/get_reward"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def server_with():
    servers = []

    def make(behaviour=None):
        servers.append(RewardServer(behaviour))
        return servers[-1]

    yield make
    for s in servers:
        s.close()


def test_http_reward_speaks_openrlhf_s_protocol(server_with):
    server = server_with()
    fn = load_reward_fn(server.url)
    scores = fn(PROMPTS, COMPLETIONS, prompt_ids=[[1]] * 3, completion_ids=[[2]] * 3, labels=LABELS)
    assert scores == [len(p + c) for p, c in zip(PROMPTS, COMPLETIONS)]
    (request,) = server.requests
    assert request == {"query": [p + c for p, c in zip(PROMPTS, COMPLETIONS)], "prompts": PROMPTS, "labels": LABELS}


def test_several_servers_share_the_batch_in_order(server_with):
    a, b = server_with(), server_with(lambda n, body: (200, [100.0 + len(q) for q in body["query"]]))
    fn = load_reward_fn(f"{a.url},{b.url}")
    scores = fn(PROMPTS, COMPLETIONS, labels=LABELS)
    assert len(a.requests[0]["query"]) == 2 and len(b.requests[0]["query"]) == 1  # split evenly, order kept
    assert scores == [
        len(PROMPTS[0] + COMPLETIONS[0]),
        len(PROMPTS[1] + COMPLETIONS[1]),
        100.0 + len(PROMPTS[2] + COMPLETIONS[2]),
    ]


def test_a_server_error_is_retried_then_answered(server_with):
    server = server_with(lambda n, body: (503, "busy") if n < 3 else (200, {"rewards": [1.0] * len(body["query"])}))
    fn = HttpReward([server.url], timeout_s=5, tries=4, backoff_s=0.01)
    assert fn(PROMPTS, COMPLETIONS, labels=LABELS) == [1.0, 1.0, 1.0]
    assert len(server.requests) == 3


def test_a_server_that_keeps_failing_is_named_with_its_last_error(server_with):
    server = server_with(lambda n, body: (500, "boom"))
    fn = HttpReward([server.url], timeout_s=5, tries=3, backoff_s=0.01)
    with pytest.raises(RewardServerError, match=r"failed 3 time\(s\); last: HTTP 500.*boom") as e:
        fn(PROMPTS, COMPLETIONS, labels=LABELS)
    assert server.url in str(e.value) and "curl -X POST" in str(e.value)


def test_a_request_error_is_not_retried(server_with):
    server = server_with(lambda n, body: (422, "labels missing"))
    with pytest.raises(RewardServerError, match="HTTP 422"):
        HttpReward([server.url], tries=5, backoff_s=0.01)(PROMPTS, COMPLETIONS, labels=LABELS)
    assert len(server.requests) == 1


def test_a_hanging_server_times_out(server_with):
    release = threading.Event()  # the server answers only once released: only the client's timeout can end a try

    def hang(n, body):
        release.wait(HANG_S)
        return "hang", 0.0

    server = server_with(hang)
    fn = HttpReward([server.url], timeout_s=0.5, tries=2, backoff_s=0.01)
    try:
        with pytest.raises(RewardServerError, match=r"no answer within 0.5 s"):
            fn(PROMPTS, COMPLETIONS, labels=LABELS)
        assert not release.is_set() and len(server.requests) == 2  # both tries ended by the timeout, unanswered
    finally:
        release.set()


def test_no_server_at_the_url():
    fn = HttpReward(["http://127.0.0.1:9/none"], timeout_s=1, tries=2, backoff_s=0.01)
    with pytest.raises(RewardServerError, match=r"failed 2 time.*Connection"):
        fn(PROMPTS, COMPLETIONS, labels=LABELS)


@pytest.mark.parametrize(
    "answer, fragment",
    [
        ("not json", "not JSON"),
        ({"scores": [1, 2, 3]}, "without 'rewards'"),
        ({"rewards": [1, 2]}, "2 scores for 3 queries"),
        ({"rewards": [1, "x", 3]}, "not numbers"),
        ({"rewards": [1, float("nan"), 3]}, "non-finite"),
    ],
)
def test_malformed_answers_are_clear_errors(server_with, answer, fragment):
    server = server_with(lambda n, body: (200, json.dumps(answer) if not isinstance(answer, str) else answer))
    with pytest.raises(RewardServerError, match=fragment):
        HttpReward([server.url], tries=1)(PROMPTS, COMPLETIONS, labels=LABELS)


# ---- a reward file in OpenRLHF's shape ---------------------------------------------------------------------------
def test_openrlhf_reward_file_gets_queries_prompts_and_labels(tmp_path):
    path = tmp_path / "reward_func.py"
    path.write_text(
        "import torch\n"
        "SEEN = []\n"
        "def reward_func(queries, prompts, labels):\n"
        "    SEEN.append((queries, prompts, labels))\n"
        "    return torch.tensor([float(q.startswith(p)) + (l == 'a') for q, p, l in zip(queries, prompts, labels)])\n"
    )
    fn = load_reward_fn(str(path))
    assert isinstance(fn, RewardFile)
    scores = fn(PROMPTS, COMPLETIONS, prompt_ids=[[1]] * 3, completion_ids=[[2]] * 3, labels=LABELS)
    assert scores == [2.0, 1.0, 1.0]
    ((queries, prompts, labels),) = fn.fn.__globals__["SEEN"]
    assert queries == [p + c for p, c in zip(PROMPTS, COMPLETIONS)] and prompts == PROMPTS and labels == LABELS


def test_reward_file_returning_a_dict_of_rewards(tmp_path):
    path = tmp_path / "r.py"
    path.write_text(
        "def reward_func(queries, prompts, labels):\n"
        "    return {'rewards': [1.0] * len(queries), 'scores': [0.0] * len(queries), 'extra_logs': {}}\n"
    )
    assert load_reward_fn(str(path))(PROMPTS, COMPLETIONS, labels=LABELS) == [1.0, 1.0, 1.0]


def test_reward_file_without_reward_func_says_what_it_needs(tmp_path):
    path = tmp_path / "r.py"
    path.write_text("def score(prompts, completions, **kw):\n    return [0.0] * len(prompts)\n")
    with pytest.raises(ConfigError, match="defines no reward_func") as e:
        load_reward_fn(str(path))
    assert f"--reward_fn {path}:NAME" in e.value.fix
    assert load_reward_fn(f"{path}:score")(PROMPTS, COMPLETIONS) == [0.0] * 3  # hybrid's own form still works


def test_config_checks_the_openrlhf_forms_before_anything_starts(tmp_path):
    from hybrid_algos.train.config import GRPOConfig

    with pytest.raises(ConfigError, match="no reward file"):
        GRPOConfig(reward_fn=str(tmp_path / "missing.py")).validate()
    with pytest.raises(ConfigError, match="not an http"):
        GRPOConfig(reward_fn="http://,https:///x").validate()
    GRPOConfig(reward_fn="http://127.0.0.1:1/get_reward").validate()  # not contacted before the run


def test_scores_of_takes_lists_tensors_and_one_element_rows():
    import torch

    assert scores_of(torch.tensor([1.0, 2.0]), 2, "x") == [1.0, 2.0]
    assert scores_of([[1.0], [2.0]], 2, "x") == [1.0, 2.0]


_GIVE_UP = """
import sys, threading
from hybrid_algos.train.remote_rewards import HttpReward

reward = HttpReward([sys.argv[1]], timeout_s=60.0, tries=5, backoff_s=1.0)
asking = threading.Thread(target=lambda: reward(["p"], ["c"]), daemon=True)  # as the step's deadline runs it
asking.start()
asking.join(1.0)
print("gave up: the step's deadline ended the run", flush=True)
"""


def test_a_server_that_never_answers_does_not_hold_the_exit(tmp_path):
    """The run gives up on a silent server at the step's deadline; its retries must not keep the process alive
    (ThreadPoolExecutor threads are joined at exit: 5 tries x 60 s held it ~5 minutes after the error)."""
    import socket
    import subprocess
    import sys

    with socket.socket() as silent:  # accepts connections (the kernel's backlog) and never answers
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)
        url = f"http://127.0.0.1:{silent.getsockname()[1]}/get_reward"
        script = tmp_path / "give_up.py"
        script.write_text(_GIVE_UP)
        done = subprocess.run([sys.executable, str(script), url], capture_output=True, text=True, timeout=HANG_S)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "gave up" in done.stdout
