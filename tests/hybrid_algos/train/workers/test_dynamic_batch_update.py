"""The real actor (PolicyWorker: DeepSpeed, the registry's loss, the chunked head) on one rank: an update made of
token-budget micro-batches (--use_dynamic_batch, packed or padded) or of fixed micro-batches (gradient accumulation,
whose token counts differ) has the gradient of the same update made as one
micro-batch -- the loss weights and the optimizer boundary are right -- and steps the optimizer once per update.
(ZeRO stage 0, so the accumulated gradient can be read off the parameters at the boundary.)

Runs in a subprocess: it initialises torch.distributed and DeepSpeed, which must not leak into other tests."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent("""
    import json, socket, sys, tempfile
    import torch
    from hybrid_algos.train.config import GRPOConfig
    from hybrid_algos.train.deepspeed_ops import ensure_cpu_ops_built
    from hybrid_algos.train.experience import Rollout
    from hybrid_algos.train.tiny import save_tiny_model
    from hybrid_algos.train.workers.policy import PolicyWorker

    ensure_cpu_ops_built()
    model_dir = save_tiny_model(tempfile.mkdtemp(), seed=1)
    g = torch.Generator().manual_seed(0)
    prompts, completions = [], []
    for _ in range(4):
        prompts.append([1] + torch.randint(4, 12, (int(torch.randint(1, 5, (1,), generator=g)),), generator=g).tolist())
        completions.append([torch.randint(4, 12, (int(torch.randint(1, 7, (1,), generator=g)),), generator=g).tolist()
                            for _ in range(4)])
    rollout = Rollout.from_generations(prompts, completions, 0)
    rollout = rollout.with_(advantages=torch.randn(rollout.action_mask.shape, generator=g) * rollout.action_mask)

    def port():
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return s.getsockname()[1]

    def run(**changes):
        cfg = GRPOConfig(rollout_batch_size=4, n_samples_per_prompt=4, train_batch_size=16, max_epochs=1,
                         micro_train_batch_size=changes.pop("micro", 16), zero_stage=0, deepspeed_enable_sleep=False,
                         init_kl_coef=0.0, use_kl_loss=False, enable_vllm_is_correction=False,
                         actor_learning_rate=1e-3, seed=0, **changes)
        worker = PolicyWorker("actor", 0, 1, cfg.settings(), tempfile.mkdtemp())
        worker.where = lambda: {}
        worker.setup(model_dir, "127.0.0.1", port(), total_steps=1)
        engine, grads = worker.engine, {}
        step = engine.step

        def recording_step(*args, **kwargs):  # the accumulated gradient, read just before the optimizer uses it
            if engine.is_gradient_accumulation_boundary():
                grads.update({n: p.grad.detach().clone() for n, p in engine.module.named_parameters()})
            return step(*args, **kwargs)

        engine.step = recording_step
        stats = worker.train(rollout, step=0, kl_coef=0.0)
        return grads, stats, engine.deepspeed.global_steps  # the DeepSpeed adapter holds the engine

    one, one_stats, one_steps = run()
    out = {"one_steps": one_steps, "one_micro": one_stats["actor/micro_batches"]}
    for label, changes in (("padded", {"use_dynamic_batch": True, "train_max_tokens_per_gpu": 24}),
                           ("packed", {"use_dynamic_batch": True, "train_max_tokens_per_gpu": 24,
                                       "packing_samples": True}),
                           ("fixed", {})):  # four fixed micro-batches of 4 samples: gradient accumulation
        delta, stats, steps = run(micro=4, **changes)
        diff = max((delta[n] - one[n]).abs().max().item() for n in one)
        moved = max(one[n].abs().max().item() for n in one)
        out[label] = {"micro": stats["actor/micro_batches"], "steps": steps, "max_diff": diff / moved, "moved": moved,
                      "loss": stats["actor/pg_loss"], "one_loss": one_stats["actor/pg_loss"]}
    print("RESULT " + json.dumps(out))
""")


def test_token_budget_update_equals_one_micro_batch(tmp_path):
    result = subprocess.run(
        [sys.executable, "-c", SCRIPT],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=400,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert result.returncode == 0, result.stderr[-4000:]
    line = [x for x in result.stdout.splitlines() if x.startswith("RESULT ")][-1]
    out = json.loads(line[len("RESULT ") :])
    assert out["one_steps"] == 1 and out["one_micro"] == 1
    for label in ("padded", "packed", "fixed"):
        r = out[label]
        assert r["micro"] >= 3, out  # the budget really split the update
        assert r["steps"] == 1, out  # ... and the optimizer stepped once, at the update's end
        assert r["moved"] > 1e-4  # a real gradient
        assert r["max_diff"] < 1e-4, out  # ... the one of the whole update as one micro-batch (relative)
