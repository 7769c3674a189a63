"""bench/peer_ratio.py on CPU: the turn order, the per-turn ratio / median / min-max arithmetic, a failed peer kept as
failed and left out of the ratios, the exact metric names of the README's fair-protocol rows, the sides' commands
against the workloads, and one whole run through real subprocesses.

TRL and OpenRLHF with vLLM (and our vLLM run) cannot run without a GPU, so the whole run uses a **stand-in**
(STANDIN below, passed with ``--script``): it takes each program's arguments and reports fake step-end times in that
program's own format -- ours through e2e_gpu.summarize into e2e_gpu.py's JSON, TRL as trl_grpo_peer.py's ``RESULT``
line -- so what is checked is peer_ratio.py's orchestration and reading, not the peers."""

from __future__ import annotations

import json
import os
import shlex
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "bench"
sys.path.insert(0, str(BENCH))

import e2e_gpu  # noqa: E402
import openrlhf_peer  # noqa: E402
import peer_ratio as pr  # noqa: E402
import readme_figures  # noqa: E402
from _common import MIN_MEASURED_STEPS, append_results  # noqa: E402

OOM = "CUDA out of memory: Tried to allocate 2.00 GiB"


def test_turns_alternate_so_that_drift_favours_no_side():
    assert pr.turn_order(["ours", "trl-default", "trl-sleep"], 4) == [
        ["ours", "trl-default", "trl-sleep"],
        ["trl-sleep", "trl-default", "ours"],
        ["ours", "trl-default", "trl-sleep"],
        ["trl-sleep", "trl-default", "ours"],
    ]
    assert pr.turn_order(["ours", "trl-default"], 1) == [["ours", "trl-default"]]


def test_the_fair_protocol_metric_names_are_the_readmes():
    named = {(w, p): pr.WORKLOADS[w].metrics[p] for w in pr.WORKLOADS for p in pr.PEERS}
    assert named[("357m-matched", "trl-default")] == "speedup vs TRL default x"
    assert named[("357m-matched", "trl-sleep")] == "speedup vs TRL sleep x"
    assert named[("357m-zero3ref", "trl-default")] == "speedup vs TRL ZeRO-3+ref default x"
    assert named[("1.5b", "trl-default")] == "speedup vs TRL 1.5B default x"
    assert named[("1.5b", "openrlhf-nosleep")] == "speedup vs OpenRLHF 1.5B nosleep x"
    figures = {f.metric for f in readme_figures.FIGURES}
    assert {
        named[k]
        for k in [
            ("357m-matched", "trl-default"),
            ("357m-matched", "trl-sleep"),
            ("357m-zero3ref", "trl-default"),
            ("1.5b", "trl-default"),
            ("1.5b", "openrlhf-nosleep"),
        ]
    } <= figures
    assert len(set(named.values())) == len(named), "two comparisons under one metric name"
    # the single-call rows of the sessions (another clock, peers asleep) keep names of their own
    assert not set(named.values()) & {
        "speedup vs TRL x",
        "speedup vs TRL ZeRO-3+ref x",
        "speedup vs TRL 1.5B x",
        "speedup vs OpenRLHF x",
        "speedup vs OpenRLHF 1.5B x",
    }


def _args(workload, **kw):
    args, _ = pr.parse(["--workload", workload, "--openrlhf", *kw.pop("argv", [])])
    return args


def _value(cmd, flag, default):
    return type(default)(cmd[cmd.index(flag) + 1]) if flag in cmd else default


@pytest.mark.parametrize("workload", sorted(w for w in pr.WORKLOADS if pr.WORKLOADS[w].gpus == 1))
def test_every_side_runs_the_workloads_model_folder_and_batch_shape(workload):
    """The one-GPU workloads (issue 38's four-GPU ones: tests/bench/test_peers.py)."""
    args = _args(workload)
    wl = pr.WORKLOADS[workload]
    prompts, samples, max_new, _, _ = e2e_gpu.WORKLOADS[wl.size]
    cmds = {side: pr.side_command(side, 2, args, {})[0] for side in pr.SIDES}
    ours = cmds["ours"]
    assert _value(ours, "--size", "") == wl.size and _value(ours, "--workdir", "") == args.workdir
    assert _value(ours, "--steps", 0) == args.steps == args.warmup + MIN_MEASURED_STEPS + 1
    for side, cmd in cmds.items():
        assert _value(cmd, "--warmup", 0) == args.warmup == 2, side  # the same warm-up on every side
        assert _value(cmd, "--steps", 0) == args.steps, side
    for side in ("trl-default", "trl-sleep"):  # trl_grpo_peer.py's own defaults: 8 prompts x 8, 128 new tokens
        cmd = cmds[side]
        assert cmd[2:4] == [os.path.join(args.workdir, "model"), "vllm"]
        assert (_value(cmd, "--prompts", 8), _value(cmd, "--generations", 8), _value(cmd, "--max_new", 128)) == (
            prompts,
            samples,
            max_new,
        )
        assert ("--sleep" in cmd) == (side == "trl-sleep")  # TRL's default is no sleep
    for side in ("openrlhf-nosleep", "openrlhf-sleep"):
        cmd = cmds[side]
        assert _value(cmd, "--size", "") == wl.size and _value(cmd, "--setup", "") == wl.openrlhf_setup
        assert _value(cmd, "--workdir", "") == args.workdir and ("--no_sleep" in cmd) == (side == "openrlhf-nosleep")
    if workload == "357m-zero3ref":  # the set-up: e2e_gpu.py's defaults (ZeRO-3, reference, micro 32)
        assert not {"--kl", "--zero_stage", "--micro"} & set(ours)
    else:  # TRL-matched on our side: no reference, ZeRO-1
        assert _value(ours, "--kl", "") == "0" and _value(ours, "--zero_stage", "") == "1"


def test_refusals_name_the_setting_and_the_fix(capsys):
    for argv, words in (
        (["--steps", "6"], "--steps >= 7"),
        (["--record", "--turns", "2"], ">= 3 same-call"),
        (["--record", "--small"], "--small"),
        (["--record", "--script", f"trl={__file__}"], "stand-in"),
        (["--peers", "trl-default", "--openrlhf"], "leave out --openrlhf"),
        (["--script", "sglang=x.py"], "PROGRAM=PATH"),
        (["--warmup", "0"], "--warmup must be >= 1"),
    ):
        with pytest.raises(SystemExit) as e:
            pr.parse(argv)
        assert e.value.code == 2
        assert words in capsys.readouterr().err, argv


def _entry(turn, side, median=None, error=None, n=MIN_MEASURED_STEPS + 1, version=None):
    """One side's record as run() writes it, made by peer_ratio's own measurement() from steady step times."""
    steady = [] if error else [median * f for f in (0.9, 1.0, 1.1, 1.0, 1.0, 1.0, 1.0)[:n]]
    return {
        "turn": turn,
        "position": 1,
        "side": side,
        "wall_s": 1.0,
        "log": "",
        **pr.measurement(steady, error=error, **({"version": version} if version else {})),
    }


def _data(runs, sides=("ours", "trl-default", "trl-sleep"), workload="357m-matched"):
    return {
        "workload": workload,
        "sides": list(sides),
        "runs": runs,
        "steps": 8,
        "warmup": 2,
        "device": "NVIDIA H100 80GB HBM3",
        "recordable": True,
        "command": "python bench/peer_ratio.py",
    }


def test_a_row_is_the_median_of_the_turns_ratios_with_min_max_and_a_failed_turn_left_out(tmp_path):
    ours = [1.0, 2.0, 1.0, 1.0]
    trl_default = [1.5, 3.0, None, 1.2]  # turn 3: out of memory without sleep
    trl_sleep = [2.0, 4.4, 2.2, 2.4]
    runs = []
    for t in range(4):
        runs += [
            _entry(t + 1, "ours", ours[t]),
            _entry(t + 1, "trl-default", trl_default[t], error=None if trl_default[t] else OOM, version="1.16"),
            _entry(t + 1, "trl-sleep", trl_sleep[t], version="1.16"),
        ]
    rows, problems = pr.ratio_rows(_data(runs))
    by = {r.metric: r for r in rows}
    default, sleep = by["speedup vs TRL default x"], by["speedup vs TRL sleep x"]
    assert default.value == pytest.approx(1.5)  # median of 1.5, 1.5, 1.2: the failed turn is not a ratio
    assert "1.200-1.500 min-max over 3 turns, TRL default 1.500 s / ours 1.000 s medians" in default.unit
    assert f"TRL default failed in 1 of 4 turns: {OOM}" in default.unit and default.record
    assert sleep.value == pytest.approx(2.2)  # median of 2.0, 2.2, 2.2, 2.4
    assert "2.000-2.400 min-max over 4 turns, TRL sleep 2.300 s / ours 1.000 s medians" in sleep.unit
    assert "TRL sleep 1.16" in sleep.unit and "2 warm-up dropped" in sleep.unit
    assert problems == [f"speedup vs TRL default x: TRL default failed in 1 of 4 turns: {OOM}"]
    scratch = tmp_path / "RESULTS.md"
    assert append_results(rows, "NVIDIA H100 80GB HBM3", path=scratch, command="python bench/peer_ratio.py") == 2
    text = scratch.read_text()
    assert "| speedup vs TRL default x | 1.500 | x (1.200-1.500 min-max over 3 turns" in text
    assert "| `python bench/peer_ratio.py` |" in text


def test_calls_of_one_turn_each_join_into_one_row(tmp_path, capsys):
    """A call too short for three turns runs one (--turn_offset continues the order); `report` joins the calls'
    JSONs: each turn's ratio is still of one call, and calls of another code, workload or machine do not join."""
    assert pr.turn_order(["ours", "trl-default"], 1, offset=1) == [["trl-default", "ours"]]
    args, _ = pr.parse(["--workload", "357m-matched", "--turns", "1", "--turn_offset", "2", "--record"])
    assert args.why_not_recordable is None  # three turns in all: a row may come of them
    with pytest.raises(SystemExit):
        pr.parse(["--workload", "357m-matched", "--turns", "1", "--turn_offset", "1", "--record"])
    paths = []
    for t, (o, d) in enumerate([(1.0, 1.3), (1.0, 1.5), (2.0, 2.8)], start=1):
        data = {**_data([_entry(t, "ours", o), _entry(t, "trl-default", d)], sides=("ours", "trl-default"))}
        data.update(code="abc", turns=1)
        paths.append(tmp_path / f"call{t}.json")
        paths[-1].write_text(json.dumps(data))
    joined = pr.join_calls([json.loads(p.read_text()) for p in paths])
    (row,) = pr.ratio_rows(joined)[0]
    assert row.record and row.value == pytest.approx(1.4)  # the median of 1.3, 1.5, 1.4
    assert "min-max over 3 turns" in row.unit and joined["turns"] == 3
    assert pr.main(["report", *map(str, paths)]) == 0
    assert "speedup vs TRL default x" in capsys.readouterr().out
    other = json.loads(paths[2].read_text())
    with pytest.raises(SystemExit, match="differ in code"):
        pr.join_calls([json.loads(paths[0].read_text()), {**other, "code": "def"}])
    with pytest.raises(SystemExit, match="turn 1 is in two calls"):
        pr.join_calls([json.loads(paths[0].read_text()), json.loads(paths[0].read_text())])


def test_a_peer_that_failed_with_too_few_ratios_is_recorded_as_failed_never_a_figure():
    runs = []
    for t, (o, d) in enumerate([(1.0, None), (1.0, 1.4), (1.0, None)], start=1):
        runs += [
            _entry(t, "ours", o),
            _entry(t, "trl-default", d, error=None if d else OOM),
            _entry(t, "trl-sleep", 2.0),
        ]
    rows, problems = pr.ratio_rows(_data(runs))
    (default,) = [r for r in rows if r.metric == "speedup vs TRL default x"]
    assert default.value == "failed" and default.record
    assert "failed in 2 of 3 turns" in default.unit and "1 ratio(s) left: 1.400" in default.unit
    assert any("TRL default failed" in p for p in problems)


def test_our_failed_turn_gives_no_ratio_and_too_few_turns_give_no_recorded_row():
    runs = [
        _entry(1, "ours", error="exit 1: RuntimeError: boom"),
        _entry(1, "trl-default", 1.5),
        _entry(2, "ours", 1.0),
        _entry(2, "trl-default", 1.5),
        _entry(3, "ours", 1.0),
        _entry(3, "trl-default", 2.0),
    ]
    rows, problems = pr.ratio_rows(_data(runs, sides=("ours", "trl-default")))
    (row,) = rows
    assert not row.record and row.value == pytest.approx(1.75)  # 2 ratios: printed, not a RESULTS row
    assert "ours failed in 1 of 3 turns: exit 1: RuntimeError: boom" in row.unit
    assert problems and "a row needs >= 3" in problems[0]


def test_a_side_needs_five_measured_steps_and_the_same_warmup(tmp_path):
    short = pr.measurement([1.0] * (MIN_MEASURED_STEPS - 1))
    assert not short["ok"] and short["median_s"] is None and "raise --steps" in short["error"]
    log = tmp_path / "log.txt"
    log.write_text("noise\nRESULT " + json.dumps({"trl": "1.16", "warmup": 1, "step_s": [1.0] * 7}) + "\n")
    got = pr.read_trl(str(tmp_path), {"log": str(log), "rc": 0}, warmup=2)
    assert not got["ok"] and "warm-up 1, not 2" in got["error"]
    log.write_text("RESULT " + json.dumps({"error": OOM, "trl": "1.16"}) + "\n")
    got = pr.read_trl(str(tmp_path), {"log": str(log), "rc": 3}, warmup=2)
    assert not got["ok"] and got["error"] == OOM
    log.write_text("Traceback (most recent call last):\nImportError: no module named trl\n")
    got = pr.read_trl(str(tmp_path), {"log": str(log), "rc": 1, "stopped": None}, warmup=2)
    assert got["error"] == "no RESULT line: exit 1: ImportError: no module named trl"


def test_openrlhf_is_read_on_the_step_end_clock(tmp_path):
    ends = [0.0, 9.0, 11.0, 13.0, 16.0, 18.0, 20.0, 22.0]  # steps 3-8: 2, 2, 3, 2, 2, 2
    steps = [{"step": n + 1, "status": {"timing/step_total": 1.0}, "t": t} for n, t in enumerate(ends)]
    res = {"warmup": 2, "openrlhf": "0.11.2", "sleep": False, **openrlhf_peer.summarize(steps, 2)}
    (tmp_path / "openrlhf-1.5b-matched-nosleep.json").write_text(json.dumps(res))
    got = pr.read_openrlhf(str(tmp_path), {"log": str(tmp_path / "log.txt"), "rc": 0}, warmup=2)
    assert got["ok"] and got["median_s"] == 2.0 and got["version"] == "0.11.2"  # not timing/step_total's 1.0
    (tmp_path / "openrlhf-1.5b-matched-nosleep.json").write_text(json.dumps({**res, "error": OOM}))
    got = pr.read_openrlhf(str(tmp_path), {"log": str(tmp_path / "log.txt"), "rc": 3}, warmup=2)
    assert not got["ok"] and got["error"] == OOM


# A stand-in for the three programs (see the module docstring): which one it plays follows from its arguments; its
# step time (or error) for this call comes from STANDIN_PLAN[role][how many times that role ran before].
STANDIN = textwrap.dedent("""
    import json, os, sys
    sys.path.insert(0, os.environ["STANDIN_BENCH"])
    argv = sys.argv[1:]
    value = lambda flag: argv[argv.index(flag) + 1]
    if "--tag" in argv:
        role = "ours"
    elif "--setup" in argv:
        role = "openrlhf-nosleep" if "--no_sleep" in argv else "openrlhf-sleep"
    else:
        role = "trl-sleep" if "--sleep" in argv else "trl-default"
    log = os.environ["STANDIN_LOG"]
    seen = open(log).read().split() if os.path.exists(log) else []
    open(log, "a").write(role + "\\n")
    plan = json.loads(os.environ["STANDIN_PLAN"])[role][seen.count(role)]
    steps, warmup = int(value("--steps")), int(value("--warmup"))
    durations = [3 * plan if k < warmup else plan for k in range(steps)] if not isinstance(plan, str) else []
    ends = [100.0 + sum(durations[:k + 1]) for k in range(len(durations))]
    out = os.environ["OUT"]
    if role == "ours":
        import e2e_gpu
        name = f"e2e-grpo-{value('--size')}-colocated-{value('--tag')}.json"
        if isinstance(plan, str):
            json.dump({"rc": 1}, open(os.path.join(out, name), "w"))
            print(plan)
            sys.exit(1)
        metrics = os.path.join(out, "fake-metrics.jsonl")
        with open(metrics, "w") as f:
            for end in ends:
                f.write(json.dumps({"time/step": 0.5, "wall_time": end, "reward": 0.0, "response_len": 4}) + "\\n")
        json.dump({"rc": 0, **e2e_gpu.summarize(metrics, warmup)}, open(os.path.join(out, name), "w"))
    else:
        from _common import median_step, steady_step_times
        if isinstance(plan, str):
            print("RESULT", json.dumps({"trl": "standin", "error": plan}))
            sys.exit(3)
        print("RESULT", json.dumps({"trl": "standin", "mode": "vllm", "sleep": role == "trl-sleep",
                                    "step_s": steady_step_times(ends, warmup), "warmup": warmup,
                                    "median_step_s": median_step(ends, warmup)}))
""")


def test_a_whole_run_through_subprocesses_alternates_keeps_the_failure_and_makes_the_rows(
    tmp_path, capsys, monkeypatch
):
    standin = tmp_path / "standin.py"
    standin.write_text(STANDIN)
    workdir = tmp_path / "wd"
    (workdir / "model").mkdir(parents=True)
    (workdir / "model" / "config.json").write_text("{}")  # the folder exists: nothing is built
    (workdir / "prompts.jsonl").write_text("")
    plan = {"ours": [1.0, 1.0, 2.0], "trl-default": [1.5, OOM, 3.0], "trl-sleep": [2.0, 2.5, 4.0]}
    monkeypatch.setenv("STANDIN_BENCH", str(BENCH))
    monkeypatch.setenv("STANDIN_LOG", str(tmp_path / "calls.log"))
    monkeypatch.setenv("STANDIN_PLAN", json.dumps(plan))
    out = tmp_path / "out"
    argv = [
        "--workload",
        "357m-matched",
        "--workdir",
        str(workdir),
        "--out",
        str(out),
        "--run_timeout",
        "120",
        *[f"--script={p}={standin}" for p in ("ours", "trl")],
    ]
    rc = pr.main(argv)
    printed = capsys.readouterr().out

    assert (tmp_path / "calls.log").read_text().split() == [
        "ours",
        "trl-default",
        "trl-sleep",
        "trl-sleep",
        "trl-default",
        "ours",
        "ours",
        "trl-default",
        "trl-sleep",
    ]
    data = json.loads((out / "peer_ratio-357m-matched.json").read_text())
    assert [(r["turn"], r["side"]) for r in data["runs"]][:4] == [
        (1, "ours"),
        (1, "trl-default"),
        (1, "trl-sleep"),
        (2, "trl-sleep"),
    ]
    by = {(r["turn"], r["side"]): r for r in data["runs"]}
    assert by[(2, "trl-default")]["ok"] is False and by[(2, "trl-default")]["error"] == OOM
    assert by[(3, "ours")]["median_s"] == 2.0 and by[(3, "ours")]["steady_s"] == [2.0] * 6  # the warm-up dropped
    assert by[(1, "trl-sleep")]["median_s"] == 2.0
    assert "--sleep" in shlex.split(by[(1, "trl-sleep")]["command"])
    assert not data["recordable"] and "stand-ins for ours, trl" in data["why_not_recordable"]

    assert rc == 3  # a peer failed: not a clean run
    rows, _ = pr.ratio_rows(data)
    by_metric = {r.metric: r for r in rows}
    sleep = by_metric["speedup vs TRL sleep x"]
    assert sleep.value == pytest.approx(2.0)  # turns: 2.0/1.0, 2.5/1.0, 4.0/2.0
    assert "2.000-2.500 min-max over 3 turns, TRL sleep 2.500 s / ours 1.000 s medians" in sleep.unit
    default = by_metric["speedup vs TRL default x"]
    assert default.value == "failed" and "TRL default failed in 1 of 3 turns: CUDA out of memory" in default.unit
    assert "FAILED: CUDA out of memory" in printed and "speedup vs TRL sleep x" in printed

    assert pr.main(["report", str(out / "peer_ratio-357m-matched.json")]) == 3  # the same rows again
    assert "2.000-2.500 min-max over 3 turns" in capsys.readouterr().out
    assert pr.main(["report", str(out / "peer_ratio-357m-matched.json"), "--record"]) == 2  # stand-ins: never
    assert "not recorded: stand-ins" in capsys.readouterr().out
