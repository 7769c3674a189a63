"""Our :class:`SamplingParams` in vLLM's and SGLang's own words (pure functions: no engine is imported here).

Seeded and greedy calls go out as one request per completion ("row"): prompt ``i`` becomes ``n`` requests with
``n=1``. Both engines fan an ``n > 1`` request out into ``n`` children internally (vLLM 0.26
``v1/engine/parallel_sampling.py``; their KV is shared only through the prefix cache), but rows let each completion
carry its own seed:

* vLLM gives child ``j`` the seed ``seed + j``, so two equal prompts in one batch with one seed would draw the same
  samples; SGLang (``layers/sampler.py``, deterministic mode) hashes ``(seed, position)``, so its ``n`` children with
  one seed would even be identical to each other.
* Here row ``(prompt, j)`` gets ``row_seed(seed, prompt ids, k, j)`` (``k`` counts earlier equal prompts in the
  call): reproducible whatever else is in the batch, different across samples and across repeated prompts.
* vLLM refuses greedy requests with ``n > 1`` (``sampling_params.py::_verify_greedy_sampling``); as rows, greedy
  ``n > 1`` just returns ``n`` equal completions, as the built-in engine does.

An unseeded, sampled call needs none of that, and the vLLM adapter sends it as one request per prompt with ``n``
(:func:`per_prompt_requests`): on an H100 the rows cost ~7 % of a 64 x 128-token generate call against vLLM's own
fan-out (``bench/generate_overhead.py``, 2026-11-24).

Stop tokens: with ``stop_at_eos`` (the default of every backend) a completion ends at ``stop_token_ids`` or the
model's EOS, and the stop token is included in the output ids (vLLM: ``v1/core/sched/utils.py::check_stop``
appends before it checks; SGLang: ``output_ids_through_stop``). Without it, vLLM gets ``ignore_eos=True`` and stops
only at ``stop_token_ids`` (but still keeps EOS out of the first ``min_new_tokens`` tokens: its min-tokens processor
bans ``all_stop_token_ids``, which always holds EOS). SGLang cannot do that: its ``ignore_eos`` also switches
``stop_token_ids`` off (``managers/schedule_batch.py::_check_token_based_finish``), so that combination is refused.
"""

from __future__ import annotations

import hashlib
import struct
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from hybrid_core.errors import ConfigError

from .protocol import SamplingParams

#: vLLM 0.26 rejects temperatures above this (``sampling_params.py::_verify_args``).
VLLM_MAX_TEMPERATURE = 2.0

#: Every ``vllm.SamplingParams`` field :func:`vllm_sampling_kwargs` sets (the contract test checks each exists).
VLLM_SAMPLING_FIELDS = (
    "n",
    "temperature",
    "top_p",
    "top_k",
    "max_tokens",
    "min_tokens",
    "stop_token_ids",
    "ignore_eos",
    "seed",
    "logprobs",
    "detokenize",
    "flat_logprobs",
)

#: Every SGLang sampling-parameter key :func:`sglang_sampling_params` sets (fields of
#: ``sglang.srt.sampling.sampling_params.SamplingParams`` in 0.5.23; the contract test checks each exists).
SGLANG_SAMPLING_FIELDS = (
    "n",
    "temperature",
    "top_p",
    "top_k",
    "max_new_tokens",
    "min_new_tokens",
    "stop_token_ids",
    "ignore_eos",
    "sampling_seed",
)


@dataclass(frozen=True)
class Row:
    """One completion to generate: sample ``sample`` of prompt ``prompt`` (indices into the call's lists)."""

    prompt: int
    sample: int
    seed: int | None


def row_seed(seed: int, prompt: Sequence[int], repeat: int, sample: int) -> int:
    """A 63-bit seed for sample ``sample`` of the ``repeat``-th occurrence of ``prompt`` under call seed ``seed``."""
    h = hashlib.blake2b(digest_size=8, person=b"hybrid-row")
    h.update(struct.pack("<qqq", seed, repeat, sample))
    h.update(struct.pack(f"<{len(prompt)}q", *prompt))
    return int.from_bytes(h.digest(), "little") >> 1


def expand_rows(prompts: Sequence[Sequence[int]], params: SamplingParams) -> list[Row]:
    """The rows of a call, prompt-major (prompt 0 samples 0..n-1, then prompt 1 ...).

    Greedy rows and calls without a seed get ``seed=None`` (greedy needs none; unseeded rows use the engine's RNG).
    """
    seen: Counter = Counter()
    rows = []
    for i, prompt in enumerate(prompts):
        key = tuple(prompt)
        repeat = seen[key]
        seen[key] += 1
        for j in range(params.n):
            seed = None if params.greedy or params.seed is None else row_seed(params.seed, key, repeat, j)
            rows.append(Row(i, j, seed))
    return rows


def per_prompt_requests(rows: Sequence[Row], params: SamplingParams) -> bool:
    """Whether a call can go out as one request per prompt with ``n`` (vLLM's own fan-out): sampled, unseeded, n > 1.
    Seeded rows need a request each (their own seed); vLLM refuses greedy ``n > 1``."""
    return params.n > 1 and not params.greedy and all(r.seed is None for r in rows)


def check_prompts(prompts: Sequence[Sequence[int]]) -> list[list[int]]:
    """Prompts as lists of ints; a clear error for an empty prompt or a non-integer id (engines fail obscurely)."""
    if isinstance(prompts, (str, bytes)) or not isinstance(prompts, Sequence):
        raise ConfigError(
            "prompt_token_ids",
            f"must be a list of token-id lists, got {type(prompts).__name__}.",
            "Tokenize first: engines take ids, never strings.",
        )
    out = []
    for i, p in enumerate(prompts):
        if isinstance(p, (str, bytes)) or not isinstance(p, Sequence) or len(p) == 0:
            raise ConfigError("prompt_token_ids", f"prompt {i} must be a non-empty list of token ids, got {p!r:.60}.")
        ids = list(p)
        if not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in ids):
            raise ConfigError("prompt_token_ids", f"prompt {i} holds something other than non-negative ints.")
        out.append(ids)
    return out


def vllm_sampling_kwargs(params: SamplingParams, *, seed: int | None, stop_at_eos: bool, n: int = 1) -> dict[str, Any]:
    """Keyword arguments of ``vllm.SamplingParams`` for one row (``n=1``), or for one prompt's ``n`` unseeded samples
    (see :func:`per_prompt_requests`), per vLLM 0.26 ``sampling_params.py``."""
    if not params.greedy and params.temperature > VLLM_MAX_TEMPERATURE:
        raise ConfigError(
            "temperature",
            f"vLLM accepts at most {VLLM_MAX_TEMPERATURE}, got {params.temperature}.",
            "Lower the temperature (or use the built-in engine).",
        )
    if n > 1 and (seed is not None or params.greedy):
        raise ConfigError(
            "n",
            "one vLLM request with n > 1 samples unseeded and at a temperature only (vLLM seeds "
            "its children seed, seed + 1, ... and refuses greedy n > 1).",
            "Send one request per sample.",
        )
    return {
        "n": n,
        # temperature < 1e-5 is vLLM's greedy switch; top_k=1 with a temperature is greedy too, so say it plainly.
        "temperature": 0.0 if params.greedy else params.temperature,
        "top_p": params.top_p,
        "top_k": 0 if params.top_k == -1 else params.top_k,  # vLLM's "off" is 0 (it "quietly accepts -1")
        "max_tokens": params.max_new_tokens,
        "min_tokens": params.min_new_tokens,
        "stop_token_ids": list(params.stop_token_ids),
        "ignore_eos": not stop_at_eos,
        "seed": seed,
        # logprobs=0: vLLM returns only the sampled token's logprob ("up to logprobs+1 elements"); raw or processed
        # is an engine setting (LLM(logprobs_mode="raw_logprobs")), not a request field.
        "logprobs": 0 if params.logprobs else None,
        "detokenize": False,  # ids in, ids out: no detokenizer work (no stop strings are used)
        # one flat list per request instead of a {token: Logprob} dict per token: far fewer objects to build and to
        # garbage-collect while the engine streams outputs (vLLM 0.26 ``FlatLogprobs``)
        "flat_logprobs": True,
    }


def sglang_sampling_params(params: SamplingParams, *, seed: int | None, stop_at_eos: bool) -> dict[str, Any]:
    """SGLang 0.5.23 sampling-parameter dict for one row (``n=1``); keys are fields of its ``SamplingParams``.

    Checked against ``sglang/srt/sampling/sampling_params.py`` (0.5.23): ``min_new_tokens`` exists (the seed project
    believed it unsupported); ``top_k=-1`` means the whole vocabulary; ``temperature`` below 1e-6 becomes
    ``top_k=1`` (greedy); ``sampling_seed`` is honoured only when the engine runs with
    ``enable_deterministic_inference`` (``sampling/sampling_batch_info.py``): the adapter checks that.
    """
    if not stop_at_eos and params.stop_token_ids:
        raise ConfigError(
            "stop_token_ids",
            "SGLang cannot stop at these ids while ignoring EOS: its ignore_eos turns stop_token_ids off too.",
            "Use stop_at_eos=True on SGLang, or the vLLM / built-in engine.",
        )
    return {
        "n": 1,
        "temperature": 0.0 if params.greedy else params.temperature,
        "top_p": params.top_p,
        "top_k": params.top_k,
        "max_new_tokens": params.max_new_tokens,
        "min_new_tokens": params.min_new_tokens,
        "stop_token_ids": list(params.stop_token_ids) or None,
        "ignore_eos": not stop_at_eos,
        "sampling_seed": seed,
    }


def sampled_logprobs(token_ids: Sequence[int], step_logprobs: Sequence[Any]) -> list[float]:
    """The logprob of each sampled token from vLLM's per-step ``{token_id: Logprob}`` maps, or from its
    ``FlatLogprobs`` (flat lists; with ``logprobs=0`` the sampled token is the first entry of every position)."""
    if len(step_logprobs) != len(token_ids):
        raise ValueError(f"vLLM returned {len(step_logprobs)} logprob steps for {len(token_ids)} tokens.")
    starts = getattr(step_logprobs, "start_indices", None)
    if starts is not None:
        flat: Any = step_logprobs  # vLLM's FlatLogprobs: a sequence with flat lists besides
        ids, values = flat.token_ids, flat.logprobs
        if len(values) == len(token_ids) and list(ids) == list(token_ids):  # one entry per position: the sampled one
            return [float(v) for v in values]
        if all(ids[s] == t for s, t in zip(starts, token_ids)):
            return [float(values[s]) for s in starts]
    return [float(step[tok].logprob) for tok, step in zip(token_ids, step_logprobs)]


def finish_reason(reason: Any, *, engine: str) -> str:
    """``"stop"`` / ``"length"`` from an engine's finish reason; anything else (abort, error) is a failure."""
    text = str(reason.get("type") if isinstance(reason, dict) else reason)
    if text in ("stop", "length"):
        return text
    from hybrid_core.errors import RoleFailure

    raise RoleFailure(f"{engine} generate: a request finished with {reason!r} instead of stop/length.")
