"""SamplingParams -> vLLM / SGLang request parameters (pure functions; the engines are not needed)."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest

from hybrid_core.errors import ConfigError, RoleFailure
from hybrid_engines.protocol import SamplingParams
from hybrid_engines.sampling_map import (
    SGLANG_SAMPLING_FIELDS,
    VLLM_SAMPLING_FIELDS,
    check_prompts,
    expand_rows,
    finish_reason,
    per_prompt_requests,
    row_seed,
    sampled_logprobs,
    sglang_sampling_params,
    vllm_sampling_kwargs,
)

#: A second value for every SamplingParams field, each different from the default.
OTHER = dict(
    temperature=0.7,
    top_p=0.9,
    top_k=5,
    max_new_tokens=7,
    min_new_tokens=2,
    stop_token_ids=(3, 4),
    n=3,
    seed=11,
    logprobs=False,
)


def _everything(params: SamplingParams, prompts=((1, 2), (1, 2), (5,))):
    """All a backend receives for one call: the rows and each row's request parameters."""
    rows = expand_rows(prompts, params)
    return [
        (
            r,
            vllm_sampling_kwargs(params, seed=r.seed, stop_at_eos=True),
            sglang_sampling_params(params, seed=r.seed, stop_at_eos=True),
        )
        for r in rows
    ]


def test_every_field_of_sampling_params_reaches_both_engines():
    fields = {f.name for f in dataclasses.fields(SamplingParams)}
    assert fields == set(OTHER), "a new SamplingParams field needs a mapping and a value in OTHER"
    base = SamplingParams(temperature=1.0, seed=1)
    for name, value in OTHER.items():
        changed = dataclasses.replace(base, **{name: value})
        before, after = _everything(base), _everything(changed)
        vllm_differs = [v for _, v, _ in before] != [v for _, v, _ in after] or len(before) != len(after)
        sglang_differs = [s for _, _, s in before] != [s for _, _, s in after] or len(before) != len(after)
        assert vllm_differs, f"{name} does not reach vLLM"
        if name != "logprobs":  # SGLang takes logprobs per call (return_logprob), not per sampling dict
            assert sglang_differs, f"{name} does not reach SGLang"


def test_values_land_in_the_engines_own_names():
    p = SamplingParams(temperature=0.7, top_p=0.9, top_k=5, max_new_tokens=7, min_new_tokens=2, stop_token_ids=(3, 4))
    v = vllm_sampling_kwargs(p, seed=9, stop_at_eos=True)
    assert v == {
        "n": 1,
        "temperature": 0.7,
        "top_p": 0.9,
        "top_k": 5,
        "max_tokens": 7,
        "min_tokens": 2,
        "stop_token_ids": [3, 4],
        "ignore_eos": False,
        "seed": 9,
        "logprobs": 0,
        "detokenize": False,
        "flat_logprobs": True,
    }
    s = sglang_sampling_params(p, seed=9, stop_at_eos=True)
    assert s == {
        "n": 1,
        "temperature": 0.7,
        "top_p": 0.9,
        "top_k": 5,
        "max_new_tokens": 7,
        "min_new_tokens": 2,
        "stop_token_ids": [3, 4],
        "ignore_eos": False,
        "sampling_seed": 9,
    }
    assert set(v) == set(VLLM_SAMPLING_FIELDS) and set(s) == set(SGLANG_SAMPLING_FIELDS)


def test_greedy_is_temperature_zero_and_unseeded_for_both_spellings():
    for p in (SamplingParams(temperature=0.0, seed=3, n=2), SamplingParams(temperature=0.8, top_k=1, seed=3, n=2)):
        rows = expand_rows([[1, 2]], p)
        assert [r.sample for r in rows] == [0, 1]  # greedy n > 1 becomes rows (vLLM refuses greedy n > 1)
        assert all(r.seed is None for r in rows)
        assert vllm_sampling_kwargs(p, seed=None, stop_at_eos=True)["temperature"] == 0.0
        assert sglang_sampling_params(p, seed=None, stop_at_eos=True)["temperature"] == 0.0


def test_top_k_off_is_zero_for_vllm_and_minus_one_for_sglang():
    p = SamplingParams(top_k=-1)
    assert vllm_sampling_kwargs(p, seed=None, stop_at_eos=True)["top_k"] == 0
    assert sglang_sampling_params(p, seed=None, stop_at_eos=True)["top_k"] == -1


def test_rows_are_prompt_major_with_n_samples_each():
    rows = expand_rows([[1], [2, 3]], SamplingParams(n=3, seed=0))
    assert [(r.prompt, r.sample) for r in rows] == [(0, 0), (0, 1), (0, 2), (1, 0), (1, 1), (1, 2)]


def test_row_seeds_are_reproducible_distinct_and_independent_of_the_rest_of_the_batch():
    p = SamplingParams(n=2, seed=5)
    alone = expand_rows([[7, 8]], p)
    batch = expand_rows([[1], [7, 8], [7, 8]], p)
    assert [r.seed for r in batch[2:4]] == [r.seed for r in alone]  # same prompt, same seeds, whatever surrounds it
    seeds = [r.seed for r in batch]
    assert len(set(seeds)) == len(seeds)  # samples differ, and so does the repeated prompt
    assert expand_rows([[7, 8]], p) == alone
    assert [r.seed for r in expand_rows([[7, 8]], SamplingParams(n=2, seed=6))] != [r.seed for r in alone]
    assert all(0 <= s < 2**63 for s in seeds)  # fits both engines' int64 seeds
    assert row_seed(5, (7, 8), 0, 0) == alone[0].seed


def test_unseeded_calls_leave_the_seed_to_the_engine():
    assert all(r.seed is None for r in expand_rows([[1], [2]], SamplingParams(n=2)))


def test_stop_at_eos_off():
    p = SamplingParams(stop_token_ids=(3,))
    assert vllm_sampling_kwargs(p, seed=None, stop_at_eos=False)["ignore_eos"] is True
    with pytest.raises(ConfigError) as e:  # SGLang's ignore_eos would switch stop_token_ids off too
        sglang_sampling_params(p, seed=None, stop_at_eos=False)
    assert e.value.field == "stop_token_ids"
    assert sglang_sampling_params(SamplingParams(), seed=None, stop_at_eos=False)["ignore_eos"] is True


def test_vllm_refuses_temperatures_above_two_with_a_clear_error():
    with pytest.raises(ConfigError) as e:
        vllm_sampling_kwargs(SamplingParams(temperature=2.5), seed=None, stop_at_eos=True)
    assert e.value.field == "temperature"
    greedy = SamplingParams(temperature=2.5, top_k=1)
    assert vllm_sampling_kwargs(greedy, seed=None, stop_at_eos=True)["temperature"] == 0


def test_logprobs_of_the_sampled_tokens_are_picked_from_vllm_steps():
    def lp(x):
        return SimpleNamespace(logprob=x)  # vLLM's Logprob has .logprob

    steps = [{4: lp(-0.5), 9: lp(-0.1)}, {2: lp(-2.0)}]  # logprobs=0 may still carry the top-1 token too
    assert sampled_logprobs([4, 2], steps) == [-0.5, -2.0]
    with pytest.raises(ValueError):
        sampled_logprobs([4], steps)


def test_sampled_logprobs_from_flat_lists():
    """vLLM's FlatLogprobs (flat_logprobs=True): per position a [start, end) range of flat lists; with logprobs=0 the
    sampled token comes first (a rank-1 alternative may follow when the sampled token was not the top one)."""

    class Flat(list):  # what vLLM's FlatLogprobs offers: a sequence of positions, plus the flat lists
        def __init__(self, starts, ids, values):
            super().__init__(range(len(starts)))
            self.start_indices, self.token_ids, self.logprobs = starts, ids, values

    flat = Flat([0, 2], [4, 9, 2], [-0.5, -0.1, -2.0])
    assert sampled_logprobs([4, 2], flat) == [-0.5, -2.0]


def test_sampled_logprobs_take_the_flat_list_whole_when_it_holds_only_the_sampled_tokens():
    class Flat(list):
        def __init__(self, starts, ids, values):
            super().__init__(range(len(starts)))
            self.start_indices, self.token_ids, self.logprobs = starts, ids, values

    assert sampled_logprobs([4, 2, 7], Flat([0, 1, 2], [4, 2, 7], [-0.5, -2.0, -0.25])) == [-0.5, -2.0, -0.25]


def test_one_request_per_prompt_only_for_unseeded_sampled_calls():
    unseeded = SamplingParams(n=4, temperature=0.7)
    assert per_prompt_requests(expand_rows([[1], [2]], unseeded), unseeded)
    for params in (SamplingParams(n=4, seed=3), SamplingParams(n=4, temperature=0.0), SamplingParams(n=1)):
        assert not per_prompt_requests(expand_rows([[1], [2]], params), params)
    assert vllm_sampling_kwargs(unseeded, seed=None, stop_at_eos=True, n=4)["n"] == 4
    with pytest.raises(ConfigError, match="n > 1"):
        vllm_sampling_kwargs(SamplingParams(n=4, seed=3), seed=3, stop_at_eos=True, n=4)
    with pytest.raises(ConfigError, match="n > 1"):
        vllm_sampling_kwargs(SamplingParams(n=4, temperature=0.0), seed=None, stop_at_eos=True, n=4)


def test_finish_reasons():
    assert finish_reason("stop", engine="vllm") == "stop"
    assert finish_reason({"type": "length", "length": 7}, engine="sglang") == "length"
    with pytest.raises(RoleFailure, match="abort"):
        finish_reason({"type": "abort"}, engine="sglang")


@pytest.mark.parametrize("bad", ["hello", [[]], [[1, "a"]], [[1, -1]], [[True]], [3]])
def test_prompts_must_be_lists_of_token_ids(bad):
    with pytest.raises(ConfigError) as e:
        check_prompts(bad)
    assert e.value.field == "prompt_token_ids"


def test_prompts_are_copied_as_lists():
    assert check_prompts(((1, 2), [3])) == [[1, 2], [3]]
