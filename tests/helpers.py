"""Test helpers: the HF Transformers reference."""

from __future__ import annotations

import torch


def hf_greedy(model_dir: str, prompt_ids: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """Greedy continuations from HF Transformers (float32, CPU, batch 1, EOS ignored)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    outs = []
    with torch.no_grad():
        for ids in prompt_ids:
            x = torch.tensor([ids])
            y = model.generate(x, attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=max_new_tokens,
                               min_new_tokens=max_new_tokens, pad_token_id=0)
            outs.append(y[0, len(ids):].tolist())
    return outs


def hf_top_logprobs(model_dir: str, ids: list[int], k: int = 5) -> list[int]:
    """Top-k token ids of HF's next-token distribution after `ids`."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0, -1]
    return logits.topk(k).indices.tolist()
