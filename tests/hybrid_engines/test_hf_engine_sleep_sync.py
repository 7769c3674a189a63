"""The built-in engine's sleep / wake and weight updates, through hybrid_core's real offloader and transports
(a gloo weight-sync group between this test's thread as the trainer and the engine in a worker thread; CPU
shared-memory IPC buckets)."""

from __future__ import annotations

import socket
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from hybrid_core.errors import ConfigError
from hybrid_core.weight_sync import IpcBucketSender, TensorMeta, WeightSender, create_sync_group
from hybrid_engines import SamplingParams
from hybrid_engines.hf_engine import EngineStateError, HFEngine

VOCAB = 96
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=12)
SAMPLED = SamplingParams(temperature=1.0, max_new_tokens=12, n=2, seed=3)
BUCKET = 4096  # smaller than the embedding: tensors split across buckets, many buckets per sync


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread():
    """Tiny models run fastest single-threaded; on a shared 2-core machine, spinning OpenMP threads cost 20x."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def tiny_model(seed: int = 0, **overrides) -> LlamaForCausalLM:
    kw = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        initializer_range=0.2,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )
    kw.update(overrides)
    torch.manual_seed(seed)
    return LlamaForCausalLM(LlamaConfig(**kw)).eval()


PROMPTS = [[5, 17, 3], [40, 2, 9, 11, 63, 7, 1], [88], [12, 12, 30, 31, 4]]


def ids(outputs):
    return [[o.token_ids for o in per_prompt] for per_prompt in outputs]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def param_bytes(engine: HFEngine) -> list[int]:
    return [p.untyped_storage().nbytes() for p in engine.model.parameters()]


def test_sleep_frees_parameter_storage_and_wake_restores_identical_outputs():
    engine = HFEngine(tiny_model(), device="cpu")
    greedy, sampled = ids(engine.generate(PROMPTS, GREEDY)), ids(engine.generate(PROMPTS, SAMPLED))
    total = sum(p.numel() * p.element_size() for p in engine.model.parameters())
    for _ in range(2):  # the second cycle runs on the offloader's flat buffers
        stats = engine.sleep(1)
        assert stats.bytes >= total
        assert set(param_bytes(engine)) == {0}
        with pytest.raises(EngineStateError, match="asleep"):
            engine.generate(PROMPTS, GREEDY)
        assert engine.wake_up().bytes >= total
        assert ids(engine.generate(PROMPTS, GREEDY)) == greedy
        assert ids(engine.generate(PROMPTS, SAMPLED)) == sampled


def test_wake_tags_bring_back_weights_and_kv_cache_separately():
    engine = HFEngine(tiny_model(), device="cpu")
    engine.sleep(1)
    engine.wake_up(["weights"])
    assert 0 not in param_bytes(engine)
    with pytest.raises(EngineStateError, match="KV cache"):
        engine.generate(PROMPTS, GREEDY)
    engine.wake_up(["kv_cache"])
    engine.generate(PROMPTS, GREEDY)
    with pytest.raises(ConfigError) as e:
        engine.wake_up(["weights", "activations"])
    assert e.value.field == "tags"
    with pytest.raises(ConfigError) as e:
        engine.sleep(3)
    assert e.value.field == "level"


class Trainer:
    """Rank 0 of a real gloo weight-sync group; the engine joins from a worker thread (it blocks in collectives)."""

    def __init__(self, engine: HFEngine):
        self.engine, self.pool = engine, ThreadPoolExecutor(1)
        port = free_port()
        joined = self.pool.submit(
            engine.init_weight_update_group, "127.0.0.1", port, 1, 2, backend="gloo", timeout_s=30
        )
        self.group = create_sync_group("127.0.0.1", port, 0, 2, backend="gloo", timeout_s=30)
        joined.result(timeout=60)
        self.sender = WeightSender(self.group, BUCKET)

    def push(self, named: list[tuple[str, torch.Tensor]]):
        metas = [TensorMeta.of(n, t) for n, t in named]
        received = self.pool.submit(self.engine.update_weights, metas, bucket_bytes=BUCKET)
        sent = self.sender.send(named)
        return sent, received.result(timeout=60)

    def close(self):
        self.pool.shutdown()
        self.group.close()


def test_weight_update_through_gloo_matches_a_model_holding_the_new_weights():
    engine = HFEngine(tiny_model(seed=0), device="cpu")
    new = tiny_model(seed=42)
    reference = HFEngine(new, device="cpu")
    assert ids(engine.generate(PROMPTS, GREEDY)) != ids(reference.generate(PROMPTS, GREEDY))
    trainer = Trainer(engine)
    try:
        sent, received = trainer.push(list(new.named_parameters()))
        assert sent.bytes == received.bytes == sum(p.numel() * 4 for p in new.parameters())
        for (name, p), q in zip(new.named_parameters(), engine.model.parameters()):
            assert torch.equal(p, q), name
        assert ids(engine.generate(PROMPTS, GREEDY)) == ids(reference.generate(PROMPTS, GREEDY))
        assert ids(engine.generate(PROMPTS, SAMPLED)) == ids(reference.generate(PROMPTS, SAMPLED))

        # bad metas: the engine drains the transfer (the sender returns), loads nothing, names the problem
        before = [p.clone() for p in engine.model.parameters()]
        bogus = [("model.not_a_layer.weight", torch.ones(3)), *list(tiny_model(seed=7).named_parameters())]
        with pytest.raises(ConfigError, match="not_a_layer"):
            trainer.push(bogus)
        wrong_shape = [("model.norm.weight", torch.ones(VOCAB))]
        with pytest.raises(ConfigError, match=r"model.norm.weight \(96,\)"):
            trainer.push(wrong_shape)
        assert all(torch.equal(a, b) for a, b in zip(before, engine.model.parameters()))
        # ... and the group is still in step: a good update goes through afterwards
        newer = tiny_model(seed=43)
        trainer.push(list(newer.named_parameters()))
        assert ids(engine.generate(PROMPTS, GREEDY)) == ids(HFEngine(newer, device="cpu").generate(PROMPTS, GREEDY))
    finally:
        trainer.close()


def test_sleep_level_2_discards_weights_until_every_one_is_resent():
    engine = HFEngine(tiny_model(seed=0), device="cpu")
    engine.sleep(1)  # a level-1 cycle first: the rotary inv_freq buffer then shares a flat buffer with the weights
    engine.wake_up()
    new = tiny_model(seed=5)
    expected = ids(HFEngine(new, device="cpu").generate(PROMPTS, GREEDY))
    trainer = Trainer(engine)
    try:
        assert engine.sleep(2).bytes == 0  # nothing copied anywhere
        assert set(param_bytes(engine)) == {0}
        with pytest.raises(EngineStateError, match="asleep"):
            trainer.engine.update_weights([], bucket_bytes=BUCKET)
        engine.wake_up()
        named = list(new.named_parameters())
        trainer.push(named[:3])
        with pytest.raises(EngineStateError, match="have not been loaded"):
            engine.generate(PROMPTS, GREEDY)
        trainer.push(named[3:])
        assert ids(engine.generate(PROMPTS, GREEDY)) == expected  # buffers (rotary inv_freq) survived
    finally:
        trainer.close()


def test_weight_update_from_ipc_buckets_and_tied_embeddings():
    engine = HFEngine(tiny_model(seed=0, tie_word_embeddings=True), device="cpu")
    new = tiny_model(seed=9, tie_word_embeddings=True)
    assert engine.model.lm_head.weight is engine.model.model.embed_tokens.weight
    sender = IpcBucketSender(BUCKET, device="cpu")
    try:
        # the tied matrix arrives under its lm_head name only; it is bigger than a bucket (own buffer)
        named = [(n, p) for n, p in new.named_parameters() if n != "model.embed_tokens.weight"]
        named.append(("lm_head.weight", new.lm_head.weight))
        stats = sender.send(named, deliver=engine.update_weights_from_ipc, wait=lambda result: None)
        assert stats.bytes == sum(t.numel() * 4 for _, t in named)
    finally:
        sender.close()
    assert torch.equal(engine.model.model.embed_tokens.weight, new.model.embed_tokens.weight)
    assert ids(engine.generate(PROMPTS, GREEDY)) == ids(HFEngine(new, device="cpu").generate(PROMPTS, GREEDY))


def test_state_errors_are_clear():
    engine = HFEngine(tiny_model(), device="cpu")
    with pytest.raises(EngineStateError, match="init_weight_update_group"):
        engine.update_weights([TensorMeta("lm_head.weight", "float32", (VOCAB, 64))], bucket_bytes=BUCKET)
    with pytest.raises(ConfigError) as e:
        engine.init_weight_update_group("127.0.0.1", free_port(), 0, 2, backend="gloo", timeout_s=5)
    assert e.value.field == "rank_offset"
    engine.reset_prefix_cache()  # no prefix cache: a no-op that must not fail
    engine.shutdown()
    with pytest.raises(EngineStateError, match="shut down"):
        engine.generate(PROMPTS, GREEDY)
