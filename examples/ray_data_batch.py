"""Offline batch inference over many machines with Ray Data: one hayabusa ``LLM`` per actor (data parallel).

Ray Data reads the JSONL, splits it into batches and feeds them to ``concurrency`` actors, each holding its own
engine (on its own GPU, or ``tensor_parallel_size`` GPUs); hayabusa schedules within a batch, Ray across actors.

    pip install 'hayabusa[ray]'
    python examples/ray_data_batch.py MODEL requests.jsonl out_dir --actors 4 [--gpus-per-actor 1]

Each input line: {"prompt": "...", "max_tokens": 64, "temperature": 0.0}; each output row adds "text" and
"token_ids". Run it on a Ray cluster's head node (``ray start --head`` / ``RAY_ADDRESS``) to use every node.
"""

from __future__ import annotations

import argparse
from typing import Any

import numpy as np


class LLMPredictor:
    """A Ray Data actor: builds one engine, then generates a batch of rows at a time."""

    def __init__(self, model: str, **engine_kwargs: Any) -> None:
        from hayabusa import LLM

        self.llm = LLM(model, **engine_kwargs)

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, Any]:
        from hayabusa import SamplingParams

        n = len(batch["prompt"])
        max_tokens = batch.get("max_tokens", np.full(n, 64))
        temperature = batch.get("temperature", np.zeros(n))
        params = [SamplingParams(max_tokens=int(m), temperature=float(t)) for m, t in zip(max_tokens, temperature)]
        outs = self.llm.generate([str(p) for p in batch["prompt"]], params, use_tqdm=False)
        return {"prompt": batch["prompt"], "text": np.array([o.outputs[0].text for o in outs], dtype=object),
                "token_ids": np.array([list(o.outputs[0].token_ids) for o in outs], dtype=object)}


def run(model: str, src: str, actors: int = 1, gpus_per_actor: float = 0, batch_size: int = 64,
        **engine_kwargs: Any) -> Any:
    """The Ray Dataset of results (lazy; ``.write_json(dir)`` or ``.take_all()`` runs it)."""
    import ray

    ds = ray.data.read_json(src)
    return ds.map_batches(LLMPredictor, fn_constructor_kwargs={"model": model, **engine_kwargs},
                          concurrency=actors, num_gpus=gpus_per_actor, batch_size=batch_size)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("src", help="JSONL of requests")
    ap.add_argument("out", help="output folder (JSON files)")
    ap.add_argument("--actors", type=int, default=1, help="engines (data-parallel replicas)")
    ap.add_argument("--gpus-per-actor", type=float, default=1.0)
    ap.add_argument("--batch-size", type=int, default=256)
    a = ap.parse_args()
    run(a.model, a.src, a.actors, a.gpus_per_actor, a.batch_size).write_json(a.out)


if __name__ == "__main__":
    main()
