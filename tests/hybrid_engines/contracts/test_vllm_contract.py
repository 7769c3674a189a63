"""Every vLLM name the adapter uses exists in the installed vLLM (written against 0.26.0).

Driven by the constants the adapter itself declares (``VLLM_LLM_KWARGS``, ``VLLM_LLM_METHODS``,
``VLLM_SAMPLING_FIELDS``, ``RPC_METHODS``...), so a name added to the adapter is checked here without editing this
file. vLLM installs on CPU but cannot start an engine: run with ``hatch run vllm-contract:test``.
"""

from __future__ import annotations

import dataclasses
import inspect
import typing

import pytest

vllm = pytest.importorskip("vllm", reason="vLLM is not installed here (optional env: hatch run vllm-contract:test)")

from hybrid_engines import vllm_engine, vllm_worker  # noqa: E402
from hybrid_engines.protocol import SamplingParams  # noqa: E402
from hybrid_engines.sampling_map import VLLM_SAMPLING_FIELDS, expand_rows, vllm_sampling_kwargs  # noqa: E402

pytestmark = pytest.mark.contract


def _params(fn) -> set[str]:
    return set(inspect.signature(fn).parameters)


def test_version_is_the_one_the_adapter_was_read_against():
    # Not a failure on another version (the checks below decide), but say which one was checked.
    print(f"checked against vllm {vllm.__version__}")
    assert vllm.__version__


def test_llm_takes_every_keyword_the_adapter_passes():
    from vllm.engine.arg_utils import EngineArgs

    accepted = _params(vllm.LLM.__init__) | {f.name for f in dataclasses.fields(EngineArgs)}  # **kwargs -> EngineArgs
    missing = [k for k in vllm_engine.VLLM_LLM_KWARGS if k not in accepted]
    assert not missing, f"vllm.LLM / EngineArgs do not accept {missing}"


def test_llm_methods_take_the_arguments_the_adapter_passes():
    for method, kwargs in vllm_engine.VLLM_LLM_METHODS.items():
        fn = getattr(vllm.LLM, method, None)
        assert callable(fn), f"vllm.LLM has no {method}()"
        assert set(kwargs) <= _params(fn), f"vllm.LLM.{method} lacks {set(kwargs) - _params(fn)}"


def test_raw_logprobs_mode_and_wake_tags_exist():
    from vllm.config.model import LogprobsMode

    assert "raw_logprobs" in typing.get_args(LogprobsMode)
    doc = inspect.getdoc(vllm.LLM.wake_up)
    for tag in vllm_engine.VLLM_WAKE_TAGS.values():
        assert f'"{tag}"' in doc, f"vllm.LLM.wake_up does not document the tag {tag!r}"


def test_sampling_params_has_every_field_and_accepts_every_mapped_request():
    fields = set(vllm.SamplingParams.__struct_fields__)
    assert set(VLLM_SAMPLING_FIELDS) <= fields, f"missing: {set(VLLM_SAMPLING_FIELDS) - fields}"
    for params in (
        SamplingParams(),
        SamplingParams(temperature=0.0, n=3),
        SamplingParams(top_k=1, temperature=0.5),
        SamplingParams(
            temperature=1.3, top_p=0.8, top_k=20, n=4, seed=7, min_new_tokens=2, stop_token_ids=(2, 5), logprobs=False
        ),
    ):
        for row in expand_rows([[1, 2, 3], [1, 2, 3]], params):
            for stop_at_eos in (True, False):
                sp = vllm.SamplingParams(**vllm_sampling_kwargs(params, seed=row.seed, stop_at_eos=stop_at_eos))
                assert sp.n == 1 and sp.max_tokens == params.max_new_tokens and sp.seed == row.seed


def test_token_prompts_and_outputs_have_the_fields_the_adapter_reads():
    from vllm.inputs import TokensPrompt
    from vllm.logprobs import Logprob
    from vllm.outputs import CompletionOutput, RequestOutput

    assert "prompt_token_ids" in TokensPrompt.__required_keys__
    assert "multi_modal_data" in TokensPrompt.__optional_keys__  # a prompt's images (hybrid_engines.multimodal)
    assert {"token_ids", "logprobs", "finish_reason"} <= {f.name for f in dataclasses.fields(CompletionOutput)}
    assert "outputs" in _params(RequestOutput.__init__)
    assert "logprob" in {f.name for f in dataclasses.fields(Logprob)}
    from vllm.v1.engine import FinishReason

    assert {str(FinishReason.STOP), str(FinishReason.LENGTH)} == {"stop", "length"}


def test_worker_extension_does_not_clash_with_vllms_worker_and_finds_what_it_uses():
    from vllm.v1.worker.gpu_worker import Worker
    from vllm.v1.worker.worker_base import WorkerBase

    ext = vllm_worker.HybridWorkerExtension
    # vLLM's own rule (worker_base.py, init_worker): no extension attribute may exist on the worker class.
    clashes = [a for a in dir(ext) if not a.startswith("__") and hasattr(Worker, a)]
    assert not clashes, f"names vLLM would refuse: {clashes}"
    assert set(vllm_worker.RPC_METHODS) <= {a for a in dir(ext) if callable(getattr(ext, a))}
    assert callable(Worker.get_model)
    init = inspect.getsource(WorkerBase.__init__)
    for attr in ("self.rank", "self.device", "self.model_config"):
        assert attr in init, f"vLLM's WorkerBase no longer sets {attr}"
    assert f"{ext.__module__}.{ext.__qualname__}" == vllm_engine.WORKER_EXTENSION


def test_layerwise_reload_functions_exist_with_the_arguments_used():
    from vllm.model_executor.model_loader import reload

    assert list(inspect.signature(reload.initialize_layerwise_reload).parameters) == ["model"]
    finalize = inspect.signature(reload.finalize_layerwise_processing).parameters
    assert list(finalize)[:2] == ["model", "model_config"]


def test_environment_variables_the_adapter_sets_are_vllms():
    import vllm.envs as envs

    for name in (*vllm_engine.ENV_DEFAULTS, "VLLM_RAY_BUNDLE_INDICES", "VLLM_RAY_PER_WORKER_GPUS"):
        assert name in envs.environment_variables, f"vLLM does not read {name}"


def test_behaviours_the_adapter_relies_on_are_in_the_source():
    from vllm.v1.worker.gpu_worker import Worker

    # Level-2 sleep: vLLM keeps and restores the model's buffers itself; only parameters need a re-sync.
    assert "_sleep_saved_buffers" in inspect.getsource(Worker.sleep)
    assert "_sleep_saved_buffers" in inspect.getsource(Worker.wake_up)
    # TP > 1 over Ray: the V2 executor is the default, sets NOSET for its workers and needs no GPU on the driver.
    import vllm.envs as envs
    from vllm.v1.executor import ray_executor_v2

    assert envs.VLLM_USE_RAY_V2_EXECUTOR_BACKEND is True
    source = inspect.getsource(ray_executor_v2)
    assert "ray_noset_device_env_vars" in source and "require_gpu_on_driver=False" in source
    assert "VLLM_RAY_BUNDLE_INDICES" in source and "VLLM_RAY_PER_WORKER_GPUS" in source


def test_partial_rollout_names_exist_as_the_adapter_calls_them():
    """The stepping loop of partial rollouts: LLMEngine.add_request / step / abort_request, delta outputs,
    SamplingParams.clone, the level-0 ``keep`` pause of LLM.sleep and the "scheduling" wake tag, and the async
    scheduling switch turned off in that mode."""
    from vllm.sampling_params import RequestOutputKind
    from vllm.v1.engine import PauseMode
    from vllm.v1.engine.llm_engine import LLMEngine

    for method, kwargs in vllm_engine.VLLM_ENGINE_METHODS.items():
        fn = getattr(LLMEngine, method, None)
        assert callable(fn), f"LLMEngine has no {method}()"
        assert set(kwargs) <= _params(fn), f"LLMEngine.{method} lacks {set(kwargs) - _params(fn)}"
    assert RequestOutputKind.DELTA and callable(vllm.SamplingParams.clone)
    sleep = vllm_engine.VLLM_KEEP_PAUSE["sleep"]
    assert set(sleep) <= _params(vllm.LLM.sleep) and sleep["mode"] in typing.get_args(PauseMode)
    assert "Level 0" in inspect.getdoc(vllm.LLM.sleep)
    assert '"scheduling"' in inspect.getdoc(vllm.LLM.wake_up)
    from vllm.v1.engine import core

    source = inspect.getsource(core.EngineCore.pause_scheduler)
    assert "PAUSED_ALL" in source and '"keep"' in source  # keep: requests stay queued, nothing is scheduled


def test_the_lora_path_loads_an_adapter_by_tensor_with_vllms_own_calls():
    """Adapter-only sync (LoRA): the engine arguments, the LoRARequest it sends, and every vLLM name the worker
    extension uses to make an adapter from tensors in memory -- PEFTHelper.from_dict, LoRAModel.from_lora_tensors
    (run here on the CPU with the wire names the trainer sends), the worker's LoRA manager and its model manager."""
    from vllm.config.lora import LoRAConfig, MaxLoRARanks
    from vllm.lora.lora_model import LoRAModel
    from vllm.lora.model_manager import LoRAModelManager
    from vllm.lora.peft_helper import PEFTHelper
    from vllm.lora.request import LoRARequest
    from vllm.lora.worker_manager import LRUCacheWorkerLoRAManager, WorkerLoRAManager

    from hybrid_engines.weight_sync.adapter import AdapterSpec

    assert tuple(sorted(typing.get_args(MaxLoRARanks))) == vllm_engine.VLLM_MAX_LORA_RANKS
    request = LoRARequest(**vllm_engine.HYBRID_LORA)
    assert set(vllm_engine.VLLM_LORA_REQUEST_FIELDS) <= set(LoRARequest.__struct_fields__)
    assert request.lora_int_id == vllm_engine.HYBRID_LORA_ID > 0
    spec = AdapterSpec(rank=16, alpha=32, target_modules="all-linear")
    helper = PEFTHelper.from_dict(spec.peft_config())
    helper.validate_legal(LoRAConfig(max_lora_rank=vllm_engine.vllm_max_lora_rank(spec.rank)))
    assert helper.r == 16 and abs(helper.vllm_lora_scaling_factor - spec.scaling) < 1e-9
    used = {"lora_model_id", "tensors", "peft_helper", "device", "dtype", "model_vocab_size", "weights_mapper"}
    assert used <= _params(LoRAModel.from_lora_tensors)
    import torch

    wire = "base_model.model.model.layers.0.self_attn.q_proj"
    lora = LoRAModel.from_lora_tensors(
        lora_model_id=1,
        tensors={f"{wire}.lora_A.weight": torch.zeros(16, 64), f"{wire}.lora_B.weight": torch.zeros(64, 16)},
        peft_helper=helper,
        device="cpu",
        dtype=torch.float32,
        model_vocab_size=100,
        weights_mapper=None,
    )
    assert set(lora.loras) == {"model.layers.0.self_attn.q_proj"} and lora.id == 1  # our names parse as vLLM's
    assert all(callable(getattr(LRUCacheWorkerLoRAManager, m, None)) for m in ("list_adapters", "remove_adapter"))
    assert all(callable(getattr(LoRAModelManager, m, None)) for m in ("add_adapter", "activate_adapter"))
    source = inspect.getsource(WorkerLoRAManager)
    for attr in ("self._adapter_manager", "self.vocab_size", "self.lora_config", "lora_dtype", "hf_to_vllm_mapper"):
        assert attr in source, f"vLLM's WorkerLoRAManager no longer has {attr}"
    from vllm.v1.worker import lora_model_runner_mixin

    assert "self.lora_manager = LRUCacheWorkerLoRAManager(" in inspect.getsource(lora_model_runner_mixin)


def test_the_adapter_by_tensor_takes_the_steps_of_vllms_own_add_adapter_and_packs_as_a_file_would():
    """The worker's ``_hybrid_set_adapter`` repeats ``LRUCacheWorkerLoRAManager.add_adapter`` with tensors in memory
    in place of ``_load_adapter``'s file. Checked here: the steps of ``_load_adapter`` it repeats are still vLLM's,
    the model manager's calls come in vLLM's order, and -- run on the CPU with Qwen2's mapper and packed modules --
    the LoRAModel it builds is packed by vLLM's own ``_create_merged_loras_inplace`` into the per-slice lists a
    merged layer's ``set_lora`` takes (the model's loading mapper instead fused q/k/v under one ``qkv_proj``
    tensor before packing: IndexError in ``MergedQKVParallelLinearWithLoRA.set_lora`` on the GPU)."""
    import types

    import torch
    from vllm.lora.lora_model import LoRAModel
    from vllm.lora.lora_weights import LoRALayerWeights, PackedLoRALayerWeights
    from vllm.lora.model_manager import LoRAModelManager, LRUCacheLoRAModelManager
    from vllm.lora.peft_helper import PEFTHelper
    from vllm.lora.worker_manager import LRUCacheWorkerLoRAManager, WorkerLoRAManager
    from vllm.model_executor.models.qwen2 import Qwen2ForCausalLM

    from hybrid_engines.weight_sync.adapter import AdapterSpec

    load = inspect.getsource(WorkerLoRAManager._load_adapter)
    for step in ("supported_lora_modules", "packed_modules_mapping", "PEFTHelper.from_local_dir", "validate_legal"):
        assert step in load, f"vLLM's _load_adapter no longer uses {step}"
    for step in ("get_unstacked_mapper()", "lora_skip_prefixes", "from_local_checkpoint"):
        assert step in load, f"vLLM's _load_adapter no longer uses {step}"
    assert '"vllm_max_position_embeddings"' in inspect.getsource(PEFTHelper.from_local_dir)
    assert "self.max_position_embeddings" in inspect.getsource(WorkerLoRAManager.__init__)
    assert "skip_prefixes" in _params(LoRAModel.from_lora_tensors)
    assert "return cls.from_lora_tensors(" in inspect.getsource(LoRAModel.from_local_checkpoint)
    assert "self._create_merged_loras_inplace(" in inspect.getsource(LoRAModelManager._add_adapter)
    assert "self._add_adapter(" in inspect.getsource(LRUCacheLoRAModelManager.add_adapter)

    def order(fn) -> list[str]:
        source = inspect.getsource(fn)
        calls = (".remove_adapter(", ".remove_oldest_adapter(", ".add_adapter(", ".activate_adapter(")
        return sorted((c for c in calls if c in source), key=source.index)

    steps = [".remove_adapter(", ".remove_oldest_adapter(", ".add_adapter(", ".activate_adapter("]
    assert order(LRUCacheWorkerLoRAManager.add_adapter) == steps
    assert order(vllm_worker.HybridWorkerExtension._hybrid_set_adapter) == steps
    for attr in ("capacity", "__len__", "remove_oldest_adapter", "supported_lora_modules", "packed_modules_mapping"):
        assert hasattr(LRUCacheLoRAModelManager, attr) or attr in inspect.getsource(LoRAModelManager.__init__), attr

    # Qwen2's names (the 7B of bench/lora_gpu.py, shrunk): every linear layer, PEFT's wire names
    r, hidden, kv, inter = 16, 64, 16, 96
    outs = {"q_proj": hidden, "k_proj": kv, "v_proj": kv, "o_proj": hidden}
    outs |= {"gate_proj": inter, "up_proj": inter, "down_proj": hidden}
    ins = {m: (inter if m == "down_proj" else hidden) for m in outs}
    where = {m: ("mlp" if m in ("gate_proj", "up_proj", "down_proj") else "self_attn") for m in outs}
    tensors = {}
    for m, out in outs.items():
        wire = f"base_model.model.model.layers.0.{where[m]}.{m}"
        tensors[f"{wire}.lora_A.weight"] = torch.randn(r, ins[m])
        tensors[f"{wire}.lora_B.weight"] = torch.randn(out, r)
    sent_k = tensors["base_model.model.model.layers.0.self_attn.k_proj.lora_B.weight"].clone()
    spec = AdapterSpec(rank=r, alpha=2 * r, target_modules="all-linear")
    helper = PEFTHelper.from_dict({**spec.peft_config(), "vllm_max_position_embeddings": 4096})
    mapper = Qwen2ForCausalLM.hf_to_vllm_mapper
    packed = dict(Qwen2ForCausalLM.packed_modules_mapping)
    supported = ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"]  # get_supported_lora_modules of Qwen2

    def build(weights_mapper):
        return LoRAModel.from_lora_tensors(
            lora_model_id=1, tensors=tensors, peft_helper=helper, device="cpu", dtype=torch.float32,
            model_vocab_size=100, weights_mapper=weights_mapper, skip_prefixes=None,
        )  # fmt: skip

    fused = build(mapper)  # the bug: q/k/v land on one qkv_proj entry, each overwriting the last
    assert "model.layers.0.self_attn.qkv_proj" in fused.loras and "model.layers.0.self_attn.q_proj" not in fused.loras
    assert vllm_worker._unexpected_lora_modules(fused.loras, supported, packed) == [
        "model.layers.0.mlp.gate_up_proj",
        "model.layers.0.self_attn.qkv_proj",
    ]
    lora = build(mapper.get_unstacked_mapper())
    assert set(lora.loras) == {f"model.layers.0.{where[m]}.{m}" for m in outs}
    assert vllm_worker._unexpected_lora_modules(lora.loras, supported, packed) == []

    # vLLM's own packing: the model manager's _register_packed_modules and _create_merged_loras_inplace, on an
    # object holding only what they read of a manager (one for a model with no LoRA layer wrapped: modules={})
    manager = types.SimpleNamespace(
        packed_modules={}, packed_modules_mapping=packed, is_pooling_model=False, modules={},
        _enable_moe_shared_loras=False, _is_non_gated_moe=False,
    )  # fmt: skip
    manager._get_lora_layer_weights = types.MethodType(LoRAModelManager._get_lora_layer_weights, manager)
    layer_modules = ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")
    for name in layer_modules:
        LoRAModelManager._register_packed_modules(manager, f"model.layers.0.{name}")
    LoRAModelManager._create_merged_loras_inplace(manager, lora)
    assert set(lora.loras) == {f"model.layers.0.{name}" for name in layer_modules}
    qkv, gate_up = lora.loras["model.layers.0.self_attn.qkv_proj"], lora.loras["model.layers.0.mlp.gate_up_proj"]
    assert isinstance(qkv, PackedLoRALayerWeights) and isinstance(gate_up, PackedLoRALayerWeights)
    assert [tuple(a.shape) for a in qkv.lora_a] == [(r, hidden)] * 3  # what set_lora indexes per slice
    assert [tuple(b.shape) for b in qkv.lora_b] == [(hidden, r), (kv, r), (kv, r)]
    assert [tuple(b.shape) for b in gate_up.lora_b] == [(inter, r)] * 2
    down = lora.loras["model.layers.0.mlp.down_proj"]
    assert type(down) is LoRALayerWeights and tuple(down.lora_a.shape) == (r, inter)
    # optimize() folds the scaling into B (in place: .to() of a tensor already on the device is that tensor)
    assert torch.allclose(qkv.lora_b[1], sent_k * spec.scaling)
