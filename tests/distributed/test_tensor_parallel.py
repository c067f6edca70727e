"""tensor_parallel_size=2 on CPU (gloo, two spawned worker processes): greedy token ids and seeded samples equal
tensor_parallel_size=1 (float32) on tiny Llama (1 KV head: replicated on both ranks), Qwen2 (2 KV heads: split,
q/k/v biases, tied head), Qwen3 (QK-norm, head_dim != hidden / heads), GPT-2 (4 heads, odd vocabulary: padded
vocab shards) and Gemma 2 (4 KV heads, soft-capping, sliding window), under chunked prefill, preemption, prefix
caching and n > 1; a worker killed mid-generation fails generate within seconds and leaves no process."""

from __future__ import annotations

import multiprocessing
import os
import signal
import threading
import time

import pytest
import torch

from hayabusa import LLM, SamplingParams
from hayabusa.errors import HayabusaValidationError
from hayabusa.executor.mp_executor import WorkerError
from tests.conftest import EN_PROMPTS, JA_PROMPTS, TOKENIZERS, require_asset

LONG = ("The quick brown fox jumps over the lazy dog while five boxing wizards jump quickly, "
        "and a journey of a thousand miles begins with a single step.")
PROMPTS = EN_PROMPTS + JA_PROMPTS + [LONG]
# block_size 4 and 24 blocks for 8 rows: preemption; 16-token steps: chunked prefill of every prompt
# swap_space=0: preemption recomputes (test_tp2_swap_preemption_equals_recompute covers the CPU KV tier)
ENGINE = dict(dtype="float32", device="cpu", max_num_seqs=8, block_size=4, num_gpu_blocks_override=24,
              max_model_len=64, max_num_batched_tokens=16, swap_space=0)
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
SEEDED = SamplingParams(temperature=0.9, top_p=0.9, max_tokens=10, ignore_eos=True, n=2, seed=7)


def _build(arch: str, out, num_layers: int = 2) -> str:
    import transformers as tf

    tok_name = {"gpt2": "gpt2", "qwen2": "qwen3", "qwen3": "qwen3", "llama": "llm-jp-v3.1",
                "gemma2": "llm-jp-v3.1"}[arch]
    tok = tf.AutoTokenizer.from_pretrained(str(require_asset(TOKENIZERS / tok_name)))
    ids = dict(vocab_size=len(tok), bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
               initializer_range=0.2)
    common = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=num_layers, num_attention_heads=4,
                  max_position_embeddings=256, **ids)
    torch.manual_seed(0)
    if arch == "gpt2":
        model = tf.GPT2LMHeadModel(tf.GPT2Config(n_embd=64, n_layer=num_layers, n_head=4, n_positions=256, **ids))
    elif arch == "llama":
        model = tf.LlamaForCausalLM(tf.LlamaConfig(**common, num_key_value_heads=1, tie_word_embeddings=False))
    elif arch == "qwen2":
        model = tf.Qwen2ForCausalLM(tf.Qwen2Config(**common, num_key_value_heads=2, tie_word_embeddings=True))
    elif arch == "qwen3":
        model = tf.Qwen3ForCausalLM(tf.Qwen3Config(**common, num_key_value_heads=2, head_dim=32,
                                                   tie_word_embeddings=True))
    else:
        model = tf.Gemma2ForCausalLM(tf.Gemma2Config(**common, num_key_value_heads=4, head_dim=16,
                                                     query_pre_attn_scalar=24, sliding_window=8,
                                                     attn_logit_softcapping=5.0, final_logit_softcapping=3.0,
                                                     pad_token_id=tok.pad_token_id or 0))
    with torch.no_grad():   # HF initialises biases to 0 and norms to 1 (Gemma: 0): make them matter
        for name, p in model.named_parameters():
            if name.endswith(("bias", "norm.weight", "layernorm.weight", "ln_1.weight", "ln_2.weight")):
                p.normal_(0.0, 0.3)
    model.save_pretrained(str(out), safe_serialization=True)
    tok.save_pretrained(str(out))
    return str(out)


CHOICES = ["yes", "no", "maybe so"]


def _run(llm: LLM, structured: bool = False) -> dict:
    """Greedy over every prompt (preemption, chunks), again (prefix hits), n=2 seeded samples, and (structured)
    a choice constraint: its step waits for the grammar bitmask before it goes to the workers."""
    choice = None
    if structured:
        from hayabusa.sampling_params import StructuredOutputsParams

        params = SamplingParams(temperature=0.0, max_tokens=8,
                                structured_outputs=StructuredOutputsParams(choice=CHOICES))
        choice = [o.outputs[0].text for o in llm.generate(PROMPTS[:3], params, use_tqdm=False)]
    greedy = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
    again = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
    seeded = [[c.token_ids for c in o.outputs] for o in llm.generate(PROMPTS[:3], SEEDED, use_tqdm=False)]
    return {"greedy": greedy, "again": again, "seeded": seeded, "choice": choice,
            "preemptions": llm.llm_engine.scheduler.num_preemptions}


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "gpt2", "gemma2"])
def test_tp2_equals_tp1(arch, tmp_path, monkeypatch):
    path = _build(arch, tmp_path / arch)
    structured = arch == "qwen2"
    ref = _run(LLM(path, **ENGINE), structured)
    offload = {}
    if arch == "qwen2":   # cpu_offload_gb on every rank (its shard's layers through the ring; the fake-device mode
        from hayabusa.worker.cpu_offload import FAKE_ENV   # reaches the spawned workers through the environment)

        monkeypatch.setenv(FAKE_ENV, "1")
        offload = {"cpu_offload_gb": 1.0}
    # Gemma 2's TP engine also overlaps steps (async scheduling: step N+1 sent before step N's tokens are back)
    llm = LLM(path, tensor_parallel_size=2, async_scheduling=arch == "gemma2", **ENGINE, **offload)
    assert llm.llm_engine.config.cache_config.cpu_offload_bytes == (1 << 30 if offload else 0)
    try:
        got = _run(llm, structured)
    finally:
        llm.llm_engine.shutdown()
    assert ref["preemptions"] > 0 and got["preemptions"] == ref["preemptions"]
    assert all(len(ids) == 12 for ids in got["greedy"])
    assert got["greedy"] == ref["greedy"]
    assert got["again"] == got["greedy"]                   # prefix-cache hits change nothing
    assert got["seeded"] == ref["seeded"]
    assert all(a != b for a, b in got["seeded"])           # the two samples differ (seed + i)
    assert got["choice"] == ref["choice"] and (not structured or all(t in CHOICES for t in got["choice"]))
    assert not any(p.is_alive() for p in llm.llm_engine.runner.procs)


def test_tp2_swap_preemption_equals_recompute(tmp_path):
    """Every rank keeps a CPU KV tier of its own KV heads (Qwen2's 2 KV heads: one per rank) and runs the step's
    swap lists on it: swap-based preemption gives the one-process engine's recompute output."""
    path = _build("qwen2", tmp_path / "m")
    ref = LLM(path, preemption_mode="recompute", **ENGINE)
    want = [o.outputs[0].token_ids for o in ref.generate(PROMPTS, GREEDY, use_tqdm=False)]
    assert ref.llm_engine.scheduler.num_preemptions > 0
    llm = LLM(path, tensor_parallel_size=2, preemption_mode="swap", **{**ENGINE, "swap_space": 0.002})
    try:
        engine = llm.llm_engine
        assert engine.runner.num_cpu_blocks > 0
        for _ in range(2):
            got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
            assert got == want
        sched, kv = engine.scheduler, engine.kv_cache_manager
        assert sched.num_swap_preemptions == sched.num_preemptions > 0
        # (distinct prompts: their blocks are never hit, so the prefix tier keeps none; the swap-ins are the
        # preempted requests': tests/engine/test_swap_space.py covers prefix restores)
        assert kv.num_blocks_swapped_in > 0 and kv.num_cpu_hit_blocks == 0
    finally:
        llm.llm_engine.shutdown()


def test_refusals(tmp_path):
    """Bad sizes fail at the edge, by name, before any process starts."""
    path = _build("qwen2", tmp_path / "m")   # 4 heads, 2 KV heads
    with pytest.raises(HayabusaValidationError, match="attention heads") as e:
        LLM(path, tensor_parallel_size=3, **ENGINE)
    assert e.value.parameter == "tensor_parallel_size" and e.value.value == 3
    with pytest.raises(HayabusaValidationError) as e:
        LLM(path, tensor_parallel_size=0, **ENGINE)
    assert e.value.parameter == "tensor_parallel_size"
    with pytest.raises(HayabusaValidationError) as e:
        LLM(path, tensor_parallel_size=2, quantization="int8", **ENGINE)
    assert e.value.parameter == "quantization"
    with pytest.raises(HayabusaValidationError) as e:
        LLM(path, distributed_executor_backend="slurm", **ENGINE)
    assert e.value.parameter == "distributed_executor_backend"


def test_killed_worker_fails_generate_fast(tmp_path):
    path = _build("llama", tmp_path / "m")
    llm = LLM(path, tensor_parallel_size=2, **{**ENGINE, "num_gpu_blocks_override": None, "max_model_len": 256})
    ex = llm.llm_engine.runner
    assert len(ex.procs) == 2 and all(p.is_alive() for p in ex.procs)
    killed_at = []

    def kill() -> None:
        killed_at.append(time.monotonic())
        os.kill(ex.procs[1].pid, signal.SIGKILL)

    timer = threading.Timer(1.0, kill)
    timer.start()
    with pytest.raises(WorkerError, match="worker 1 .* died|worker 0 failed"):
        llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=240, ignore_eos=True), use_tqdm=False)
    assert killed_at and time.monotonic() - killed_at[0] < 10.0
    assert not any(p.is_alive() for p in ex.procs)
    with pytest.raises(WorkerError):   # the engine stays failed, it does not hang
        llm.generate(PROMPTS[:1], GREEDY, use_tqdm=False)


def test_plan_suggests_only_sizes_the_engine_runs(tmp_path):
    """`hayabusa plan` and the engine share one rule: Qwen2.5-7B's 28 heads split 2 and 4 ways, not 8; the
    engine refuses 8 by name, and the plan never suggests it."""
    from hayabusa.distributed.config import tp_refusal
    from hayabusa.eval.plan import PlanInputs, advice, load_config, make_plan

    assert tp_refusal("Qwen2ForCausalLM", 28, 4, 18944, False, 2) is None
    assert tp_refusal("Qwen2ForCausalLM", 28, 4, 18944, False, 4) is None
    assert tp_refusal("Qwen2ForCausalLM", 28, 4, 18944, False, 8)[0] == "tensor_parallel_size"
    assert tp_refusal("Qwen2ForCausalLM", 28, 4, 18944, True, 2)[0] == "quantization"
    cfg = load_config("qwen2.5-7b-shape")
    t4 = make_plan(cfg, PlanInputs(max_model_len=8192), gpu="T4")
    assert "tensor_parallel_size=2" in " ".join(t4["advice"])
    # one 4 GiB GPU: 2 and 4 ranks are too few, 8 would fit but the engine cannot split 28 heads 8 ways
    small = make_plan(cfg, PlanInputs(max_model_len=1024), gpu_memory_gib=4)
    assert not small["weights_fit"]
    assert not any("tensor_parallel_size=" in a for a in advice(cfg, PlanInputs(max_model_len=1024), small))


def test_worker_start_timeout_and_failed_step(tmp_path, monkeypatch):
    """A worker that does not report ready in time, and a step that raises in a worker: each a WorkerError in the
    caller within seconds (the failing worker's traceback in the message), and no worker process left."""
    from hayabusa.core.scheduler_output import CachedRequestData, SchedulerOutput
    path = _build("llama", tmp_path / "m")
    monkeypatch.setenv("HAYABUSA_WORKER_START_TIMEOUT", "0.5")   # less than spawning takes
    t0 = time.monotonic()
    with pytest.raises(WorkerError, match="did not answer within 0 s|did not answer within 1 s"):
        LLM(path, tensor_parallel_size=2, **ENGINE)
    assert time.monotonic() - t0 < 10.0
    assert not [p for p in multiprocessing.active_children() if p.name.startswith("hayabusa-worker")]
    monkeypatch.delenv("HAYABUSA_WORKER_START_TIMEOUT")
    llm = LLM(path, tensor_parallel_size=2, **ENGINE)
    ex = llm.llm_engine.runner
    # a step naming a request no worker knows: the runner raises KeyError in both ranks
    bad = SchedulerOutput([], CachedRequestData(["ghost"], [False], [()], [[]], [3]), {"ghost": 1}, 1,
                          sampling_req_ids={"ghost"})
    t0 = time.monotonic()
    with pytest.raises(WorkerError, match="worker [01] failed:(.|\n)*KeyError"):
        ex.execute_model(bad)
    assert time.monotonic() - t0 < 10.0
    assert not any(p.is_alive() for p in ex.procs)


def _gone(pid: int) -> bool:
    """The process has exited (a zombie waiting for its new parent to reap it counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def test_engine_process_killed_leaves_no_worker(tmp_path):
    """SIGKILL of the engine's process (no atexit, no finalizer): its workers notice and exit within seconds."""
    import subprocess
    import sys

    path = _build("llama", tmp_path / "m")
    script = ("import time\nfrom hayabusa import LLM\n"
              f"llm = LLM({path!r}, tensor_parallel_size=2, dtype='float32', device='cpu', max_model_len=64)\n"
              "print(' '.join(str(p.pid) for p in llm.llm_engine.runner.procs), flush=True)\ntime.sleep(300)\n")
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        pids = [int(p) for p in proc.stdout.readline().split()]
        assert len(pids) == 2 and not any(_gone(p) for p in pids)
    finally:
        proc.kill()
        proc.wait()
    deadline = time.monotonic() + 5.0
    while not all(_gone(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert all(_gone(p) for p in pids)
