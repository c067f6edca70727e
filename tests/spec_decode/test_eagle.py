"""EAGLE / EAGLE-3 heads (public checkpoint formats) on tiny random Llama / Qwen2 targets: greedy output equals
speculation off (batch 1, 3, 16, preemption, prefix caching), the public tensor names load into the head, errors
name the parameter."""

from __future__ import annotations

import pytest
import torch

from hayabusa import LLM, SamplingParams
from hayabusa.errors import HayabusaValidationError
from tests.spec_decode.eagle_heads import write_eagle_head
from tests.spec_decode.test_spec_engine import MAX_TOKENS, PROMPTS, _ids

PARAMS = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)


@pytest.fixture(scope="module")
def heads(tiny_llama, tiny_qwen2, tmp_path_factory):
    """(target, head dir, method) by name; the 2-layer targets' EAGLE-3 heads list their aux layer ids (the default
    (2, L // 2, L - 3) needs L >= 4)."""
    root = tmp_path_factory.mktemp("eagle_heads")
    out = {}
    for arch, target in (("llama", tiny_llama), ("qwen2", tiny_qwen2)):
        write_eagle_head(target, str(root / f"{arch}_eagle"), eagle3=False, seed=1)
        out[(arch, "eagle")] = (target, str(root / f"{arch}_eagle"))
        write_eagle_head(target, str(root / f"{arch}_eagle3"), eagle3=True, seed=2, aux_ids=[1, 0, 1],
                         draft_vocab_size=300, own_embed=arch == "qwen2")
        out[(arch, "eagle3")] = (target, str(root / f"{arch}_eagle3"))
    return out


@pytest.fixture(scope="module")
def base(tiny_llama, tiny_qwen2):
    return {arch: _ids(LLM(path, max_num_seqs=16, device="cpu").generate(PROMPTS, PARAMS, use_tqdm=False))
            for arch, path in (("llama", tiny_llama), ("qwen2", tiny_qwen2))}


def _spec(method: str, head: str, k: int = 3) -> dict:
    return {"method": method, "model": head, "num_speculative_tokens": k, "min_acceptance_rate": 0}


@pytest.mark.parametrize("arch, method, max_num_seqs", [
    ("llama", "eagle", 1), ("llama", "eagle", 16), ("qwen2", "eagle", 3),
    ("llama", "eagle3", 3), ("qwen2", "eagle3", 1), ("qwen2", "eagle3", 16)])
def test_eagle_keeps_greedy_output(heads, base, arch, method, max_num_seqs):
    target, head = heads[(arch, method)]
    llm = LLM(target, max_num_seqs=max_num_seqs, device="cpu", speculative_config=_spec(method, head))
    out = llm.generate(PROMPTS, PARAMS, use_tqdm=False)
    assert _ids(out) == base[arch]
    m = llm.get_metrics()
    assert m["spec_decode_num_draft_tokens"] > 0
    assert sum(o.metrics.spec_num_draft_tokens for o in out) == m["spec_decode_num_draft_tokens"]


@pytest.mark.parametrize("method, feature", [("eagle", "preempt"), ("eagle3", "preempt"),
                                             ("eagle", "prefix_caching"), ("eagle3", "prefix_caching")])
def test_eagle_keeps_greedy_output_under(heads, base, method, feature):
    target, head = heads[("llama", method)]
    kwargs = {"preempt": dict(max_num_seqs=8, num_gpu_blocks_override=20, block_size=4, max_model_len=64),
              "prefix_caching": dict(max_num_seqs=4, enable_prefix_caching=True, block_size=4)}[feature]
    llm = LLM(target, device="cpu", speculative_config=_spec(method, head), **kwargs)
    assert _ids(llm.generate(PROMPTS, PARAMS, use_tqdm=False)) == base["llama"]
    if feature == "preempt":
        assert llm.llm_engine.scheduler.num_preemptions > 0
    else:
        hits = llm.llm_engine.kv_cache_manager.num_hit_tokens
        assert _ids(llm.generate(PROMPTS, PARAMS, use_tqdm=False)) == base["llama"]
        assert llm.llm_engine.kv_cache_manager.num_hit_tokens > hits
    assert llm.get_metrics()["spec_decode_num_draft_tokens"] > 0


@pytest.mark.parametrize("arch, method", [("llama", "eagle"), ("qwen2", "eagle"), ("llama", "eagle3"),
                                          ("qwen2", "eagle3")])
def test_public_tensor_names_load(heads, arch, method):
    """Every public tensor lands in the head's parameter of that name (q/k/v and gate/up merged), bar the ones the
    format says to ignore."""
    from safetensors.torch import load_file

    target, head = heads[(arch, method)]
    llm = LLM(target, device="cpu", speculative_config=_spec(method, head))
    model = llm.llm_engine.runner.draft.head
    params = dict(model.named_parameters())
    w = load_file(f"{head}/model.safetensors")
    layer = model.layers[0]
    a = layer.self_attn
    for name, tensor in w.items():
        ours = model.rename_checkpoint_key(name)
        if method == "eagle" and ours == "embed_tokens.weight" or ours == "t2d":
            assert ours not in params     # EAGLE-1's embedding copy is not used (the target's is); t2d unused
            continue
        if ".q_proj." in ours or ".k_proj." in ours or ".v_proj." in ours:
            shard = ours.split(".")[-2][0]
            lo, hi = a.qkv_proj.shard_range(shard)
            got = getattr(a.qkv_proj, ours.rsplit(".", 1)[1])[lo:hi]
        elif ".gate_proj." in ours or ".up_proj." in ours:
            lo, hi = layer.mlp.gate_up_proj.shard_range("gate" if "gate" in ours else "up")
            got = layer.mlp.gate_up_proj.weight[lo:hi]
        else:
            got = params[ours]
        assert torch.equal(got.to(tensor.dtype), tensor), name
    if method == "eagle":
        assert "fc.bias" in params and not hasattr(model, "lm_head")
        assert model.embed(torch.tensor([5])).equal(llm.llm_engine.runner.model.model.embed_tokens.weight[5:6])
    else:
        assert model.d2t.shape == (300,) and "layers.0.hidden_norm.weight" in params
        assert hasattr(model, "embed_tokens") == (arch == "qwen2")   # own embedding only where the head has one
        assert a.qkv_proj.in_features == 2 * model.hidden_size


def test_eagle3_proposals_are_target_ids(heads):
    """A reduced draft vocabulary maps back through d2t: every proposal is one of the 300 mapped target ids."""
    from safetensors.torch import load_file

    target, head = heads[("llama", "eagle3")]
    llm = LLM(target, device="cpu", max_num_seqs=4, speculative_config=_spec("eagle3", head))
    drafter = llm.llm_engine.runner.draft
    seen = []
    propose = drafter.propose
    drafter.propose = lambda *a, **k: seen.append(propose(*a, **k)) or seen[-1]
    llm.generate(PROMPTS[:3], PARAMS, use_tqdm=False)
    allowed = set((load_file(f"{head}/model.safetensors")["t2d"].nonzero().flatten()).tolist())
    proposed = set(torch.cat([s.flatten() for s in seen]).tolist())
    assert seen and proposed <= allowed


def test_eagle_config_errors(heads, tiny_llama, tiny_qwen2, tmp_path):
    _, head = heads[("llama", "eagle")]
    with pytest.raises(HayabusaValidationError) as e:       # no head
        LLM(tiny_llama, device="cpu", speculative_config={"method": "eagle", "num_speculative_tokens": 2})
    assert e.value.parameter == "speculative_config.model"
    with pytest.raises(HayabusaValidationError) as e:       # a head of another vocabulary
        LLM(tiny_qwen2, device="cpu", speculative_config=_spec("eagle", head))
    assert e.value.parameter == "speculative_config.model" and "vocabulary" in str(e.value)
    write_eagle_head(tiny_llama, str(tmp_path / "e3"), eagle3=True)   # no aux ids: the default needs 4+ layers
    with pytest.raises(HayabusaValidationError) as e:
        LLM(tiny_llama, device="cpu", speculative_config=_spec("eagle3", str(tmp_path / "e3")))
    assert e.value.parameter == "speculative_config.model" and "(2, L // 2, L - 3)" in str(e.value)
    with pytest.raises(HayabusaValidationError) as e:
        LLM(tiny_llama, device="cpu", speculative_config={"method": "eagle4", "model": head,
                                                          "num_speculative_tokens": 2})
    assert e.value.parameter == "speculative_config.method" and "eagle4" in str(e.value)
