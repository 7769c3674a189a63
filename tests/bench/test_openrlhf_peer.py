"""bench/openrlhf_peer.py and bench/openrlhf_reward.py on CPU: the command line against OpenRLHF 0.11.2's own parser
table, the parsing of OpenRLHF's per-step log line, the run wrapper (process group, failure report), the reward
adapter against the workload's tokenizer, and the comparison rows."""

from __future__ import annotations

import json
import os
import statistics
import sys
import textwrap
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))

import openrlhf_peer as peer  # noqa: E402
import openrlhf_reward  # noqa: E402
from peer_workload import VOCAB, copy_first  # noqa: E402
from timing_bounds import HANG_S  # noqa: E402

FLAGS = json.loads((ROOT / "packages/hybrid-cli/src/hybrid_cli/data/openrlhf_flags.json").read_text())

# What OpenRLHF 0.11.2 prints once per step (ppo_trainer.py: logger.info(f"✨ Global step {n}: {status}")), as it
# reaches the driver through Ray's log forwarding; other lines around it as they appear in a run.
STATUS = (
    "{{'policy_loss': -0.0123, 'actor_lr': 1e-06, 'ppo_clip_ratio': 0.0, 'kl': 0.0, 'reward': {r}, "
    "'response_length': 128.0, 'timing/make_experience': {me}, 'timing/ppo_train': {pt}, "
    "'timing/broadcast': {bc}, 'rollout/reward_mean': {r}, 'rollout/reward_std': 0.05, "
    "'rollout/response_length_mean': 127.5, 'rollout/truncated_rate': 1.0, 'rollout/num_samples': 64.0, "
    "'timing/generation': {gen}, 'timing/step_total': {tot}}}"
)
PREFIX = "(PPOTrainer pid=4242) INFO 11-24 03:14:{s:02d} ppo_trainer.py:551] ✨ Global step {n}: "


def sample_log(times):
    lines = [
        "2026-11-24 03:13:50,000\tINFO worker.py:1917 -- Started a local Ray instance.",
        "(LLMRayActor pid=4300) INFO 11-24 03:14:00 [gpu_model_runner.py:2650] Model loading took 0.68 GiB",
    ]
    for n, (gen, me, pt, bc) in enumerate(times, start=1):
        lines.append(f"(PPOTrainer pid=4242) INFO 11-24 03:14:{n:02d} ppo_trainer.py:224] Sample: ['t1 t2 t3', 0.1]")
        status = STATUS.format(r=0.01 * n, me=me, pt=pt, bc=bc, gen=gen, tot=round(gen + me + pt + bc, 6))
        lines.append(PREFIX.format(s=n, n=n) + status)
        lines.append("Episode [1/1]:  10%|█         | 8/80 [00:05<00:40,  1.7it/s]")
    return lines


def test_parse_log_reads_every_step_line_and_summarize_takes_the_median_after_warmup():
    times = [
        (5.0, 2.0, 3.0, 1.0),
        (0.4, 0.2, 0.3, 0.1),
        (0.5, 0.2, 0.4, 0.2),
        (0.6, 0.3, 0.5, 0.1),
        (9.0, 0.2, 0.3, 0.1),
    ]
    lines = sample_log(times)
    arrivals = [(100.0 + i, line) for i, line in enumerate(lines)]
    steps = peer.parse_log(arrivals)
    assert [s["step"] for s in steps] == [1, 2, 3, 4, 5]
    assert steps[2]["status"]["timing/ppo_train"] == 0.4 and steps[0]["status"]["rollout/num_samples"] == 64.0
    out = peer.summarize(steps, warmup=1)
    assert out["steps"] == 5 and out["steady_steps"] == 4
    totals = sorted(sum(t) for t in times[1:])
    assert out["step_s_inside"] == pytest.approx((totals[1] + totals[2]) / 2)  # OpenRLHF's own timing/step_total
    assert out["step_s"] is None  # 4 measured steps: the one clock gives a figure from 5 (test_peer_ratio.py)
    assert out["phases_s"] == pytest.approx(
        {"generation": 0.55, "make_experience": 0.2, "ppo_train": 0.35, "broadcast": 0.1}
    )
    assert out["response_len"] == 127.5
    assert out["rewards"] == pytest.approx([0.01, 0.02, 0.03, 0.04, 0.05])
    assert out["wall_step_s"] == pytest.approx(3.0)  # three lines per step, one second apart here


def test_a_status_that_is_not_a_literal_is_read_by_the_regex():
    line = PREFIX.format(s=1, n=7) + (
        "{'kl': np.float64(0.25), 'timing/step_total': 1.5, 'generated': tensor([1]), 'timing/broadcast': 2e-05}"
    )
    (step,) = peer.parse_log([line])
    assert step["step"] == 7
    assert step["status"]["kl"] == 0.25 and step["status"]["timing/step_total"] == 1.5
    assert step["status"]["timing/broadcast"] == 2e-05


def test_failure_reports_the_actor_traceback_and_the_error():
    lines = [
        "(PolicyModelActor pid=77) INFO loading",
        "Traceback (most recent call last):",
        '  File "/tmp/site-orl/openrlhf/cli/train_ppo_ray.py", line 167, in train',
        "    ray.get(refs)",
        "ray.exceptions.RayTaskError(ImportError): ray::PolicyModelActor.init()",
        "(PolicyModelActor pid=77) ImportError: cannot import name 'X' from 'vllm.y'",
        "shutting down",
    ]
    got = peer.failure(lines)
    assert got["traceback"][0].startswith("Traceback") and any("RayTaskError" in ln for ln in got["traceback"])
    assert got["error_lines"][-1].endswith("cannot import name 'X' from 'vllm.y'")
    assert got["log_tail"][-1] == "shutting down"


def _args(**kw):
    base = dict(
        size="357m",
        setup="matched",
        steps=10,
        warmup=2,
        micro=64,
        zero_stage=None,
        gpu_util=0.35,
        ckpt=False,
        lr=1e-6,
        enforce_eager=False,
        workdir="/tmp/peer",
        extra=[],
        no_sleep=False,
    )
    base.update(kw)
    return SimpleNamespace(**base)


def _flag_values(cmd):
    """``--name value...`` pairs of a command after ``-m openrlhf.cli.train_ppo_ray``."""
    assert cmd[1:3] == ["-m", "openrlhf.cli.train_ppo_ray"]
    out, name = {}, None
    for tok in cmd[3:]:
        if tok.startswith("--"):
            name = tok[2:]
            out[name] = []
        else:
            out[name].append(tok)
    return out


@pytest.mark.parametrize(
    "kw",
    [{}, {"setup": "zero3ref", "micro": 32}, {"size": "1.5b", "micro": 8, "ckpt": True, "gpu_util": 0.3, "steps": 4}],
)
def test_every_flag_is_one_of_openrlhf_0_11_2s_and_well_formed(kw):
    """Checked against the table extracted from OpenRLHF 0.11.2's own parser (hybrid_cli/data/openrlhf_flags.json);
    the GPU session also runs the real parser on it (`openrlhf_peer.py --check`)."""
    assert FLAGS["release"] == "0.11.2"
    table = {f["name"]: f for f in FLAGS["flags"]}
    cmd = peer.command(_args(**kw), "/m", "/d.jsonl")
    values = _flag_values(cmd)
    assert len(values) == len([t for t in cmd if t.startswith("--")]), "a flag given twice"
    casts = {"int": int, "float": float, "str": str, None: str}
    for name, vals in values.items():
        assert name in table, f"--{name} is not a flag of OpenRLHF 0.11.2"
        spec = table[name]
        if spec["action"] in ("store_true", "store_false"):
            assert vals == [], f"--{name} takes no value"
            continue
        assert len(vals) == (1 if spec["nargs"] is None else len(vals)) and vals
        for v in vals:
            casts[spec["type"]](v)
            assert spec["choices"] is None or v in [str(c) for c in spec["choices"]]
    # the set-up the issue asks for: sdpa, no packing / dynamic batch / ring, one GPU with everything sleeping
    assert values["ds.attn_implementation"] == ["sdpa"]
    assert not {"ds.packing_samples", "train.dynamic_batch_enable", "ds.ring_attn_size"} & set(values)
    for flag in ("train.colocate_all", "vllm.enable_sleep", "ds.enable_sleep"):
        assert flag in values
    assert values["vllm.num_engines"] == ["1"] and values["actor.num_gpus_per_node"] == ["1"]
    assert values["algo.advantage.estimator"] == ["group_norm"]
    prompts, samples, max_new, prompt_len, _micro_rollout = peer.WORKLOADS[kw.get("size", "357m")]
    assert values["rollout.batch_size"] == [str(prompts)] and values["rollout.n_samples_per_prompt"] == [str(samples)]
    assert values["rollout.max_new_tokens"] == [str(max_new)]
    assert values["data.max_len"] == [str(prompt_len + max_new)]
    assert values["data.max_samples"] == [str(kw.get("steps", 10) * prompts)]  # -> exactly `steps` steps
    assert values["train.micro_batch_size"] == [str(kw.get("micro", 64))]
    assert values["reward.remote_url"] == [peer.REWARD_FILE]
    zero3 = kw.get("setup") == "zero3ref"
    assert values["ds.zero_stage"] == ["3" if zero3 else "1"]
    assert float(values["algo.kl.init_coef"][0]) == (0.001 if zero3 else 0.0)
    assert ("actor.gradient_checkpointing_enable" in values) == kw.get("ckpt", False)


def test_environment_puts_the_standin_first_and_leaves_vllm_multiprocessing_to_openrlhf(monkeypatch):
    monkeypatch.setenv("PYTHONPATH", "/tmp/site")
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    env = peer.environment("/tmp/site-orl")
    assert env["PYTHONPATH"].split(os.pathsep) == [peer.STANDIN, "/tmp/site-orl", "/tmp/site"]
    assert "VLLM_ENABLE_V1_MULTIPROCESSING" not in env and env["HF_HUB_OFFLINE"] == "1"
    assert not list(Path(peer.STANDIN).glob("*.dist-info")), "the stand-in must carry no package metadata"


FAKE_RUN = textwrap.dedent("""
    import subprocess, sys, time
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    open(sys.argv[1], "w").write(str(child.pid))
    for n in range(1, 1 + (int(sys.argv[3]) if len(sys.argv) > 3 else 3)):
        line = "(PPOTrainer pid=1) INFO x.py:1] \\u2728 Global step %d: {'timing/step_total': %d.5}" % (n, n)
        print(line, flush=True)
        time.sleep(0.05)
    if sys.argv[2] == "fail":
        raise ImportError("cannot import name 'GuidedDecodingParams' from 'vllm.sampling_params'")
    time.sleep(600)  # a run that saves for ever after its last step
""")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie is gone for our purposes
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except OSError:
        return False


def _fake_run(tmp_path, mode: str, expected_steps: int) -> dict:
    """``peer.run`` of FAKE_RUN in ``mode`` ("ok" or "fail"); it writes its child's pid to child.pid."""
    script = tmp_path / "fake.py"
    script.write_text(FAKE_RUN)
    return peer.run(
        [sys.executable, str(script), str(tmp_path / "child.pid"), mode],
        dict(os.environ),
        str(tmp_path / "log"),
        timeout=120,
        expected_steps=expected_steps,
        grace=1,
    )


def _gone(tmp_path, within_s: float = 5.0) -> bool:
    """Whether the fake run's child process is gone within ``within_s``."""
    child = int((tmp_path / "child.pid").read_text())
    deadline = time.time() + within_s
    while _alive(child) and time.time() < deadline:
        time.sleep(0.1)
    return not _alive(child)


def test_run_stops_the_whole_process_group_after_the_last_step(tmp_path):
    start = time.time()
    r = _fake_run(tmp_path, "ok", expected_steps=3)
    assert time.time() - start < HANG_S  # stopped after the last step (below); this only catches a hang
    assert r["stopped"] == "after_last_step"
    assert [s["status"]["timing/step_total"] for s in peer.parse_log(r["lines"])] == [1.5, 2.5, 3.5]
    assert (tmp_path / "log").read_text().count("Global step") == 3
    assert _gone(tmp_path), "the run's child process outlived it"


def test_run_reports_a_crash_with_its_traceback(tmp_path):
    r = _fake_run(tmp_path, "fail", expected_steps=5)
    assert r["rc"] == 1 and r["stopped"] is None
    got = peer.failure([line for _, line in r["lines"]])
    assert "GuidedDecodingParams" in got["error_lines"][-1]
    assert got["traceback"][0].startswith("Traceback") and "GuidedDecodingParams" in got["traceback"][-1]
    assert _gone(tmp_path), "what the crashed run left in its process group outlived it"


def test_reward_adapter_scores_what_our_runs_score_on_openrlhfs_decoded_query(tmp_path):
    """OpenRLHF hands the reward file the prompt + completion ids decoded with special tokens kept; the adapter
    must give copy_first of the completion as our engine decodes it (special tokens dropped)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"t{i}": i for i in range(VOCAB - 3)}
    vocab.update({"<unk>": VOCAB - 3, "<pad>": VOCAB - 2, "</s>": VOCAB - 1})
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", pad_token="<pad>", eos_token="</s>")
    tok.save_pretrained(tmp_path)  # and back, as OpenRLHF loads it (AutoTokenizer from the model folder)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tmp_path)
    prompt = "t5 t9 t5 t1"
    completion_ids = tok(text="t5 t7 t5 t5", add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    prompt_ids = tok(text=prompt, add_special_tokens=False)["input_ids"]
    query = tok.decode(prompt_ids + completion_ids, skip_special_tokens=False)
    assert query.endswith("</s>")
    got = openrlhf_reward.reward_func([query], [prompt], [""])
    assert got["rewards"] == pytest.approx(0.75) and got["scores"] == got["rewards"]
    assert got["rewards"] == copy_first([prompt], [tok.decode(completion_ids, skip_special_tokens=True)])[0]
    batch = openrlhf_reward.reward_func([query, prompt + " t2"], [prompt, prompt], ["", ""])
    assert batch["rewards"] == pytest.approx([0.75, 0.0])
    with pytest.raises(ValueError, match="does not start with its prompt"):
        openrlhf_reward.reward_func(["t1 t2"], [prompt], [""])


def _orl(step=2.0, **kw):
    return {
        "size": "357m",
        "setup": "matched",
        "warmup": 2,
        "step_s": step,
        "device": "NVIDIA H100 80GB HBM3",
        "phases_s": {"generation": 0.8, "make_experience": 0.3, "ppo_train": 0.6, "broadcast": 0.3},
        **kw,
    }


def _ours(step=1.0, rc=0):
    return {"rc": rc, "step_s": step, "phases_s": {"generate": 0.5, "train": 0.3, "sync": 0.05}}


def test_compare_rows_and_speedups_only_when_both_runs_completed(tmp_path):
    from _common import append_results

    rows, problems = peer.compare(_orl(), _ours())
    by_name = {r.metric: r.value for r in rows}
    assert problems == []
    assert by_name["OpenRLHF grpo step s"] == 2.0 and by_name["speedup vs OpenRLHF x"] == pytest.approx(2.0)
    assert by_name["OpenRLHF weight sync s"] == 0.3
    assert by_name["weight sync speedup vs OpenRLHF x"] == pytest.approx(6.0)
    assert {"OpenRLHF generation s", "OpenRLHF make_experience s", "OpenRLHF ppo_train s"} <= set(by_name)
    scratch = tmp_path / "RESULTS.md"
    assert append_results(rows, "NVIDIA H100 80GB HBM3", path=scratch) == len(rows)
    assert "| speedup vs OpenRLHF x | 2.000 | x (OpenRLHF 2.000 s / ours 1.000 s" in scratch.read_text()

    rows, problems = peer.compare(_orl(), _ours(rc=1))
    assert not any(r.metric.startswith(("speedup", "weight sync speedup")) for r in rows) and problems
    rows, problems = peer.compare(_orl(step=None, error="ImportError: x"), _ours())
    assert rows == [] and "ImportError: x" in problems[0]

    big, _ = peer.compare(_orl(size="1.5b"), _ours(step=0.5))
    names = {r.metric for r in big}
    assert "speedup vs OpenRLHF 1.5B x" in names and "OpenRLHF grpo step 1.5B s" in names
    z3, _ = peer.compare(_orl(setup="zero3ref"), _ours())
    assert "speedup vs OpenRLHF zero3ref x" in {r.metric for r in z3}


def test_dry_prints_the_command_without_building_anything(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["openrlhf_peer.py", "--dry", "--workdir", str(tmp_path / "w")])
    assert peer.main() == 0
    out = capsys.readouterr().out
    assert "-m openrlhf.cli.train_ppo_ray" in out and "--ds.attn_implementation sdpa" in out
    assert not (tmp_path / "w").exists()


@pytest.mark.parametrize("mode", ["ok", "fail"])
def test_main_writes_the_summary_or_the_failure_to_out(tmp_path, monkeypatch, capsys, mode):
    """The whole run path with OpenRLHF replaced by a script printing its step lines: a run cut at its time limit
    with >= 5 steps after the warm-up is summarized on the step-end clock and marked partial; a crash is reported
    with its error, not hidden."""
    import peer_workload

    script, pidfile = tmp_path / "fake.py", tmp_path / "child.pid"
    script.write_text(FAKE_RUN)
    monkeypatch.setattr(peer_workload, "build", lambda root, size: ("/m", "/d.jsonl"))
    monkeypatch.setattr(
        peer,
        "command",
        lambda args, model, data: [sys.executable, str(script), str(pidfile), mode, "8" if mode == "ok" else "3"],
    )
    monkeypatch.setenv("OUT", str(tmp_path))
    monkeypatch.setattr(
        sys,
        "argv",
        [
            "openrlhf_peer.py",
            "--workdir",
            str(tmp_path),
            "--steps",
            "10",
            "--warmup",
            "2",
            "--timeout",
            "8",
            "--grace",
            "1",
        ],
    )
    rc = peer.main()
    result = json.loads((tmp_path / "openrlhf-357m-matched.json").read_text())
    out = capsys.readouterr().out
    if mode == "ok":
        assert rc == 0 and result["stopped"] == "timeout" and result["partial"].startswith("8 of 10 steps")
        assert result["step_s_inside"] == 6.0 and result["steady_steps"] == 6 and "PARTIAL" in out
        assert result["step_s"] == pytest.approx(statistics.median(result["steady_step_s"])) and result["step_s"] > 0
        rows, problems = peer.compare(result, _ours(step=1.5))
        assert not problems and "partial: 8 of 10 steps" in rows[0].unit
    else:
        assert rc == 3 and result["rc"] == 1 and "GuidedDecodingParams" in result["error"]
        assert "FAILED after 3 of 10 steps" in out and "---- last traceback ----" in out
    if pidfile.exists():
        try:
            os.kill(int(pidfile.read_text()), 9)
        except ProcessLookupError:
            pass


def test_no_sleep_drops_both_sleep_flags_and_keeps_the_rest():
    """OpenRLHF's default for these two flags is off: --no_sleep runs it so (all resident), every other flag kept."""
    asleep = peer.command(_args(), "/m", "/d.jsonl")
    awake = peer.command(_args(no_sleep=True), "/m", "/d.jsonl")
    assert {"--vllm.enable_sleep", "--ds.enable_sleep"} <= set(asleep)
    assert not {"--vllm.enable_sleep", "--ds.enable_sleep"} & set(awake)
    assert [t for t in asleep if t not in ("--vllm.enable_sleep", "--ds.enable_sleep")] == awake
    assert "--train.colocate_all" in awake


def test_the_step_is_the_wall_time_between_step_lines_after_the_warmup():
    """The one clock (bench/_common.py): step k = arrival of step k's line - arrival of step k-1's, the warm-up
    dropped; OpenRLHF's own timing/step_total (which leaves out what happens between its phases) only beside it."""
    times = [(1.0, 0.1, 0.1, 0.1)] * 8  # timing/step_total 1.3 s every step
    arrivals = [0.0, 9.0, 11.0, 13.5, 15.5, 17.0, 19.0, 21.0]  # step 2 took 9 s (warm-up), steps 3-8 as below
    lines = [line for line in sample_log(times) if "Global step" in line]
    steps = peer.parse_log(list(zip(arrivals, lines)))
    out = peer.summarize(steps, warmup=2)
    assert out["steady_step_s"] == [2.0, 2.5, 2.0, 1.5, 2.0, 2.0]
    assert out["step_s"] == 2.0 and out["steady_steps"] == 6
    assert out["step_s_inside"] == pytest.approx(1.3)
    rows, _ = peer.compare({**_orl(), **out}, _ours(step=1.0))
    by_name = {r.metric: r for r in rows}
    assert by_name["speedup vs OpenRLHF x"].value == pytest.approx(2.0)  # wall 2.0 s, not 1.3
    assert "wall time between step ends, median of 6 after 2 warm-up" in by_name["OpenRLHF grpo step s"].unit
    nosleep, problems = peer.compare({**_orl(sleep=False), **out}, _ours(step=1.0))
    assert "OpenRLHF grpo step nosleep s" in {r.metric for r in nosleep}
    assert not any("speedup" in r.metric for r in nosleep) and "peer_ratio.py" in problems[0]
