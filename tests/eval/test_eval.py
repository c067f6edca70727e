"""hayabusa eval: scoring on hand-made answers, majority vote, multiple choice, the sweep table (flags, agreement,
error rows) and, on tiny checkpoints on CPU, a max_num_seqs sweep with identical accuracy and logit fidelity of
hayabusa fp32 against HF fp32."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hayabusa.errors import HayabusaValidationError
from hayabusa.eval import scoring, tasks
from hayabusa.eval.data import EvalItem, load_items
from hayabusa.eval.runner import RunOutput
from hayabusa.eval.sweep import _score_runs, parse_sweeps, parse_value

REPO = Path(__file__).resolve().parents[2]
DATA = REPO / "examples" / "extraction" / "receipts_personnel.jsonl"
GOLD = {"store": "こむぎ堂", "total": 1200}



# ------------------------------------------------------------------------------------------------ extraction
@pytest.mark.parametrize("answer,correct,parsable,note", [
    ('{"store": "こむぎ堂", "total": 1200}', 2, True, "exact"),
    ('{"store": "こむぎ堂"}', 1, True, "missing"),
    ('{"store": "こむぎ堂", "total": 1200, "tax": 88}', 2, True, "extra"),
    ('{"store": "こむぎ堂", "total": "1200"}', 1, True, "wrong_type"),
    ('{"store": "こむぎ堂", "total": 1200.0}', 2, True, "number"),
    ('Here it is:\n```json\n{"store": "こむぎ堂", "total": 1200}\n```\nAnything else?', 2, True, "fenced"),
    ('Sure! The data is {"store": "こむぎ堂", "total": 1200} as requested.', 2, True, "prose"),
    ('{"store": "こむぎ堂", "total": 1200', 0, False, "truncated"),
    ("I could not read the receipt.", 0, False, "not_json"),
])
def test_score_extraction_hand_made(answer, correct, parsable, note):
    s = scoring.score_extraction(answer, GOLD)
    assert (s.correct, s.total, s.parsable) == (correct, 2, parsable)
    assert s.accuracy == correct / 2
    if note == "missing":
        assert s.missing == ["total"] and s.fields == {"store": True, "total": False}
    if note == "extra":
        assert s.extra == ["tax"]                      # counted, not penalised
    if note == "wrong_type":
        assert s.wrong_type == ["total"] and s.missing == []


def test_score_extraction_types_nulls_and_lists():
    assert not scoring.score_extraction('{"ok": 1}', {"ok": True}).fields["ok"]          # 1 is not true
    assert scoring.score_extraction('{"p": null}', {"p": None}).fields["p"]
    assert not scoring.score_extraction('{"p": "cash"}', {"p": None}).fields["p"]
    assert not scoring.score_extraction("{}", {"p": None}).fields["p"]                   # missing != null
    gold = {"people": [{"name": "高橋"}, {"name": "中村"}]}
    s = scoring.score_extraction('{"people": [{"name": "高橋"}]}', gold)
    assert s.fields == {"people[0].name": True, "people[1].name": False}
    assert scoring.field_key("people[1].name") == "people[].name"
    # a fence without a JSON object falls back to the prose; the first object wins
    assert scoring.parse_json_answer('```\nno\n```\n{"a": 1} {"a": 2}') == {"a": 1}


def test_summarize_extraction_counts_fields_and_unparsable():
    items = [EvalItem("1", "p", None, GOLD), EvalItem("2", "p", None, GOLD), EvalItem("3", "p", None, GOLD)]
    texts = [['{"store": "こむぎ堂", "total": 1200}'], ['{"store": "x", "total": 1200}'], ["no json"]]
    res = tasks.score_run("extraction", items, texts, {})
    s = tasks.summarize("extraction", res)
    assert s["accuracy"] == 3 / 6 and s["unparsable"] == 1 and s["items_all_correct"] == 1
    assert s["per_field"] == {"store": round(1 / 3, 4), "total": round(2 / 3, 4)}
    err = tasks.score_run("extraction", items[:1], [None], {0: "prompt too long"})
    assert err[0]["error"] == "prompt too long" and tasks.summarize("extraction", err)["num_errors"] == 1


# ------------------------------------------------------------------------------------------------ majority, choice
def test_final_answer_extraction_and_majority_vote():
    assert scoring.extract_final_answer("3 + 4 = 7\n#### 7") == "7"
    assert scoring.extract_final_answer(r"so \boxed{\frac{1}{2}} is it") == r"\frac{1}{2}"
    assert scoring.extract_final_answer("The answer is 1,250.") == "1250"
    assert scoring.extract_final_answer("答えは 42 個です") == "42"
    assert scoring.extract_final_answer("x = 3, then y = 12.50") == "12.5"
    assert scoring.extract_final_answer("no numbers") is None
    assert scoring.normalize_answer("$3.0") == "3" and scoring.normalize_answer("１２") == "12"
    assert scoring.majority_vote(["3", "4", "3", None]) == "3"
    assert scoring.majority_vote(["4", "3", "3", "4"]) == "4"        # tie: the first seen
    assert scoring.majority_vote([None, None]) is None
    item = EvalItem("m", "p", None, "7")
    r = tasks.score_item("majority", item, ["#### 7", "#### 8", "the answer is 7", "no idea"])
    assert r["answer"] == "7" and r["correct"] == 1.0 and r["sample_answers"] == ["7", "8", "7", None]


def test_choice_parsing_and_accuracy():
    ch = ["Tokyo", "Osaka", "Kyoto", "Nagoya"]
    assert scoring.parse_choice("Answer: C", ch) == "C"
    assert scoring.parse_choice("(B) Osaka", ch) == "B"
    assert scoring.parse_choice("I think it is Kyoto.", ch) == "C"           # the choice's text
    assert scoring.parse_choice("正解は D です", ch) == "D"
    assert scoring.parse_choice("none of them", ch) is None
    assert scoring.choice_letter(1, ch) == "B" and scoring.choice_letter("osaka".title(), ch) == "B"
    assert scoring.choice_letter("(c)") == "C"
    items = [EvalItem(str(i), "q", None, g, ch) for i, g in enumerate("ABCD")]
    res = tasks.score_run("choice", items, [["A"], ["Answer: B"], ["D"], ["?"]], {})
    s = tasks.summarize("choice", res)
    assert s["accuracy"] == 0.5 and s["unparsable"] == 1


def test_load_items_checks_lines(tmp_path):
    items = load_items(str(DATA), "extraction")
    assert len(items) == 12 and all(isinstance(it.gold, dict) and it.messages for it in items)
    langs = {it.id.split("-")[1] for it in items}
    assert langs == {"ja", "en"}
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "x", "answer": "B", "choices": ["a", "b"]}\n{"prompt": "y"}\n')
    with pytest.raises(ValueError, match="bad.jsonl:2: no gold answer"):
        load_items(str(bad), "choice")


# ------------------------------------------------------------------------------------------------ sweep table
def test_parse_sweeps_is_a_grid():
    assert parse_sweeps(None) == [{}]
    grid = parse_sweeps(["max_num_seqs=1,16", "quantization=none,fp8"])
    assert grid == [{"max_num_seqs": 1, "quantization": None}, {"max_num_seqs": 1, "quantization": "fp8"},
                    {"max_num_seqs": 16, "quantization": None}, {"max_num_seqs": 16, "quantization": "fp8"}]
    assert parse_value("off") is False and parse_value("0.7") == 0.7 and parse_value("bfloat16") == "bfloat16"
    with pytest.raises(ValueError, match="neither an engine argument nor a sampling parameter"):
        parse_sweeps(["max_num_seq=1"])
    # a switch takes the environment variables' spellings (as HAYABUSA_BATCH_INVARIANT=1 does), none = default
    assert parse_sweeps(["batch_invariant=1,Off,none", "ignore_eos=0"]) == [
        {"batch_invariant": True, "ignore_eos": False}, {"batch_invariant": False, "ignore_eos": False},
        {"batch_invariant": None, "ignore_eos": False}]
    # anything else is refused before any run, naming the flag and listing the spellings (bench --sweep does too)
    for bad in ("batch_invariant=true,nope", "batch_invariant=2", "enforce_eager=maybe", "detokenize=none"):
        with pytest.raises(ValueError, match=r"--sweep \w+='(nope|2|maybe|none)': use 1 / true / yes / on"):
            parse_sweeps([bad])
    with pytest.raises(ValueError, match=r"or none \(the default\)\.$"):   # listed where it is accepted
        parse_sweeps(["batch_invariant=nope"])
    assert parse_sweeps(["max_num_seqs=1"]) == [{"max_num_seqs": 1}]          # an int argument keeps its 1


def test_score_runs_flags_drops_and_keeps_error_rows():
    items = [EvalItem(str(i), "p", None, {"a": i}) for i in range(4)]
    good = [[json.dumps({"a": i})] for i in range(4)]
    ref = RunOutput("hf (reference)", "hf", {}, texts=good, elapsed_s=4.0, output_tokens=40)
    same = RunOutput("max_num_seqs=14", "hayabusa", {}, texts=good, elapsed_s=1.0, output_tokens=40)
    broken = RunOutput("max_num_seqs=16", "hayabusa", {}, texts=[["!!!!"]] * 4, elapsed_s=0.5, output_tokens=40)
    failed = RunOutput("quantization=awq", "hayabusa", {}, texts=[None] * 4, error="HayabusaValidationError: no")
    res = _score_runs("extraction", items, [ref, same, broken, failed], tolerance=0.02)
    acc = {r["setting"]: r.get("accuracy") for r in res.rows}
    assert acc == {"hf (reference)": 1.0, "max_num_seqs=14": 1.0, "max_num_seqs=16": 0.0, "quantization=awq": None}
    assert [r["flag"] for r in res.rows] == ["", "", "DROP >0.02", "ERROR"]
    assert res.rows[1]["agreement"] == 1.0 and res.rows[2]["agreement"] == 0.0
    # two runs with no parsable answer have no agreement to report (None, "-" in the table), not 1.0
    res2 = _score_runs("extraction", items, [broken, broken], tolerance=0.02)
    assert res2.rows[1]["agreement"] is None and res2.rows[1]["text_agreement"] == 1.0
    # nor has a run whose JSON holds none of the gold fields against an unparsable one; one gold field present
    # on one side is an answer to compare (0 of 1 field agrees)
    empty = RunOutput("max_num_seqs=2", "hayabusa", {}, texts=[['{"b": 1}']] * 4, elapsed_s=0.5, output_tokens=40)
    assert _score_runs("extraction", items, [broken, empty], tolerance=0.02).rows[1]["agreement"] is None
    assert _score_runs("extraction", items, [empty, same], tolerance=0.02).rows[1]["agreement"] == 0.0
    assert res.rows[1]["seconds_per_item"] == 0.25 and res.rows[1]["output_throughput"] == 40.0
    assert len(res.records) == 12                          # 3 runs that produced output x 4 items
    # items refused before running (a prompt over max_model_len) took no time: s/item is over the items that ran
    half = RunOutput("max_model_len=64", "hayabusa", {}, texts=good[:1] + [None] * 3, elapsed_s=1.0,
                     output_tokens=10, item_errors={1: "too long", 2: "too long", 3: "too long"})
    assert _score_runs("extraction", items, [ref, half], tolerance=0.02).rows[1]["seconds_per_item"] == 1.0
    from hayabusa.eval.report import format_table

    table = format_table(res.rows)
    assert "error: HayabusaValidationError: no" in table and "DROP" in table
    header, rule, *body = table.splitlines()
    # the flag column starts where its header does (left-aligned), rows carry no trailing blanks
    drop = next(line for line in body if "DROP" in line)
    assert drop.index("DROP") == header.index("flag") and all(line == line.rstrip() for line in body)
    # a long error keeps every word (what to do next ends it), wrapped under the number columns, never mid-word
    advice = ("HayabusaValidationError: quantization='awq' needs an AWQ checkpoint (config.json's quantization_config "
              "with quant_method 'awq'); this folder has none: pass quantization=None or an AWQ model folder")
    long_failed = RunOutput("quantization=awq", "hayabusa", {}, texts=[None] * 4, error=advice)
    table = format_table(_score_runs("extraction", items, [ref, long_failed], tolerance=0.02).rows)
    header, _, *body = table.splitlines()
    error_lines = body[body.index(next(line for line in body if "error: " in line)):]
    col = header.index("s/item")
    assert " ".join(line[col:].strip() for line in error_lines).startswith("error: " + advice)
    assert len(error_lines) > 1 and all(line[:col].strip() == "" for line in error_lines[1:])
    assert all(len(line) <= col + 100 for line in error_lines)


def test_plot_and_wandb_say_what_is_missing(monkeypatch, tmp_path):
    import sys

    from hayabusa.eval.report import log_wandb, plot_accuracy_vs_latency

    monkeypatch.setitem(sys.modules, "matplotlib", None)     # import fails as if not installed
    monkeypatch.setitem(sys.modules, "wandb", None)
    assert "pip install matplotlib" in plot_accuracy_vs_latency([], str(tmp_path / "p.png"), "t")
    assert "pip install wandb" in log_wandb([], {})


# ------------------------------------------------------------------------------------------------ engine runs
def test_sweep_max_num_seqs_same_accuracy_and_error_row(tiny_qwen2, tmp_path, capsys):
    from hayabusa.entrypoints.cli import main

    out, summary = tmp_path / "results.jsonl", tmp_path / "summary.json"
    rc = main(["eval", "--model", tiny_qwen2, "--data", str(DATA), "--task", "extraction", "--device", "cpu",
               "--max-tokens", "12", "--sweep", "max_num_seqs=1,5", "--sweep", "quantization=none,no-such-method",
               "--output", str(out), "--json", str(summary), "--no-tqdm", "--plot", str(tmp_path / "p.png")])
    assert rc == 1                                        # the no-such-method rows are errors (unknown name)
    rows = json.loads(summary.read_text())["rows"]
    by = {r["setting"]: r for r in rows}
    a, b = by["max_num_seqs=1,quantization=None"], by["max_num_seqs=5,quantization=None"]
    assert a["accuracy"] == b["accuracy"] and a["unparsable"] == b["unparsable"] and a["num_errors"] == 0
    assert b["text_agreement"] == 1.0                                 # greedy: same outputs at any batch size
    # random weights: no answer parses on either side, so there is no answer agreement to report (not 1.000)
    assert a["unparsable"] < 12 or b["agreement"] is None
    assert "quantization" in by["max_num_seqs=1,quantization=no-such-method"]["error"]
    assert by["max_num_seqs=1,quantization=no-such-method"]["flag"] == "ERROR"
    recs = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(recs) == 2 * 12 and {r["id"] for r in recs} == {it.id for it in load_items(str(DATA), "extraction")}
    assert "error: HayabusaValidationError" in capsys.readouterr().out


def test_hf_reference_agrees_with_hayabusa_fp32(stories_dir, tmp_path):
    from hayabusa.eval.data import load_tokenizer, render_items
    from hayabusa.eval.sweep import evaluate

    data = tmp_path / "stories.jsonl"
    data.write_text("".join(json.dumps({"prompt": p, "gold": {"name": "Lily"}}) + "\n" for p in
                            ["Once upon a time", "Tom had a red ball.", "The sun was hot and"]))
    items = load_items(str(data), "extraction")
    tok = load_tokenizer(stories_dir)
    render_items(items, tok)
    res = evaluate(stories_dir, items, "extraction", {"device": "cpu", "dtype": "float32"},
                   {"temperature": 0.0, "max_tokens": 24}, ["max_num_seqs=2"], reference="hf", tokenizer=tok)
    hf, hy = res.rows
    assert hf["engine"] == "hf" and res.reference == "hf (reference)"
    assert hy["text_agreement"] == 1.0 and hy["flag"] == ""


def test_fidelity_fp32_matches_hf_fp32(stories_dir, capfd):
    """Also: a text longer than the tokenizer's model_max_length (512) brings no "sequence length is longer"
    warning: the text is scored in chunks of chunk_len."""
    from hayabusa.eval.fidelity import run_fidelity

    text = ("Once upon a time, there was a little girl named Lily. She liked to play in the park with her dog. "
            "One day the dog found a big red ball under a tree. Lily and the dog played until the sun went down. ") * 12
    res = run_fidelity(stories_dir, text, {"device": "cpu", "dtype": "float32", "max_num_seqs": 4,
                                           "max_num_batched_tokens": 48},          # chunks run in 48-token pieces
                       reference="hf", reference_dtype="float32", chunk_len=100, max_text_tokens=250)
    assert res.num_tokens == 250 and res.num_chunks == 3
    assert res.mean_kl < 1e-6 and res.max_kl < 1e-5
    assert res.top1_agreement == 1.0
    assert abs(res.ppl - res.ppl_reference) < 1e-3 * res.ppl_reference and res.ppl < 50
    assert "longer than the specified maximum sequence length" not in "".join(capfd.readouterr())


def test_fidelity_on_a_checkpoint_hf_cannot_load_says_use_reference_model(tmp_path, monkeypatch):
    """HF needs extra packages for AWQ / GPTQ / FP8 folders: the fidelity command names --reference-model instead
    of ending in an ImportError traceback."""
    from hayabusa.bench import common
    from hayabusa.eval import fidelity
    from tests.conftest import ASSETS, require_asset

    model = str(require_asset(ASSETS / "models" / "stories260K"))

    def no_hf(*a, **k):
        raise ImportError("Loading an AWQ quantized model requires gptqmodel")

    monkeypatch.setattr(common, "load_hf_model", no_hf)
    with pytest.raises(HayabusaValidationError, match="--reference-model") as e:
        fidelity.run_fidelity(model, "Once upon a time there was a little girl.", {}, reference="hf")
    assert e.value.parameter == "reference_model"


STORY = ("Once upon a time, there was a little girl named Lily. She liked to play in the park with her dog. "
         "One day the dog found a big red ball under a tree. Lily and the dog played until the sun went down. ")


@pytest.mark.parametrize("args,names", [
    (["--fidelity-tokens", "0"], ["--fidelity-tokens 0", ">= 2"]),
    (["--fidelity-tokens", "-5"], ["--fidelity-tokens -5"]),
    (["--chunk-len", "1"], ["--chunk-len 1", ">= 2", "KV cache"]),
    (["--reference-dtype", "int8"], ["--reference-dtype 'int8'"]),
    (["--sweep", "quantization=fp8,int8"], ["--sweep does not apply to --fidelity"]),
    (["--text", "/nonexistent/text.txt"], ["--text '/nonexistent/text.txt'", "cannot read"]),
])
def test_fidelity_flags_are_refused_by_name(stories_dir, tmp_path, capsys, args, names):
    from hayabusa.entrypoints.cli import main

    text = tmp_path / "t.txt"
    text.write_text(STORY)
    assert main(["eval", "--fidelity", "--model", stories_dir, "--text", str(text), "--device", "cpu",
                 "--no-tqdm", *args]) == 2
    err = capsys.readouterr().err
    assert all(n in err for n in names), err
    assert "--dtype 'int8'" not in err


def test_fidelity_names_model_quantization_and_reference(stories_dir, tmp_path, capsys):
    """The stdout header and --json say what was measured against what; --no-tqdm hides the chunk bar."""
    from hayabusa.entrypoints.cli import main

    text, out = tmp_path / "t.txt", tmp_path / "f.json"
    text.write_text(STORY * 2)
    assert main(["eval", "--fidelity", "--model", stories_dir, "--text", str(text), "--device", "cpu",
                 "--dtype", "float32", "--quantization", "int8", "--reference-model", stories_dir,
                 "--reference-dtype", "float32", "--chunk-len", "32", "--fidelity-tokens", "100", "--no-tqdm",
                 "--json", str(out)]) == 0
    cap = capsys.readouterr()
    assert f"fidelity of hayabusa on {stories_dir} (float32, quantization int8, kv_cache_dtype auto)" in cap.out
    assert "vs reference hf (float32): 100 tokens in 4 chunk(s) of <= 32" in cap.out
    assert "Fidelity chunks" not in cap.err
    res = json.loads(out.read_text())
    assert (res["model"], res["quantization"], res["kv_cache_dtype"]) == (stories_dir, "int8", "auto")
    assert (res["reference"], res["reference_model"], res["reference_dtype"]) == ("hf", stories_dir, "float32")
    assert res["num_tokens"] == 100 and 0 < res["top1_agreement"] <= 1


def test_schema_runs_each_setting_with_and_without_the_constraint(tiny_qwen2, tmp_path):
    pytest.importorskip("xgrammar")
    from hayabusa.entrypoints.cli import main

    schema = tmp_path / "schema.json"
    schema.write_text(json.dumps({"type": "object", "properties": {"store": {"type": ["string", "null"],
                                                                             "maxLength": 12}},
                                  "required": ["store"], "additionalProperties": False}))
    summary = tmp_path / "summary.json"
    rc = main(["eval", "--model", tiny_qwen2, "--data", str(DATA), "--task", "extraction", "--device", "cpu",
               "--max-tokens", "60", "--limit", "4", "--schema", str(schema), "--json", str(summary), "--no-tqdm"])
    assert rc == 0
    by = {r["setting"]: r for r in json.loads(summary.read_text())["rows"]}
    assert by["default"]["unparsable"] == 4          # a random model never writes JSON on its own
    assert by["default +schema"]["unparsable"] == 0  # under the schema every answer parses
    assert main(["eval", "--model", tiny_qwen2, "--data", str(DATA), "--task", "extraction", "--device", "cpu",
                 "--schema", "items", "--no-tqdm"]) == 2   # these items carry no schema of their own


def test_eval_header_shows_the_batch_invariant_mode(stories_dir, tmp_path, capsys):
    from hayabusa.entrypoints.cli import main

    data, summary = tmp_path / "two.jsonl", tmp_path / "summary.json"
    data.write_text("".join(json.dumps({"prompt": p, "gold": {"name": "Lily"}}) + "\n"
                            for p in ("Once upon a time", "Lily went to the park")))
    rc = main(["eval", "--model", stories_dir, "--data", str(data), "--task", "extraction", "--device", "cpu",
               "--max-tokens", "4", "--batch-invariant", "--json", str(summary), "--no-tqdm", "--no-warmup"])
    assert rc == 0
    lines = capsys.readouterr().out.splitlines()
    header = lines.index(next(line for line in lines if line.startswith("hayabusa eval: extraction on 2 items")))
    assert lines[header + 1] == "engine: device=cpu, batch_invariant=True"      # right above the table
    assert lines[header + 2].startswith("setting")
    assert json.loads(summary.read_text())["batch_invariant"] is True


def test_engine_settings_line_resolves_the_mode(monkeypatch):
    from hayabusa.eval.report import engine_settings_line

    monkeypatch.delenv("HAYABUSA_BATCH_INVARIANT", raising=False)
    assert engine_settings_line({}) == "engine: batch_invariant=False"
    monkeypatch.setenv("HAYABUSA_BATCH_INVARIANT", "1")
    assert engine_settings_line({"dtype": "float32"}) == "engine: dtype=float32, batch_invariant=True"
    assert engine_settings_line({"batch_invariant": False}) == "engine: batch_invariant=False"   # the flag wins
    assert engine_settings_line({"dtype": "float32"}, {"batch_invariant", "max_num_seqs"}) == \
        "engine: dtype=float32, batch_invariant=per setting"                     # --sweep batch_invariant=...
    monkeypatch.setenv("HAYABUSA_BATCH_INVARIANT", "maybe")
    with pytest.raises(HayabusaValidationError) as e:
        engine_settings_line({})
    assert e.value.parameter == "HAYABUSA_BATCH_INVARIANT"


def test_hf_reference_stops_where_max_model_len_stops_the_engine(stories_dir):
    """Decoder-only: a prompt of L tokens gets at most max_model_len - L new tokens from the engine (finish
    "length"); the HF reference of ``eval --fidelity`` is cut at the same room, per item of a batch, so the two
    agree (here greedy on the trained stories260K, one item with room for 4 tokens, one with room for 16)."""
    import random

    from transformers import AutoTokenizer

    from hayabusa.eval.data import EvalItem
    from hayabusa.eval.runner import run_hayabusa, run_hf

    tok = AutoTokenizer.from_pretrained(stories_dir)
    rng = random.Random(0)
    items = []
    for name, n in (("short", 20), ("long", 60)):
        it = EvalItem(name, "p", None, None)
        it.prompt_token_ids = [1] + [rng.randrange(3, 500) for _ in range(n - 1)]
        items.append(it)
    engine = run_hayabusa(stories_dir, items, {"max_model_len": 64, "device": "cpu"},
                          {"temperature": 0.0, "max_tokens": 16}, "hayabusa", {}, warmup=False)
    hf = run_hf(stories_dir, items, tok, max_tokens=16, dtype="float32", device="cpu", batch_size=2,
                max_model_len=64)
    assert engine.error is None and hf.error is None
    assert [len(tok(t[0], add_special_tokens=False).input_ids) > 0 for t in hf.texts] == [True, True]
    assert hf.texts == engine.texts
    assert hf.output_tokens <= 16 + 4 and engine.output_tokens == hf.output_tokens


@pytest.mark.parametrize("flags, named", [
    (["--limit", "0"], "--limit 0"), (["--limit", "-2"], "--limit -2"),
    (["--hf-batch-size", "0"], "--hf-batch-size 0"), (["--hf-batch-size", "-1"], "--hf-batch-size -1"),
    (["--tolerance", "-1"], "--tolerance -1.0"), (["--tolerance", "nan"], "--tolerance nan"),
    (["--data", "/nonexistent/items.jsonl"], "--data '/nonexistent/items.jsonl'")])
def test_eval_refuses_bad_task_flags_by_name(flags, named, capsys):
    """A negative --limit would slice items off the end, a negative --hf-batch-size make every reference item an
    error, a negative --tolerance flag the reference itself and NaN never flag: each is refused before loading."""
    from hayabusa.entrypoints.cli import main

    argv = ["eval", "--data", str(DATA), "--task", "extraction", "--device", "cpu", "--no-tqdm", *flags]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert f"hayabusa eval: error: {named}:" in err
    assert "no --model given" not in err               # refused before the model was even chosen
