"""OpenRLHF's rewards (``--remote_rm_url``): a Python file defining ``reward_func``, or HTTP reward servers.

Both plug into ``--reward_fn`` (``--remote_rm_url`` is its OpenRLHF name) and are called like any reward function,
once per step with the whole batch (see :mod:`.rewards`):

* ``--reward_fn rewards.py`` -- a ``.py`` file without ``:function`` -- is OpenRLHF's shape: the file defines
  ``reward_func(queries, prompts, labels)``, where a *query* is the prompt followed by the completion as one text,
  and returns one score per query (a list or tensor), or a dict whose ``"rewards"`` are the scores (OpenRLHF >= 0.8;
  its ``"scores"`` and ``"extra_logs"`` are not used here).
* ``--reward_fn http://host:5000/get_reward`` (several comma-separated URLs share the batch) -- OpenRLHF's reward
  server protocol: POST ``{"query": [...], "prompts": [...], "labels": [...]}`` as JSON, answered with
  ``{"rewards": [...]}`` (or a bare list). Each request has a timeout and is retried with backoff; a server that
  stays down, answers an HTTP error or sends a malformed answer ends the step with an error naming the URL, what
  went wrong, and how to check the server.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from typing import Any
from urllib.parse import urlparse

from hybrid_core.errors import ConfigError, HybridError

#: OpenRLHF's name for the function in a reward file.
FUNCTION = "reward_func"


class RewardServerError(HybridError, RuntimeError):
    """A reward server did not answer, answered an error, or answered something that is not one score per query."""


def is_openrlhf_reward(spec: str) -> bool:
    return spec.startswith(("http://", "https://")) or (spec.endswith(".py") and ":" not in spec)


def check_openrlhf_reward(spec: str) -> None:
    """Errors a run can know before it starts: a missing file, a URL that is not one."""
    if spec.startswith(("http://", "https://")):
        for url in split_urls(spec):
            parsed = urlparse(url)
            if parsed.scheme not in ("http", "https") or not parsed.netloc:
                raise ConfigError(
                    "reward_fn",
                    f"{url!r} is not an http(s) URL.",
                    "Give reward servers as http://HOST:PORT/PATH, separated by commas.",
                )
        return
    if not os.path.isfile(spec):
        raise ConfigError(
            "reward_fn",
            f"no reward file at {spec!r}.",
            f"Give a Python file that defines {FUNCTION}(queries, prompts, labels).",
        )


def load_openrlhf_reward(spec: str) -> Callable[..., list[float]]:
    check_openrlhf_reward(spec)
    if spec.startswith(("http://", "https://")):
        return HttpReward(split_urls(spec))
    return RewardFile(spec)


def split_urls(spec: str) -> list[str]:
    return [u.strip() for u in spec.split(",") if u.strip()]


def _queries(prompts: Sequence[str], completions: Sequence[str]) -> list[str]:
    return [p + c for p, c in zip(prompts, completions)]


class RewardFile:
    """``reward_func(queries, prompts, labels)`` from a Python file, called with the whole batch."""

    def __init__(self, path: str):
        self.path = path
        loader_spec = importlib.util.spec_from_file_location(f"hybrid_openrlhf_reward_{abs(hash(path))}", path)
        if loader_spec is None or loader_spec.loader is None:
            raise ConfigError("reward_fn", f"cannot load {path!r} as a Python file.")
        module = importlib.util.module_from_spec(loader_spec)
        loader_spec.loader.exec_module(module)
        fn = getattr(module, FUNCTION, None)
        if not callable(fn):
            raise ConfigError(
                "reward_fn",
                f"{path!r} defines no {FUNCTION}(queries, prompts, labels), which "
                "OpenRLHF's reward files (--remote_rm_url FILE.py) provide.",
                f"Define {FUNCTION} in it, or name another function: --reward_fn {path}:NAME "
                "(hybrid's signature: fn(prompts, completions, **kw)).",
            )
        self.fn = fn

    def __call__(
        self, prompts: Sequence[str], completions: Sequence[str], *, labels: Sequence[Any] = (), **_: Any
    ) -> list[float]:
        labels = list(labels) or [None] * len(prompts)
        result = self.fn(_queries(prompts, completions), list(prompts), labels)
        return scores_of(result, len(prompts), f"{FUNCTION} in {self.path}")

    def __repr__(self) -> str:
        return f"RewardFile({self.path!r})"


class HttpReward:
    """OpenRLHF's reward-server protocol; the batch is split evenly over the servers, which are asked in parallel."""

    def __init__(self, urls: Sequence[str], *, timeout_s: float = 60.0, tries: int = 5, backoff_s: float = 1.0):
        if not urls:
            raise ConfigError(
                "reward_fn", "no reward server URL given.", "E.g. --reward_fn http://HOST:5000/get_reward."
            )
        self.urls = list(urls)
        self.timeout_s = timeout_s
        self.tries = tries
        self.backoff_s = backoff_s

    def __call__(
        self, prompts: Sequence[str], completions: Sequence[str], *, labels: Sequence[Any] = (), **_: Any
    ) -> list[float]:
        queries = _queries(prompts, completions)
        labels = list(labels) or [None] * len(queries)
        size = -(-len(queries) // len(self.urls))
        shards = [(url, slice(i * size, (i + 1) * size)) for i, url in enumerate(self.urls) if i * size < len(queries)]
        payloads = [(url, {"query": queries[s], "prompts": list(prompts[s]), "labels": labels[s]}) for url, s in shards]
        parts = _ask_all(self.ask, payloads)
        return [score for part in parts for score in part]

    def ask(self, url: str, payload: dict[str, list]) -> list[float]:
        """POST one shard; retried on connection errors, timeouts and 5xx answers, not on 4xx or bad answers."""
        body = json.dumps(payload).encode("utf-8")
        last = ""
        for attempt in range(1, self.tries + 1):
            request = urllib.request.Request(
                url, data=body, method="POST", headers={"Content-Type": "application/json"}
            )
            try:
                with urllib.request.urlopen(request, timeout=self.timeout_s) as response:
                    text = response.read().decode("utf-8", errors="replace")
            except urllib.error.HTTPError as e:
                detail = e.read().decode("utf-8", errors="replace")[:300]
                last = f"HTTP {e.code} {e.reason}: {detail}".strip()
                if e.code < 500:  # the request itself is wrong: asking again will not help
                    break
            except (urllib.error.URLError, TimeoutError, ConnectionError, OSError) as e:
                reason = getattr(e, "reason", e)
                last = (
                    f"no answer within {self.timeout_s:g} s"
                    if isinstance(reason, TimeoutError) or "timed out" in str(reason)
                    else f"{type(reason).__name__}: {reason}"
                )
            else:
                try:
                    answer = json.loads(text)
                except json.JSONDecodeError:
                    raise RewardServerError(
                        f"reward server {url} answered something that is not JSON: "
                        f'{text[:200]!r}. It must answer {{"rewards": [...]}}, one score per '
                        "query."
                    ) from None
                return scores_of(answer, len(payload["query"]), f"reward server {url}")
            if attempt < self.tries:
                time.sleep(self.backoff_s * 2 ** (attempt - 1))
        raise RewardServerError(
            f"reward server {url} failed {attempt} time(s); last: {last}. Check that it runs and "
            'answers POST requests of {"query", "prompts", "labels"} with {"rewards": [...]} '
            f"(e.g. curl -X POST {url} -H 'Content-Type: application/json' "
            '-d \'{"query": ["x"], "prompts": ["x"], "labels": [null]}\').'
        )

    def __repr__(self) -> str:
        return f"HttpReward({', '.join(self.urls)})"


def _ask_all(ask: Callable[[str, dict], list[float]], payloads: Sequence[tuple[str, dict]]) -> list[list[float]]:
    """``ask(url, payload)`` for every shard at once, in daemon threads, and their answers in order (the first error
    is raised). Daemon threads, not a ThreadPoolExecutor: the executor's threads are joined at interpreter exit, so a
    server that never answers held the process ~5 minutes (tries x timeout) after the step's deadline had already
    ended the run; a daemon thread still asking when the run gives up does not keep it alive."""
    results: list[Any] = [None] * len(payloads)

    def one(i: int, url: str, payload: dict) -> None:
        try:
            results[i] = ("ok", ask(url, payload))
        except BaseException as e:  # noqa: BLE001 - handed to the caller's thread
            results[i] = ("error", e)

    threads = [
        threading.Thread(target=one, args=(i, url, payload), name=f"hybrid-reward-server-{i}", daemon=True)
        for i, (url, payload) in enumerate(payloads)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()  # bounded by the caller: the reward function runs under the step's deadline (rewards.py)
    for kind, value in results:
        if kind == "error":
            raise value
    return [value for _, value in results]


def scores_of(result: Any, expected: int, where: str) -> list[float]:
    """One finite float per query from what a reward file or server returned (list, tensor, or dict of 'rewards')."""
    if isinstance(result, dict):
        if "rewards" not in result:
            raise RewardServerError(f"{where} returned a dict without 'rewards' (keys: {', '.join(map(str, result))}).")
        result = result["rewards"]
    if hasattr(result, "tolist"):  # a tensor or an array
        result = result.tolist()
    if not isinstance(result, (list, tuple)):
        raise RewardServerError(f"{where} returned {type(result).__name__}, not one score per query.")
    if len(result) != expected:
        raise RewardServerError(f"{where} returned {len(result)} scores for {expected} queries.")
    try:
        values = [float(v[0] if isinstance(v, (list, tuple)) and len(v) == 1 else v) for v in result]
    except (TypeError, ValueError):
        raise RewardServerError(f"{where} returned scores that are not numbers: {result[:5]!r}.") from None
    bad = [i for i, v in enumerate(values) if not math.isfinite(v)]
    if bad:
        raise RewardServerError(f"{where} returned non-finite scores at positions {bad[:10]}.")
    return values
