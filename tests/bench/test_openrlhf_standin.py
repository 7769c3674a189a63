"""bench/openrlhf_standin: the flash_attn names OpenRLHF 0.11.2 imports, in plain torch, against straightforward
reference implementations; and transformers must not take the stand-in for flash-attn."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

STANDIN = Path(__file__).resolve().parents[2] / "bench" / "openrlhf_standin"


def _load(rel: str, name: str):
    """The module at STANDIN/rel under a private name: the test process never imports a `flash_attn`."""
    spec = importlib.util.spec_from_file_location(name, STANDIN / rel)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


bp = _load("flash_attn/bert_padding.py", "standin_bert_padding")
dist_mod = _load("flash_attn/utils/distributed.py", "standin_distributed")


def _random_mask(batch: int, seqlen: int, seed: int) -> torch.Tensor:
    """Left padding (as OpenRLHF's rollouts), right padding and holes, with one full and one near-empty row."""
    g = torch.Generator().manual_seed(seed)
    mask = (torch.rand(batch, seqlen, generator=g) > 0.3).long()
    mask[0] = 1
    mask[1] = 0
    mask[1, -1] = 1
    mask[2, : seqlen // 2] = 0
    return mask


def _reference_unpad(hidden, mask):
    rows, idx = [], []
    for b in range(mask.shape[0]):
        for s in range(mask.shape[1]):
            if mask[b, s]:
                rows.append(hidden[b, s])
                idx.append(b * mask.shape[1] + s)
    lengths = [int(m.sum()) for m in mask]
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    return torch.stack(rows), torch.tensor(idx), torch.tensor(cu, dtype=torch.int32), max(lengths), lengths


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("trailing", [(), (3,), (2, 5)])
def test_unpad_matches_reference_and_pad_inverts_it(seed, trailing):
    batch, seqlen = 5, 11
    mask = _random_mask(batch, seqlen, seed)
    hidden = torch.randn(batch, seqlen, *trailing, generator=torch.Generator().manual_seed(seed + 10))
    packed, indices, cu, max_len, used = bp.unpad_input(hidden, mask)
    ref_packed, ref_idx, ref_cu, ref_max, ref_lengths = _reference_unpad(hidden, mask)
    assert torch.equal(packed, ref_packed)
    assert torch.equal(indices, ref_idx)
    assert cu.dtype == torch.int32 and torch.equal(cu, ref_cu)
    assert isinstance(max_len, int) and max_len == ref_max
    assert used.tolist() == ref_lengths
    restored = bp.pad_input(packed, indices, batch, seqlen)
    expect = hidden * mask.view(batch, seqlen, *([1] * len(trailing)))
    assert restored.shape == hidden.shape and torch.equal(restored, expect)


def test_unused_mask_positions_are_kept_but_not_counted_as_used():
    mask = torch.tensor([[0, 1, 1, 0], [1, 0, 0, 0]])
    unused = torch.tensor([[0, 0, 0, 1], [0, 1, 0, 0]])
    hidden = torch.arange(8.0).view(2, 4, 1)
    packed, indices, cu, max_len, used = bp.unpad_input(hidden, mask, unused)
    assert indices.tolist() == [1, 2, 3, 4, 5]
    assert packed.flatten().tolist() == [1.0, 2.0, 3.0, 4.0, 5.0]
    assert cu.tolist() == [0, 3, 5] and max_len == 3 and used.tolist() == [2, 1]


def test_index_first_axis_and_pad_input_carry_gradients():
    mask = _random_mask(3, 7, 4)
    hidden = torch.randn(3, 7, 4, requires_grad=True)
    packed, indices, *_ = bp.unpad_input(hidden, mask)
    weights = torch.randn_like(packed)
    (packed * weights).sum().backward()
    expect = torch.zeros(3 * 7, 4)
    expect[indices] = weights
    assert torch.equal(hidden.grad, expect.view(3, 7, 4))

    rows = torch.randn(len(indices), 4, requires_grad=True)
    out = bp.pad_input(rows, indices, 3, 7)
    upstream = torch.randn_like(out)
    (out * upstream).sum().backward()
    assert torch.equal(rows.grad, upstream.reshape(21, 4)[indices])


def test_rearrange_is_exported_for_openrlhf():
    x = torch.arange(12).view(2, 3, 2)
    assert torch.equal(bp.rearrange(x, "b s ... -> (b s) ..."), x.reshape(6, 2))


def _gather_worker(rank: int, world: int, port: int, results):
    import torch.distributed as dist

    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=__import__("datetime").timedelta(seconds=60),
    )
    try:
        x = torch.full((2, 3), float(rank + 1), requires_grad=True)
        out = dist_mod.all_gather(x, dist.group.WORLD)
        weights = torch.arange(out.numel(), dtype=torch.float32).view_as(out)
        (out * weights).sum().backward()
        singles = [dist.new_group([r]) for r in range(world)]  # every rank creates every group
        alone = dist_mod.all_gather(x, singles[rank]) is x  # a group of one: the input itself
        results.put((rank, out.detach().tolist(), x.grad.tolist(), alone))
    finally:
        dist.destroy_process_group()


def test_all_gather_concatenates_in_rank_order_over_a_real_gloo_group_and_is_the_identity_alone():
    import torch.multiprocessing as mp

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
    from _common import free_port

    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_gather_worker, args=(r, 2, port, results)) for r in range(2)]
    for p in procs:
        p.start()
    got = {r: (out, grad, alone) for r, out, grad, alone in (results.get(timeout=120) for _ in procs)}
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    expect = [[1.0] * 3, [1.0] * 3, [2.0] * 3, [2.0] * 3]
    weights = torch.arange(12, dtype=torch.float32).view(4, 3)
    for rank in (0, 1):
        out, grad, alone = got[rank]
        assert out == expect and alone
        # every rank used the same weights, so each rank's slice gets the sum over the two ranks' gradients
        assert torch.equal(torch.tensor(grad), 2 * weights[2 * rank : 2 * rank + 2])


def test_transformers_does_not_take_the_standin_for_flash_attn():
    """With the stand-in first on the path, `flash_attn` imports but no flash-attn distribution exists (no metadata:
    transformers >= 5.17 checks it before the version, so even on a CUDA machine it answers False), and the fused
    kernels OpenRLHF and vLLM try first are absent, so they take their torch paths."""
    code = (
        "import importlib, importlib.metadata, json\n"
        "import flash_attn, flash_attn.bert_padding, flash_attn.utils.distributed\n"
        "from transformers.utils import import_utils as u\n"
        "try:\n"
        "    importlib.import_module('flash_attn.ops.triton.cross_entropy'); ops = True\n"
        "except ImportError:\n"
        "    ops = False\n"
        "print(json.dumps({'file': flash_attn.__file__, 'fa2': u.is_flash_attn_2_available(),\n"
        "    'dists': importlib.metadata.packages_distributions().get('flash_attn', []),\n"
        "    'version': u._is_package_available('flash_attn', return_version=True)[1],\n"
        "    'has_version_attr': hasattr(flash_attn, '__version__'), 'ops': ops}))\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(STANDIN), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    import json

    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["file"].startswith(str(STANDIN))
    assert got["fa2"] is False
    assert got["dists"] == [] and got["version"] == "N/A" and not got["has_version_attr"]
    assert got["ops"] is False
