"""--dry-run of GRPO with --init_kl_coef 0: no KL term, so neither the plan nor the memory budget has a reference
model (with use_kl_loss on, as GRPO's default, a zero coefficient still makes the KL loss vanish)."""

from hybrid_cli.main import main


def test_grpo_without_kl_dry_runs_without_a_reference(capsys):
    assert main(["grpo", "--dry-run", "--init_kl_coef", "0"]) == 0
    out = capsys.readouterr().out
    assert "grpo: 1 GPU(s)" in out and "actor" in out and "rollout" in out
    assert "reference" not in out
    assert main(["grpo", "--dry-run", "--init_kl_coef", "0.001"]) == 0
    assert "reference" in capsys.readouterr().out  # the same command with a KL term places one
