"""EAGLE / EAGLE-3 heads (public checkpoint formats) on tiny random Llama / Qwen2 targets: greedy output equals
speculation off (batch 1, 3, 16, preemption, prefix caching), the public tensor names load into the head, errors
name the parameter."""

from __future__ import annotations

import functools

import pytest
import torch

from hayabusa import LLM, SamplingParams
from hayabusa.errors import HayabusaValidationError
from tests.spec_decode.eagle_heads import write_eagle_head
from tests.spec_decode.test_spec_engine import PROMPTS as ALL_PROMPTS, _ids

PROMPTS = ALL_PROMPTS[:4]
PARAMS = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


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
    ("llama", "eagle", 1), ("qwen2", "eagle", 16), ("llama", "eagle3", 3)])
def test_eagle_keeps_greedy_output(heads, base, arch, method, max_num_seqs):
    target, head = heads[(arch, method)]
    llm = LLM(target, max_num_seqs=max_num_seqs, device="cpu", speculative_config=_spec(method, head))
    out = llm.generate(PROMPTS, PARAMS, use_tqdm=False)
    assert _ids(out) == base[arch]
    assert llm.llm_engine.runner.num_greedy_verify_steps > 0   # the greedy verify path
    m = llm.get_metrics()
    assert m["spec_decode_num_draft_tokens"] > 0
    assert sum(o.metrics.spec_num_draft_tokens for o in out) == m["spec_decode_num_draft_tokens"]


@pytest.mark.parametrize("method, feature", [("eagle", "preempt"), ("eagle3", "prefix_caching")])
def test_eagle_keeps_greedy_output_under(heads, base, method, feature):
    target, head = heads[("llama", method)]
    kwargs = {"preempt": dict(max_num_seqs=4, num_gpu_blocks_override=10, block_size=4, max_model_len=40),
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


@pytest.mark.parametrize("arch, method", [("llama", "eagle"), ("qwen2", "eagle3")])
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


def test_small_m_switch_reaches_the_heads_own_layers(heads, monkeypatch):
    """HAYABUSA_SMALL_M_LINEAR=1 puts the small-M kernel into the head's own Linears (EAGLE-3's fc, attention, MLP
    and draft lm_head), as into the target's ("cpu" stands in for CUDA; the kernel runs in Triton's interpreter),
    and greedy output with speculation is unchanged against the switch off in the same dtype."""
    from hayabusa.model import loader
    from hayabusa.model.layers.linear import Linear
    from hayabusa.quantization.base import SmallMLinearMethod

    target, head = heads[("llama", "eagle3")]
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(loader, "SMALL_M_DEVICE_TYPES", ("cpu",))
    outs = {}
    for switch in ("0", "1"):
        monkeypatch.setenv("HAYABUSA_SMALL_M_LINEAR", switch)
        llm = LLM(target, device="cpu", dtype="bfloat16", max_num_seqs=4, speculative_config=_spec("eagle3", head))
        linears = [m for m in llm.llm_engine.runner.draft.head.modules() if isinstance(m, Linear)]
        assert len(linears) >= 5
        assert all((type(m.quant_method) is SmallMLinearMethod) == (switch == "1") for m in linears)
        # the target's lm_head (a 99k vocabulary) back on F.linear: through the interpreter it alone takes minutes
        llm.llm_engine.runner.model.logits_linear = torch.nn.functional.linear
        # few tokens: every interpreted launch costs milliseconds here
        outs[switch] = _ids(llm.generate(PROMPTS[:1], SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True),
                                         use_tqdm=False))
        assert llm.get_metrics()["spec_decode_num_draft_tokens"] > 0
    assert outs["1"] == outs["0"]


def test_eagle3_proposals_are_target_ids(heads):
    """A reduced draft vocabulary maps back through d2t: every proposal is one of the 300 mapped target ids."""
    from safetensors.torch import load_file

    target, head = heads[("llama", "eagle3")]
    llm = LLM(target, device="cpu", max_num_seqs=4, speculative_config=_spec("eagle3", head))
    drafter = llm.llm_engine.runner.draft
    seen = []
    propose = drafter.propose
    drafter.propose = lambda *a, **k: seen.append(propose(*a, **k)) or seen[-1]
    llm.generate(PROMPTS[:2], PARAMS, use_tqdm=False)
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


@functools.lru_cache(maxsize=4)
def _reference_parts(target_dir: str, head_dir: str):
    """transformers' target, the head's public tensors (fp32), its config, the target's rotary embedding."""
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32)
    w = {n.replace("midlayer.", "layers.0."): t.float() if t.is_floating_point() else t
         for n, t in load_file(f"{head_dir}/model.safetensors").items()}
    return target, w, AutoConfig.from_pretrained(head_dir), LlamaRotaryEmbedding(AutoConfig.from_pretrained(target_dir))


def _reference_proposals(target_dir: str, head_dir: str, eagle3: bool, aux_ids, tokens: list[int], k: int
                         ) -> list[int]:
    """The head's k greedy proposals after ``tokens``, computed densely from the public tensors with transformers'
    target (its hidden states) and plain torch attention: the EAGLE process (head entry at p = (token p + 1,
    target state at p); then its own output and proposals)."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    target, w, cfg, rotary = _reference_parts(target_dir, head_dir)
    H, nh, nkv = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads
    D, eps = H // nh, cfg.rms_norm_eps
    ids = torch.tensor([tokens])
    with torch.no_grad():
        out = target.model(ids, output_hidden_states=True)
        if eagle3:
            feats = torch.cat([out.hidden_states[i][0] for i in aux_ids], dim=-1) @ w["fc.weight"].T
        else:
            feats = out.last_hidden_state[0]
        embed = w["embed_tokens.weight"] if eagle3 and "embed_tokens.weight" in w else \
            target.model.embed_tokens.weight

        def rms(x, name):
            return w[name] * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))

        def lin(x, name):
            b = w.get(name + ".bias")
            return x @ w[name + ".weight"].T + (0 if b is None else b)

        keys, values = [], []

        def step(token: int, pos: int, hidden: torch.Tensor) -> tuple[int, torch.Tensor]:
            e = embed[token]
            if eagle3:
                x_in = torch.cat([rms(e, "layers.0.input_layernorm.weight"), rms(hidden, "layers.0.hidden_norm.weight")])
                residual = hidden
            else:
                x_in = lin(torch.cat([e, hidden]), "fc")
                residual = x_in
            q = lin(x_in, "layers.0.self_attn.q_proj").view(1, nh, 1, D)
            kk = lin(x_in, "layers.0.self_attn.k_proj").view(1, nkv, 1, D)
            v = lin(x_in, "layers.0.self_attn.v_proj").view(nkv, D)
            cos, sin = rotary(q, torch.tensor([[pos]]))
            q, kk = apply_rotary_pos_emb(q, kk, cos, sin)
            keys.append(kk.view(nkv, D))
            values.append(v)
            K, V = torch.stack(keys, 1), torch.stack(values, 1)              # [nkv, S, D]
            K, V = K.repeat_interleave(nh // nkv, 0), V.repeat_interleave(nh // nkv, 0)
            att = torch.softmax((q.view(nh, 1, D) @ K.transpose(1, 2)) * D ** -0.5, dim=-1) @ V   # [nh, 1, D]
            x = att.reshape(-1) @ w["layers.0.self_attn.o_proj.weight"].T + residual
            m = rms(x, "layers.0.post_attention_layernorm.weight")
            g = m @ w["layers.0.mlp.gate_proj.weight"].T
            x = (torch.nn.functional.silu(g) * (m @ w["layers.0.mlp.up_proj.weight"].T)) @ \
                w["layers.0.mlp.down_proj.weight"].T + x
            if eagle3:
                d = int((rms(x, "norm.weight") @ w["lm_head.weight"].T).argmax())
                return d + int(w["d2t"][d]), x
            return int(target.lm_head(x).argmax()), x

        for p in range(len(tokens) - 1):
            proposal, hidden = step(tokens[p + 1], p, feats[p])
        props = [proposal]
        for j in range(1, k):
            proposal, hidden = step(props[-1], len(tokens) - 2 + j, hidden)
            props.append(proposal)
    return props


@pytest.mark.parametrize("arch, method, budget", [("llama", "eagle", 5), ("qwen2", "eagle3", None)])
def test_proposals_equal_a_dense_reference(heads, base, arch, method, budget):
    """The engine's proposals (paged head cache written after each step, batched one-token head steps) are the
    ones the EAGLE process gives on the full sequence, for several requests in one batch. The head's proposals
    are recorded, then replaced by the right continuation (all or all but the last) in two steps of three, so
    the head's cache and kept state are checked after accepted runs of every length. With a step budget of 5
    tokens prompts are computed in chunks (a last prompt token computed alone gets proposals at once)."""
    import json

    target, head = heads[(arch, method)]
    llm = LLM(target, device="cpu", max_num_seqs=3, speculative_config=_spec(method, head),
              **({"max_num_batched_tokens": budget} if budget else {}))
    runner = llm.llm_engine.runner
    drafter = runner.draft
    seen = []
    propose = drafter.propose
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)   # base: 12 tokens
    prompt_ids = [o.prompt_token_ids for o in LLM(target, device="cpu").generate(PROMPTS[:3], params,
                                                                                  use_tqdm=False)]
    full = [p + ids for p, ids in zip(prompt_ids, base[arch][:3])]

    def record(req_index, num_drafts, rows, query_start_loc, positions, slot_mapping, input_ids, *args):
        out = propose(req_index, num_drafts, rows, query_start_loc, positions, slot_mapping, input_ids, *args)
        b = runner.batch
        for i, (row, k) in enumerate(zip(rows.tolist(), num_drafts.tolist())):
            tokens = b.token_ids[row, :b.num_tokens[row]].tolist()
            seen.append((tokens, out[i, :k].tolist()))
            if len(seen) % 3:     # the right continuation instead (all but its last token in one case of two)
                seq = next(f for f in full if f[:len(tokens)] == tokens)
                right = seq[len(tokens):len(tokens) + k]
                if len(seen) % 3 == 1:
                    right[-1] = (right[-1] + 1) % 1000
                first = int(query_start_loc[req_index[i]])
                input_ids[first + 1:first + 1 + k] = torch.tensor(right)
                out[i, :k] = torch.tensor(right)
        return out

    drafter.propose = record
    out = llm.generate(PROMPTS[:3], params, use_tqdm=False)
    assert _ids(out) == [ids[:10] for ids in base[arch][:3]]
    assert llm.get_metrics()["spec_decode_num_accepted_tokens"] > 0
    aux = None
    if method == "eagle3":
        with open(f"{head}/config.json") as f:
            aux = json.load(f)["eagle_config"]["eagle_aux_hidden_state_layer_ids"]
    assert len(seen) >= 6
    for tokens, props in seen[:10]:
        assert props == _reference_proposals(target, head, method == "eagle3", aux, tokens, len(props))


def test_low_acceptance_rule_stops_a_random_head(heads, base):
    """A random head's proposals are (nearly) never accepted: after one window of 6 proposals a request gets none
    for the rest of its 12 tokens (back-off 100); output unchanged."""
    target, head = heads[("llama", "eagle")]
    spec = {**_spec("eagle", head), "min_acceptance_rate": 0.5, "acceptance_window": 6, "acceptance_backoff": 100}
    llm = LLM(target, device="cpu", max_num_seqs=4, speculative_config=spec)
    out = llm.generate(PROMPTS, PARAMS, use_tqdm=False)
    assert _ids(out) == base["llama"]
    low = [o for o in out if o.metrics.spec_num_accepted_tokens < 3]
    assert low and all(o.metrics.spec_num_draft_tokens == 6 for o in low)


@pytest.mark.parametrize("method", ["eagle", "eagle3"])
def test_a_checkpoint_that_is_no_head_is_refused_naming_speculative_config(method):
    """A plain model folder given as the head (a shape or tensor set that does not fit): HayabusaValidationError
    naming speculative_config and the folder, for both methods."""
    from hayabusa.assets import demo_model_dir
    from hayabusa.errors import HayabusaValidationError

    with pytest.raises(HayabusaValidationError) as e:
        LLM(demo_model_dir(), speculative_config={"method": method, "model": demo_model_dir(),
                                                  "num_speculative_tokens": 2})
    assert e.value.parameter == "speculative_config" and f"not a {method} head" in str(e.value)
