"""Environment tokens get no gradient: in multi-turn samples ``[prompt | model turn | tool reply | model turn | reply]``
the real actor update (PolicyWorker: DeepSpeed, the policy loss with the mismatch correction, the KL loss against a
reference, an entropy bonus; padded and packed) is the same whatever the environment tokens carry as loss inputs
(advantages, engine / reference log-probs) and whatever the trailing reply's token ids are -- while marking those
same tokens as the model's, or changing one advantage of a model token, does change it.

A reply *between* two model turns is context for the later turn (it is attended to, as the engine attended to it
when it sampled that turn), so its ids do change the later turn's log-probs; what must not happen is a loss, KL or
correction term on the reply itself, which is what this checks.

The advantage estimators are checked the same way in-process: environment positions get 0 and change nothing at the
model's positions, for GAE, REINFORCE++ (KL in the reward) and GRPO.

The update runs in a subprocess: it initialises torch.distributed and DeepSpeed, which must not leak into other tests.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import torch

SCRIPT = textwrap.dedent("""
    import json, socket, tempfile
    import torch
    from hybrid_algos.train.config import GRPOConfig
    from hybrid_algos.train.deepspeed_ops import ensure_cpu_ops_built
    from hybrid_algos.train.experience import Rollout
    from hybrid_algos.train.tiny import save_tiny_model
    from hybrid_algos.train.workers.policy import PolicyWorker

    ensure_cpu_ops_built()
    model_dir = save_tiny_model(tempfile.mkdtemp(), seed=1)
    g = torch.Generator().manual_seed(0)
    sym = lambda k: torch.randint(4, 12, (k,), generator=g).tolist()
    # 4 prompts x 2 samples; each response: turn (model) | reply (env) | turn (model) | trailing reply (env)
    prompts, responses, masks = [], [], []
    for i in range(4):
        prompts.append([1] + sym(1 + i % 2) + [3])
        group_r, group_m = [], []
        for j in range(2):
            a, b, c, d = 2 + (i + j) % 2, 3, 1 + j, 2 + i % 3
            group_r.append(sym(a) + [2] + sym(b) + sym(c) + [2] + sym(d))
            group_m.append([1] * (a + 1) + [0] * b + [1] * (c + 1) + [0] * d)
        responses.append(group_r)
        masks.append(group_m)
    engine_lp = [[[-0.5 - 2 * torch.rand(1, generator=g).item() for _ in r] for r in group] for group in responses]
    base = Rollout.from_generations(prompts, responses, 0, logprobs=engine_lp, action_masks=masks)
    shape = base.action_mask.shape
    env = (base.attention_mask[:, -shape[1]:] == 1) & (base.action_mask == 0)  # reply tokens
    base = base.with_(advantages=torch.randn(shape, generator=g) * base.action_mask,
                      ref_logprobs=(-1.0 - torch.rand(shape, generator=g)) * base.action_mask)
    # trailing replies: after a sample's last model token (other samples' model tokens reach further, so these
    # columns are in the forward pass)
    last = torch.where(base.action_mask.bool(), torch.arange(shape[1]), -1).amax(-1)
    trailing = env & (torch.arange(shape[1])[None, :] > last[:, None])
    assert trailing.any() and (env & ~trailing).any()
    noise = lambda: torch.randn(shape, generator=g) * 5

    variants = {
        "base": base,
        "env_inputs": base.with_(advantages=torch.where(env, noise(), base.advantages),
                                 engine_logprobs=torch.where(env, -noise().abs(), base.engine_logprobs),
                                 ref_logprobs=torch.where(env, -noise().abs(), base.ref_logprobs)),
        "trailing_ids": base.with_(sequences=torch.cat([base.sequences[:, :-shape[1]], torch.where(
            trailing, (base.sequences[:, -shape[1]:] - 4 + 3) % 8 + 4, base.sequences[:, -shape[1]:])], 1)),
        "env_as_model": base.with_(action_mask=torch.where(env, 1.0, base.action_mask),
                                   advantages=torch.where(env, noise(), base.advantages),
                                   engine_logprobs=torch.where(env, -noise().abs(), base.engine_logprobs),
                                   ref_logprobs=torch.where(env, -noise().abs(), base.ref_logprobs)),
    }
    one = base.advantages.clone()
    one[0, 0] += 1.0
    variants["model_advantage"] = base.with_(advantages=one)
    assert not torch.equal(variants["trailing_ids"].sequences, base.sequences)

    def port():
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return s.getsockname()[1]

    def update(rollout, packed):
        cfg = GRPOConfig(rollout_batch_size=4, n_samples_per_prompt=2, train_batch_size=8, micro_train_batch_size=4,
                         max_epochs=1, zero_stage=0, deepspeed_enable_sleep=False, init_kl_coef=0.1, use_kl_loss=True,
                         kl_estimator="k3", entropy_loss_coef=0.01, enable_vllm_is_correction=True,
                         actor_learning_rate=1e-3, packing_samples=packed, seed=0)
        worker = PolicyWorker("actor", 0, 1, cfg.settings(), tempfile.mkdtemp())
        worker.where = lambda: {}
        worker.setup(model_dir, "127.0.0.1", port(), total_steps=1)
        engine, grads = worker.engine, {}
        before = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
        step = engine.step

        def recording_step(*args, **kwargs):  # the accumulated gradient, read just before the optimizer uses it
            if engine.is_gradient_accumulation_boundary():
                grads.update({n: p.grad.detach().clone() for n, p in engine.module.named_parameters()})
            return step(*args, **kwargs)

        engine.step = recording_step
        stats = worker.train(rollout, step=0, kl_coef=0.1)
        delta = {n: p.detach() - before[n] for n, p in engine.module.named_parameters()}
        return grads, delta, stats

    out = {}
    for packed in (False, True):
        ref_grads, ref_delta, ref_stats = update(base, packed)
        scale = max(v.abs().max().item() for v in ref_grads.values())
        row = {"moved": max(v.abs().max().item() for v in ref_delta.values()), "scale": scale,
               "mismatch_tokens": ref_stats.get("mismatch/ratio_mean")}
        for name, rollout in variants.items():
            if name == "base":
                continue
            grads, delta, stats = update(rollout, packed)
            row[name] = {"grad": max((grads[n] - ref_grads[n]).abs().max().item() for n in grads) / scale,
                         "delta": max((delta[n] - ref_delta[n]).abs().max().item() for n in delta),
                         "kl_loss": stats["actor/kl_loss"] - ref_stats["actor/kl_loss"],
                         "mismatch_kl": stats.get("mismatch/kl", 0.0) - ref_stats.get("mismatch/kl", 0.0)}
        out["packed" if packed else "padded"] = row
    print("RESULT " + json.dumps(out))
""")


def test_environment_tokens_change_no_parameter_update(tmp_path):
    result = subprocess.run(
        [sys.executable, "-c", SCRIPT],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert result.returncode == 0, result.stderr[-4000:]
    line = [x for x in result.stdout.splitlines() if x.startswith("RESULT ")][-1]
    out = json.loads(line[len("RESULT ") :])
    for layout in ("padded", "packed"):
        row = out[layout]
        assert row["moved"] > 1e-4 and row["scale"] > 0  # a real update happened
        for same in ("env_inputs", "trailing_ids"):  # what the environment tokens carry: no effect at all
            assert row[same]["grad"] < 1e-6 and row[same]["delta"] < 1e-9, (layout, same, row[same])
            assert abs(row[same]["kl_loss"]) < 1e-9 and abs(row[same]["mismatch_kl"]) < 1e-9, (layout, same, row)
        for differs in ("env_as_model", "model_advantage"):  # the controls: the test can see a change
            assert row[differs]["grad"] > 1e-3 and row[differs]["delta"] > 1e-6, (layout, differs, row[differs])
        assert abs(row["env_as_model"]["kl_loss"]) > 1e-6


def test_advantages_are_zero_at_environment_tokens_and_ignore_them():
    from hybrid_algos.train.advantage_step import advantages_for
    from hybrid_algos.train.config import GRPOConfig, PPOConfig, ReinforceConfig
    from hybrid_algos.train.experience import Rollout

    g = torch.Generator().manual_seed(3)
    responses = [[[5, 6, 2, 7, 8, 9, 4, 2, 6]], [[5, 2, 7, 4, 2]], [[6, 6, 2, 9, 9, 5, 2]], [[4, 2, 8, 8, 5, 2]]]
    masks = [[[1, 1, 1, 0, 0, 0, 1, 1, 0]], [[1, 1, 0, 1, 1]], [[1, 1, 1, 0, 0, 1, 1]], [[1, 1, 0, 0, 1, 1]]]
    base = Rollout.from_generations([[1, 4, 3]] * 4, responses, 0, action_masks=masks)
    mask = base.action_mask
    env = (base.attention_mask[:, -mask.size(1) :] == 1) & (mask == 0)
    shape = mask.shape

    def rand():
        return torch.randn(shape, generator=g)

    base = base.with_(
        scores=torch.tensor([1.0, 0.0, 0.5, 0.2]), old_logprobs=-rand().abs(), ref_logprobs=-rand().abs(), values=rand()
    )
    noisy = base.with_(
        old_logprobs=torch.where(env, -rand().abs() * 9, base.old_logprobs),
        ref_logprobs=torch.where(env, -rand().abs() * 9, base.ref_logprobs),
        values=torch.where(env, rand() * 9, base.values),
    )
    for cfg in (PPOConfig(), ReinforceConfig(), GRPOConfig(n_samples_per_prompt=2)):
        algo, n = cfg.algorithm_settings(), cfg.n_samples_per_prompt
        a, _ = advantages_for(algo, base, kl_coef=0.1, n_samples_per_prompt=n)
        b, _ = advantages_for(algo, noisy, kl_coef=0.1, n_samples_per_prompt=n)
        assert (a.advantages[env] == 0).all() and (a.returns[env] == 0).all(), cfg.advantage_estimator
        assert torch.equal(a.advantages, b.advantages) and torch.equal(a.returns, b.returns), cfg.advantage_estimator
        assert (a.advantages[mask.bool()] != 0).any()
