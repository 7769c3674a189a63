"""``hybrid compare`` on the CPU: two real built-in (hf) engines, same prompt token ids, greedy."""

import json

import pytest

from hybrid_cli.compare import agreement
from hybrid_cli.main import main


def test_agreement_counts_positions_up_to_the_first_divergence():
    a = [[5, 6, 7, 8], [1, 2], [9, 9, 9]]
    b = [[5, 6, 0, 8], [1, 2], [9, 9]]
    lp_a = [[-0.1, -0.2, -0.3, -0.4], [-1.0, -2.0], [-0.5, -0.5, -0.5]]
    lp_b = [[-0.1, -0.25, -9.0, -0.4], [-1.5, -2.0], [-0.5, -0.7]]
    r = agreement(a, b, lp_a, lp_b)
    assert r.first_divergence == [2, 2, 2] and r.diverged == [0, 2]
    assert r.token_agreement == pytest.approx((2 + 2 + 2) / (4 + 2 + 3))
    assert r.identical_sequences == pytest.approx(1 / 3)
    # only positions before each first divergence are compared (position 2 of prompt 0 differs in token)
    assert r.max_abs_logprob_diff == pytest.approx(0.5)
    assert r.mean_abs_logprob_diff == pytest.approx((0 + 0.05 + 0.5 + 0 + 0 + 0.2) / 6)
    assert [p["compared"] for p in r.per_position] == [3, 3]
    assert r.per_position[1]["max"] == pytest.approx(0.2)
    with pytest.raises(ValueError):
        agreement([[1]], [])


def test_hf_vs_hf_float32_vs_float64_agree(tiny_model_dir, tmp_path, capsys):
    out = tmp_path / "report.json"
    rc = main(
        [
            "compare",
            "--backend_a",
            "hf",
            "--backend_b",
            "hf",
            "--pretrain",
            tiny_model_dir,
            "--dtype_a",
            "float32",
            "--dtype_b",
            "float64",
            "--batch_size_b",
            "3",
            "--max_samples",
            "12",
            "--generate_max_len",
            "6",
            "--json",
            str(out),
            "--min_token_agreement",
            "0.99",
        ]
    )
    assert rc == 0
    report = json.loads(out.read_text())
    assert report["prompts"] == 12 and report["token_agreement"] == 1.0 and report["identical_sequences"] == 1.0
    # same weights, float32 vs float64: log-probs differ only by rounding, and they are compared at every position
    assert 0 < report["max_abs_logprob_diff"] < 1e-4
    assert sum(p["compared"] for p in report["per_position"]) == sum(report["first_divergence"]) > 12
    assert "token agreement" in capsys.readouterr().out


def test_different_weights_diverge_and_fail_the_gate(tiny_model_dir, tmp_path, prompts_jsonl):
    from hybrid_algos.train.tiny import save_tiny_model

    other = save_tiny_model(str(tmp_path / "other"), seed=7)
    out = tmp_path / "report.json"
    rc = main(
        [
            "compare",
            "--backend_a",
            "hf",
            "--backend_b",
            "hf",
            "--pretrain",
            tiny_model_dir,
            "--pretrain_b",
            other,
            "--prompt_data",
            prompts_jsonl,
            "--input_key",
            "prompt",
            "--max_samples",
            "8",
            "--generate_max_len",
            "6",
            "--json",
            str(out),
            "--min_token_agreement",
            "0.99",
        ]
    )
    assert rc == 1
    report = json.loads(out.read_text())
    assert report["token_agreement"] < 0.99 and report["diverged"]


def test_compare_input_errors(capsys, tiny_model_dir, prompts_jsonl):
    assert main(["compare", "--backend_a", "hf"]) == 2
    assert "backend_b" in capsys.readouterr().err
    assert main(["compare", "--backend_a", "hf", "--backend_b", "hf", "--prompt_data", prompts_jsonl]) == 2
    assert "input_key" in capsys.readouterr().err
    assert (
        main(
            [
                "compare",
                "--backend_a",
                "hf",
                "--backend_b",
                "vllm",
                "--pretrain",
                tiny_model_dir,
                "--batch_size_b",
                "4",
                "--max_samples",
                "2",
            ]
        )
        == 2
    )
    assert "batch_size_b" in capsys.readouterr().err
