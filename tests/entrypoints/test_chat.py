"""LLM.chat renders like transformers' apply_chat_template, tokenizes like vLLM (no added special tokens), and
generates what generate() does on the rendered prompt; `hayabusa generate` takes {"messages": [...]} lines."""

from __future__ import annotations

import json

import pytest

from hayabusa import LLM, SamplingParams
from hayabusa.entrypoints.chat_utils import render_chat
from hayabusa.errors import HayabusaValidationError
from tests.conftest import TOKENIZERS

QWEN25_TEMPLATE = TOKENIZERS / "qwen3" / "qwen2.5-instruct-chat-template.jinja"
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
CONVERSATIONS = [
    [{"role": "user", "content": "日本の首都はどこですか？"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a prime number."},
     {"role": "assistant", "content": "7"}, {"role": "user", "content": "Another one?"}],
]



@pytest.fixture(scope="module")
def qwen_llm(tiny_qwen2):
    return LLM(tiny_qwen2, max_num_seqs=4)


@pytest.mark.parametrize("template", ["tokenizer's (Qwen3)", "Qwen2.5 file"])
def test_chat_renders_like_hf_and_generates_like_generate(qwen_llm, template):
    tok = qwen_llm.get_tokenizer()
    chat_template = str(QWEN25_TEMPLATE) if template == "Qwen2.5 file" else None
    hf_template = QWEN25_TEMPLATE.read_text() if chat_template else None
    rendered = [tok.apply_chat_template(c, chat_template=hf_template, tokenize=False, add_generation_prompt=True)
                for c in CONVERSATIONS]
    outs = qwen_llm.chat(CONVERSATIONS, GREEDY, use_tqdm=False, chat_template=chat_template)
    ref = qwen_llm.generate(rendered, GREEDY, use_tqdm=False)
    for text, out, r in zip(rendered, outs, ref):
        assert out.prompt == text
        assert out.prompt_token_ids == tok.encode(text, add_special_tokens=False) == r.prompt_token_ids
        assert out.outputs[0].token_ids == r.outputs[0].token_ids
        assert out.outputs[0].text == r.outputs[0].text
    one = qwen_llm.chat(CONVERSATIONS[0], GREEDY, use_tqdm=False, chat_template=chat_template)  # one conversation
    assert len(one) == 1 and one[0].outputs[0].token_ids == outs[0].outputs[0].token_ids


def test_chat_template_kwargs_and_continue_final_message(qwen_llm):
    tok = qwen_llm.get_tokenizer()
    msgs = CONVERSATIONS[0]
    no_think = render_chat(tok, msgs, chat_template_kwargs={"enable_thinking": False})
    assert no_think == tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True,
                                               enable_thinking=False)
    assert no_think.endswith("<think>\n\n</think>\n\n")
    partial = msgs + [{"role": "assistant", "content": "東京"}]
    cont = qwen_llm.chat(partial, GREEDY, use_tqdm=False, add_generation_prompt=False,
                         continue_final_message=True, chat_template=str(QWEN25_TEMPLATE))[0]
    assert cont.prompt.endswith("<|im_start|>assistant\n東京")
    with pytest.raises(HayabusaValidationError, match="add_generation_prompt=False"):
        qwen_llm.chat(partial, GREEDY, continue_final_message=True)
    parts = [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]
    assert render_chat(tok, parts) == render_chat(tok, [{"role": "user", "content": "a\nb"}])


def test_chat_without_template_errors_clearly(tiny_llama):
    llm = LLM(tiny_llama, max_num_seqs=2)  # llm-jp-v3.1 tokenizer: no chat template
    with pytest.raises(HayabusaValidationError, match="no chat template") as e:
        llm.chat([{"role": "user", "content": "hi"}])
    assert e.value.parameter == "chat_template"
    # with one given, BOS comes from the template only (tokenizer adds none: vLLM's add_special_tokens=False)
    tok = llm.get_tokenizer()
    template = "{{ bos_token }}{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    out = llm.chat([{"role": "user", "content": "こんにちは"}], SamplingParams(max_tokens=1), use_tqdm=False,
                   chat_template=template)[0]
    assert out.prompt_token_ids[0] == tok.bos_token_id and out.prompt_token_ids[1] != tok.bos_token_id
    with pytest.raises(HayabusaValidationError, match="looks like a file path"):
        llm.chat([{"role": "user", "content": "hi"}], chat_template="no/such/template.jinja")


def test_cli_generate_accepts_messages(tiny_qwen2, qwen_llm, tmp_path, capsys):
    from hayabusa.entrypoints.cli import main

    prompts = tmp_path / "in.jsonl"
    rows = [{"messages": CONVERSATIONS[1], "id": "chat"}, {"prompt": "Once upon a time", "max_tokens": 5}]
    prompts.write_text("\n".join(json.dumps(r, ensure_ascii=False) for r in rows) + "\n", encoding="utf-8")
    out = tmp_path / "out.jsonl"
    rc = main(["generate", "--model", tiny_qwen2, "--prompts", str(prompts), "--output", str(out), "--no-tqdm",
               "--temperature", "0", "--max-tokens", "12", "--ignore-eos", "--max-num-seqs", "4"])
    assert rc == 0
    got = [json.loads(line) for line in out.read_text(encoding="utf-8").splitlines()]
    ref = qwen_llm.chat(CONVERSATIONS[1], GREEDY, use_tqdm=False)[0]
    assert got[0]["id"] == "chat" and got[0]["prompt"] == ref.prompt
    assert got[0]["outputs"][0]["token_ids"] == ref.outputs[0].token_ids
    assert len(got[1]["outputs"][0]["token_ids"]) == 5
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"messages": "hi"}) + "\n")
    assert main(["generate", "--model", tiny_qwen2, "--prompts", str(bad), "--no-tqdm"]) == 2
    assert "messages" in capsys.readouterr().err
