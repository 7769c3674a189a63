"""bench/verl_peer.py and bench/verl_reward.py on CPU: verl's data written from our prompts, the Hydra overrides
against bench/e2e_gpu.py's workload (and against verl 0.9.1's own config where verl is importable), the parsing of
verl's per-step metrics (console line and file logger), the run wrapper, the reward, and the comparison rows."""

from __future__ import annotations

import json
import os
import sys
import textwrap
from pathlib import Path
from types import SimpleNamespace

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))

import e2e_gpu  # noqa: E402
import verl_peer as peer  # noqa: E402
import verl_reward  # noqa: E402
from peer_workload import build, copy_first  # noqa: E402


@pytest.fixture(scope="module")
def workload(tmp_path_factory):
    """A tiny model of the 357m workload's tokenizer and its prompts (the prompts do not depend on the width)."""
    return build(str(tmp_path_factory.mktemp("wl")), size="357m", layers=1, hidden=112)


def test_data_file_holds_our_prompts_as_verl_rows(workload, tmp_path):
    import pandas as pd

    _, prompts_jsonl = workload
    ours = [json.loads(line)["prompt"] for line in open(prompts_jsonl)]
    path = peer.write_data(prompts_jsonl, str(tmp_path / "d"), 80)
    df = pd.read_parquet(path)
    assert len(df) == 80
    for i, row in df.iterrows():
        messages = list(row["prompt"])
        assert len(messages) == 1 and messages[0]["role"] == "user" and messages[0]["content"] == ours[i]
        assert row["reward_model"]["ground_truth"] == ours[i].split()[0]
        assert row["extra_info"]["prompt"] == ours[i] and row["extra_info"]["index"] == i
        assert row["data_source"] == peer.DATA_SOURCE
    with pytest.raises(SystemExit, match="holds 256 prompts, the run needs 1000"):
        peer.write_data(prompts_jsonl, str(tmp_path / "d"), 1000)


def _args(**kw):
    base = dict(
        size="357m",
        setup="matched",
        steps=10,
        warmup=2,
        micro=64,
        gpu_util=0.35,
        ckpt=False,
        lr=1e-6,
        enforce_eager=False,
        legacy=False,
        workdir="/tmp/peer",
        extra=[],
    )
    base.update(kw)
    return SimpleNamespace(**base)


def _values(overrides):
    out = {}
    for o in overrides:
        key, _, value = o.partition("=")
        assert key.lstrip("+") not in out, f"{key} given twice"
        out[key.lstrip("+")] = value
    return out


@pytest.mark.parametrize(
    "kw", [{}, {"setup": "lowvar"}, {"size": "1.5b", "micro": 8, "ckpt": True, "gpu_util": 0.3, "steps": 4}]
)
def test_overrides_name_e2e_gpus_batch_shape_and_the_issues_set_up(kw):
    args = _args(**kw)
    v = _values(peer.overrides(args, "/m", "/d.parquet"))
    prompts, samples, max_new, prompt_len, micro_rollout = e2e_gpu.WORKLOADS[args.size]
    assert int(v["data.train_batch_size"]) == prompts and int(v["actor_rollout_ref.rollout.n"]) == samples
    assert int(v["data.max_response_length"]) == max_new and int(v["data.max_prompt_length"]) == prompt_len
    # one optimizer step over all prompts x samples per step (ours: train_batch_size = prompts x samples), in
    # micro-batches of ours
    assert int(v["actor_rollout_ref.actor.ppo_mini_batch_size"]) == prompts
    assert int(v["actor_rollout_ref.actor.ppo_epochs"]) == 1
    assert int(v["actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu"]) == args.micro
    assert int(v["actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu"]) == micro_rollout
    assert int(v["data.train_max_samples"]) == args.steps * prompts
    assert int(v["trainer.total_training_steps"]) == args.steps and v["data.shuffle"] == "false"
    assert float(v["actor_rollout_ref.actor.optim.lr"]) == args.lr
    assert float(v["actor_rollout_ref.rollout.gpu_memory_utilization"]) == args.gpu_util
    assert v["actor_rollout_ref.rollout.temperature"] == "1.0" and v["actor_rollout_ref.rollout.top_p"] == "1.0"
    # the issue's set-up: one GPU, FSDP + vLLM colocated, sdpa, no remove-padding, GRPO
    assert v["trainer.n_gpus_per_node"] == "1" and v["trainer.nnodes"] == "1"
    assert v["actor_rollout_ref.rollout.tensor_model_parallel_size"] == "1"
    assert v["actor_rollout_ref.actor.strategy"] == "fsdp" and v["actor_rollout_ref.rollout.name"] == "vllm"
    assert v["actor_rollout_ref.hybrid_engine"] == "true"
    assert v["actor_rollout_ref.model.override_config.attn_implementation"] == "sdpa"
    assert v["actor_rollout_ref.model.use_remove_padding"] == "false"
    assert v["algorithm.adv_estimator"] == "grpo" and v["algorithm.use_kl_in_reward"] == "false"
    assert v["actor_rollout_ref.model.enable_gradient_checkpointing"] == str(args.ckpt).lower()
    assert v["reward.custom_reward_function.path"] == peer.REWARD_FILE
    assert v["actor_rollout_ref.model.custom_chat_template"] == f"'{peer.CHAT_TEMPLATE}'"
    if args.setup == "lowvar":
        assert v["actor_rollout_ref.actor.use_kl_loss"] == "true"
        assert v["actor_rollout_ref.actor.kl_loss_type"] == "low_var_kl"
        assert float(v["actor_rollout_ref.actor.kl_loss_coef"]) == 0.001
    else:
        assert v["actor_rollout_ref.actor.use_kl_loss"] == "false" and "actor_rollout_ref.ref" not in " ".join(v)
    assert v["trainer.use_v1"] == "true"
    assert _values(peer.overrides(_args(legacy=True), "/m", "/d"))["trainer.use_v1"] == "false"


def test_the_chat_template_renders_the_prompt_verbatim(workload):
    """The rollout's prompt tokens must be exactly ours: verl renders the row's messages with the template."""
    from transformers import AutoTokenizer

    model, prompts_jsonl = workload
    tok = AutoTokenizer.from_pretrained(model)
    tok.chat_template = peer.CHAT_TEMPLATE
    prompt = json.loads(open(prompts_jsonl).readline())["prompt"]
    rendered = tok.apply_chat_template(peer.rows([prompt])[0]["prompt"], add_generation_prompt=True, tokenize=False)
    assert rendered == prompt
    ids = tok(rendered, add_special_tokens=False)["input_ids"]
    assert ids == tok(prompt, add_special_tokens=False)["input_ids"] and len(ids) == 32


def test_overrides_compose_against_verls_own_config(workload, tmp_path):
    """Where verl 0.9.1 and Hydra are importable (bench/sessions/verl_session.sh stage runs the same check on the
    device): its ppo_trainer config takes every override, validates, and its agent loop renders our prompt token for
    token."""
    pytest.importorskip("hydra")
    pytest.importorskip("verl.trainer.main_ppo")
    model, prompts_jsonl = workload
    data = peer.write_data(prompts_jsonl, str(tmp_path), 80)
    for setup in peer.SETUPS:
        cmd = peer.command(_args(setup=setup, workdir=str(tmp_path)), model, data)
        res = peer.check(cmd, peer.environment(""))
        assert res["ok"], res
        assert res["reference"] == (setup == "lowvar")
        assert res["values"]["actor_rollout_ref.rollout.response_length"] == 128
        assert res["prompt_check"]["equal_to_ours"] and res["prompt_check"]["attn_implementation"] == "sdpa"


# What verl 0.9.1 prints once per step: its console logger (verl/utils/logger/aggregate_logger.py, concat_dict_to_str:
# "step:N - key:value - ...", numbers through pprint.pformat, so numpy scalars read np.float64(...)), from the
# TaskRunner actor through Ray's log forwarding; other lines around it as they appear in a run.
def _metrics(n, gen, upd, sync, total):
    return {
        "training/global_step": n,
        "training/epoch": 0,
        "actor/pg_loss": -0.0123,
        "actor/lr": 1e-06,
        "critic/score/mean": 0.01 * n,
        "critic/rewards/mean": 0.01 * n,
        "response_length/mean": 127.5,
        "response_length/clip_ratio": 0.9,
        "timing_s/gen": gen,
        "timing_s/reward": 0.01,
        "timing_s/old_log_prob": 0.2,
        "timing_s/adv": 0.003,
        "timing_s/update_actor": upd,
        "timing_s/update_weights": sync,
        "timing_s/step": total,
        "perf/throughput": 1234.5,
    }


def _console(n, metrics, numpy=False):
    items = [f"step:{n}"]
    for k, v in metrics.items():
        text = repr(float(v)) if isinstance(v, float) else str(v)
        items.append(f"{k}:np.float64({text})" if numpy and isinstance(v, float) else f"{k}:{text}")
    return "(TaskRunnerV1 pid=4242) " + " - ".join(items)


def sample_log(times):
    lines = [
        "2026-11-24 03:13:50,000\tINFO worker.py:1917 -- Started a local Ray instance.",
        "(vLLMHttpServer pid=4300) INFO 11-24 03:14:00 [gpu_model_runner.py:2650] Model loading took 0.68 GiB",
        "(TaskRunnerV1 pid=4242) step:0 - val-core/peer_copy_first/acc/mean@1:0.0",
    ]  # validation: no timing
    for n, (gen, upd, sync) in enumerate(times, start=1):
        total = round(gen + upd + sync + 0.213, 6)
        lines.append(_console(n, _metrics(n, gen, upd, sync, total), numpy=n % 2 == 0))
        lines.append(f"Training Progress:  {10 * n}%|█         | {n}/10 [00:05<00:40,  1.7it/s]")
    return lines


def test_parse_log_reads_every_step_line_and_summarize_takes_the_median_after_warmup():
    times = [(5.0, 2.0, 3.0), (0.4, 0.3, 0.1), (0.5, 0.4, 0.2), (0.6, 0.5, 0.1), (9.0, 0.3, 0.1)]
    lines = sample_log(times)
    steps = peer.parse_log([(100.0 + i, line) for i, line in enumerate(lines)])
    assert [s["step"] for s in steps] == [1, 2, 3, 4, 5]
    assert steps[1]["status"]["timing_s/update_actor"] == 0.3  # an np.float64(...) line
    assert steps[0]["status"]["training/global_step"] == 1.0 and steps[0]["status"]["actor/pg_loss"] == -0.0123
    out = peer.summarize(steps, warmup=1)
    assert out["steps"] == 5 and out["steady_steps"] == 4
    totals = sorted(round(sum(t) + 0.213, 6) for t in times[1:])
    assert out["step_s"] == pytest.approx((totals[1] + totals[2]) / 2)
    assert out["phases_s"]["gen"] == pytest.approx(0.55) and out["phases_s"]["update_weights"] == pytest.approx(0.1)
    assert out["phases_s"]["ref"] == 0.0  # not logged without a reference model
    assert out["response_len"] == 127.5 and out["rewards"] == pytest.approx([0.01, 0.02, 0.03, 0.04, 0.05])
    assert out["wall_step_s"] == pytest.approx(2.0)  # two lines per step, one second apart here


def test_parse_metrics_file_reads_verls_file_logger_and_skips_a_cut_line(tmp_path):
    path = tmp_path / "m.jsonl"
    recs = [{"step": n, "data": _metrics(n, 0.5, 0.3, 0.1, 1.0 + n)} for n in (1, 2, 3)]
    path.write_text("".join(json.dumps(r) + "\n" for r in recs) + '{"step": 4, "data": {"timing_s/st')
    steps = peer.parse_metrics_file(str(path))
    assert [s["step"] for s in steps] == [1, 2, 3] and steps[2]["status"]["timing_s/step"] == 4.0
    assert peer.parse_metrics_file(str(tmp_path / "absent.jsonl")) == []


def test_environment_puts_verl_first_and_leaves_vllm_multiprocessing_to_verl(monkeypatch):
    monkeypatch.setenv("PYTHONPATH", "/tmp/site")
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    env = peer.environment("/tmp/site-verl", "/tmp/m.jsonl")
    assert env["PYTHONPATH"].split(os.pathsep) == ["/tmp/site-verl", "/tmp/site"]
    assert "VLLM_ENABLE_V1_MULTIPROCESSING" not in env and env["VERL_FILE_LOGGER_PATH"] == "/tmp/m.jsonl"
    assert env["HF_HUB_OFFLINE"] == "1" and env["WANDB_MODE"] == "disabled"


def test_verl_runs_without_the_trl_beside_it(monkeypatch, tmp_path):
    # verl 0.9.1 patches trl's value-head model whenever trl imports; the TRL peer's trl 1.16 has none (GPU, 2026-11-24)
    site = tmp_path / "site"
    for pkg in ("trl", "ray"):
        (site / pkg).mkdir(parents=True)
        (site / pkg / "__init__.py").write_text("")
    (site / "trl-1.16.0.dist-info").mkdir()
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(site), "/elsewhere"]))
    env = peer.environment(str(tmp_path / "site-verl"))
    entries = env["PYTHONPATH"].split(os.pathsep)
    assert entries[0] == str(tmp_path / "site-verl") and entries[2] == "/elsewhere"
    view = Path(entries[1])
    assert sorted(p.name for p in view.iterdir()) == ["ray"]
    from importlib.machinery import PathFinder  # what an import through that PYTHONPATH entry finds

    assert PathFinder.find_spec("trl", [str(view)]) is None and PathFinder.find_spec("ray", [str(view)]) is not None
    (site / "vllm").mkdir()  # installed after the first run: the next run's view has it
    peer.environment("")
    assert (view / "vllm").exists()


def test_reward_is_copy_first_of_the_decoded_response():
    prompt = "t5 t9 t5 t1"
    extra = peer.rows([prompt])[0]
    got = verl_reward.compute_score(
        data_source=peer.DATA_SOURCE,
        solution_str="t5 t7 t5 t5",
        ground_truth=extra["reward_model"]["ground_truth"],
        extra_info=dict(extra["extra_info"], num_turns=2),
    )
    assert got == pytest.approx(0.75) == copy_first([prompt], ["t5 t7 t5 t5"])[0]
    assert verl_reward.compute_score(solution_str="", ground_truth="t5", extra_info={"prompt": prompt}) == 0.0
    with pytest.raises(ValueError, match="not the first token"):
        verl_reward.compute_score(solution_str="t1", ground_truth="t9", extra_info={"prompt": prompt})
    with pytest.raises(ValueError, match=r"no extra_info.prompt"):
        verl_reward.compute_score(solution_str="t1", ground_truth="t5", extra_info={})


FAKE_RUN = textwrap.dedent("""
    import sys, time
    for n in range(1, 4):
        print("(TaskRunnerV1 pid=1) step:%d - timing_s/gen:0.5 - timing_s/update_actor:0.25 - "
              "timing_s/update_weights:0.125 - response_length/mean:100.0 - critic/score/mean:0.5 - "
              "timing_s/step:%d.5" % (n, n), flush=True)
    if sys.argv[1] == "fail":
        raise ImportError("cannot import name 'init_app_state' from 'vllm.entrypoints.openai.api_server'")
    time.sleep(600)  # a run that never exits after its last step
""")


@pytest.mark.parametrize("mode", ["ok", "fail"])
def test_main_writes_the_summary_or_the_failure_to_out(tmp_path, monkeypatch, capsys, mode, workload):
    """The whole run path with verl replaced by a script printing its step lines: a run cut at its time limit after
    the warm-up is summarized and marked partial; a crash is reported with its error, not hidden."""
    import peer_workload

    script = tmp_path / "fake.py"
    script.write_text(FAKE_RUN)
    monkeypatch.setattr(peer_workload, "build", lambda root, size: ("/m", workload[1]))
    monkeypatch.setattr(peer, "command", lambda args, model, data: [sys.executable, str(script), mode])
    monkeypatch.setenv("OUT", str(tmp_path))
    monkeypatch.setattr(
        sys,
        "argv",
        ["verl_peer.py", "--workdir", str(tmp_path), "--steps", "5", "--warmup", "1", "--timeout", "6", "--grace", "1"],
    )
    rc = peer.main()
    result = json.loads((tmp_path / "verl-357m-matched.json").read_text())
    out = capsys.readouterr().out
    assert (tmp_path / "verl-data" / "train-40.parquet").exists()
    if mode == "ok":
        assert rc == 0 and result["stopped"] == "timeout" and result["partial"].startswith("3 of 5 steps")
        assert result["step_s"] == 3.0 and result["steady_steps"] == 2 and "PARTIAL" in out
        assert result["phases_s"]["update_weights"] == 0.125 and result["metrics_source"] == "console"
        assert result["tokens_per_s"] == pytest.approx(64 * 100.0 / 3.0)
        rows, problems = peer.compare(result, _ours(step=1.5))
        assert not problems and "partial: 3 of 5 steps" in rows[0].unit
    else:
        assert rc == 3 and result["rc"] == 1 and "init_app_state" in result["error"]
        assert "FAILED after 3 of 5 steps" in out and "---- last traceback ----" in out


def _verl(step=2.0, **kw):
    return {
        "size": "357m",
        "setup": "matched",
        "warmup": 2,
        "step_s": step,
        "device": "NVIDIA H100 80GB HBM3",
        "verl": "0.9.1",
        "phases_s": {
            "gen": 0.8,
            "reward": 0.01,
            "old_log_prob": 0.2,
            "ref": 0.0,
            "adv": 0.01,
            "update_actor": 0.6,
            "update_weights": 0.3,
        },
        **kw,
    }


def _ours(step=1.0, rc=0):
    return {"rc": rc, "step_s": step, "phases_s": {"generate": 0.5, "train": 0.3, "sync": 0.05}}


def test_compare_rows_and_the_speedup_only_when_both_runs_completed(tmp_path):
    from _common import append_results

    rows, problems = peer.compare(_verl(), _ours())
    by_name = {r.metric: r.value for r in rows}
    assert problems == []
    assert by_name["verl grpo step s"] == 2.0 and by_name["speedup vs verl x"] == pytest.approx(2.0)
    assert by_name["verl weight sync s"] == 0.3 and by_name["verl gen s"] == 0.8
    assert by_name["verl old_log_prob s"] == pytest.approx(0.2)
    scratch = tmp_path / "RESULTS.md"
    assert append_results(rows, "NVIDIA H100 80GB HBM3", path=scratch) == len(rows)
    assert "| speedup vs verl x | 2.000 | x (verl 2.000 s / ours 1.000 s" in scratch.read_text()

    rows, problems = peer.compare(_verl(), _ours(rc=1))
    assert not any(r.metric.startswith("speedup") for r in rows) and "our run did not complete" in problems[0]
    rows, problems = peer.compare(_verl(step=None, error="ImportError: x"), _ours())
    assert rows == [] and "ImportError: x" in problems[0]
    ref, _ = peer.compare(_verl(setup="lowvar"), _ours())
    assert {"speedup vs verl lowvar x", "verl grpo step lowvar s"} <= {r.metric for r in ref}


def test_compare_main_refuses_a_missing_run(tmp_path, capsys):
    (tmp_path / "ours.json").write_text(json.dumps(_ours()))
    rc = peer.compare_main(["--verl", str(tmp_path / "absent.json"), "--ours", str(tmp_path / "ours.json")])
    assert rc == 3 and "verl run did not complete" in capsys.readouterr().out
