"""EngineArgs as flags (the one function every command uses), the accepted-but-ignored vLLM arguments, and the
defaults and formulas config.py defines once. Reads config.json only (no weights)."""

from __future__ import annotations

import argparse
import dataclasses
import logging

import pytest

from hayabusa.config import (
    IGNORED_ARGS,
    NOT_CLI_ARGS,
    EngineArgs,
    default_max_num_batched_tokens,
    kv_bytes_per_token,
)
from hayabusa.entrypoints import cli

FLAGS = ["--" + f.name.replace("_", "-") for f in dataclasses.fields(EngineArgs) if f.name not in NOT_CLI_ARGS]


def _parser(**kw) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(allow_abbrev=False)
    EngineArgs.add_cli_args(p, **kw)
    return p


def test_add_cli_args_one_flag_per_field_and_only_given_ones_pass():
    p = _parser()
    ns = p.parse_args(["--max-num-seqs", "4", "--no-enable-prefix-caching", "--enforce-eager", "-tp", "1",
                       "--cuda-graph-sizes", "1", "2", "--gpu-memory-utilization", "0.5", "--dtype", "float32"])
    assert EngineArgs.cli_kwargs(ns) == {"max_num_seqs": 4, "enable_prefix_caching": False, "enforce_eager": True,
                                         "tensor_parallel_size": 1, "cuda_graph_sizes": [1, 2],
                                         "gpu_memory_utilization": 0.5, "dtype": "float32"}
    args = EngineArgs.from_cli_args(ns, model="m")
    assert (args.model, args.max_num_seqs, args.block_size) == ("m", 4, 16)      # unset flags: EngineArgs' defaults
    assert EngineArgs.cli_kwargs(p.parse_args([])) == {}
    with pytest.raises(SystemExit):
        p.parse_args(["--model", "m"])                                          # each command names the model itself


def test_add_cli_args_only_a_subset():
    ns = _parser(only=("max_num_seqs", "trust_remote_code")).parse_args(["--max-num-seqs", "3", "--trust-remote-code"])
    assert EngineArgs.cli_kwargs(ns) == {"max_num_seqs": 3, "trust_remote_code": True}
    with pytest.raises(SystemExit):
        _parser(only=("max_num_seqs",)).parse_args(["--block-size", "8"])


@pytest.mark.parametrize("command", ["generate", "serve", "bench", "eval"])
def test_every_command_lists_every_engine_flag(command, capsys):
    with pytest.raises(SystemExit) as e:
        cli.main([command, "--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert "engine arguments (EngineArgs" in out
    assert [f for f in FLAGS if f not in out] == []


def test_every_engine_argument_has_its_own_help_text():
    # pipeline_parallel_size's text sat inside tensor_parallel_size's docstring entry: -tp's help described
    # pipelines and -pp had none
    from hayabusa.config import _arg_docs

    docs = _arg_docs(EngineArgs)
    assert [f.name for f in dataclasses.fields(EngineArgs) if f.name not in IGNORED_ARGS and not docs.get(f.name)
            and f.name not in NOT_CLI_ARGS] == []
    assert "pipeline" not in docs["tensor_parallel_size"]


def test_plan_lists_the_engine_flags_that_change_what_fits(capsys):
    from hayabusa.eval.cli import PLAN_ENGINE_ARGS

    with pytest.raises(SystemExit):
        cli.main(["plan", "--help"])
    out = capsys.readouterr().out
    assert all("--" + n.replace("_", "-") in out for n in PLAN_ENGINE_ARGS) and "--tp" in out
    assert "--enforce-eager" not in out


def test_ignored_arguments_warn_by_name_when_set(stories_dir, caplog):
    assert sorted(IGNORED_ARGS) == sorted(["tokenizer_mode", "max_seq_len_to_capture", "disable_log_stats",
                                           "enable_chunked_prefill", "disable_custom_all_reduce",
                                           "compilation_config", "num_scheduler_steps", "reasoning_parser"])
    with caplog.at_level(logging.WARNING, logger="hayabusa.config"):
        EngineArgs(model=stories_dir, device="cpu").create_engine_config()
    assert caplog.records == []                                                 # defaults: silent
    with caplog.at_level(logging.WARNING, logger="hayabusa.config"):
        EngineArgs(model=stories_dir, device="cpu", disable_log_stats=False, enable_chunked_prefill=False,
                   compilation_config={"level": 3}).create_engine_config()
    messages = [r.getMessage() for r in caplog.records]
    assert len(messages) == 3
    assert messages[0].startswith("disable_log_stats=False is accepted for vLLM compatibility and ignored")
    assert messages[1].startswith("enable_chunked_prefill=False is accepted")
    assert messages[2].startswith("compilation_config={'level': 3} is accepted")


def test_one_default_and_one_formula_for_the_engine_and_plan(tiny_qwen2):
    from hayabusa.eval.plan import PlanInputs, load_config, make_plan

    assert default_max_num_batched_tokens(256) == 8192 and default_max_num_batched_tokens(10000) == 10000
    assert kv_bytes_per_token(num_layers=2, num_kv_heads=3, head_dim=4, element_size=2) == 96
    for seqs in (256, 10000):
        cfg = EngineArgs(model=tiny_qwen2, device="cpu", dtype="bfloat16", max_num_seqs=seqs).create_engine_config()
        plan = make_plan(load_config(tiny_qwen2), PlanInputs(dtype="bfloat16", max_num_seqs=seqs), gpu_memory_gib=16)
        assert plan["max_num_batched_tokens"] == cfg.scheduler_config.max_num_batched_tokens
        assert plan["kv_bytes_per_token"] == cfg.model_config.kv_bytes_per_token()


@pytest.mark.parametrize("kw, parameter", [
    (dict(seed="abc"), "seed"), (dict(seed=2 ** 70), "seed"), (dict(seed=1.5), "seed"), (dict(seed=True), "seed"),
    (dict(gpu_memory_utilization="0.9"), "gpu_memory_utilization"),
    (dict(gpu_memory_utilization=None), "gpu_memory_utilization"),
    (dict(max_num_seqs=True), "max_num_seqs"), (dict(block_size=True), "block_size"),
    (dict(max_model_len=True), "max_model_len"), (dict(cuda_graph_sizes="abc"), "cuda_graph_sizes"),
    (dict(cuda_graph_sizes=[4, 0]), "cuda_graph_sizes"), (dict(enable_prefix_caching="no"), "enable_prefix_caching"),
    (dict(enforce_eager="no"), "enforce_eager"), (dict(async_scheduling="on"), "async_scheduling"),
    (dict(trust_remote_code="yes"), "trust_remote_code"), (dict(skip_tokenizer_init="false"), "skip_tokenizer_init"),
    (dict(download_dir=5), "download_dir"), (dict(tokenizer=123), "tokenizer"), (dict(revision=1), "revision"),
    (dict(allowed_media_domains="example.com"), "allowed_media_domains"),
])
def test_engine_arguments_of_the_wrong_type_are_refused_by_name(stories_dir, kw, parameter):
    """A value of the wrong type is refused naming the argument and the value, before any model is read (a
    string "no" for an on / off argument would otherwise read as on; True as a count would be 1)."""
    from hayabusa.config import EngineArgs
    from hayabusa.errors import HayabusaValidationError

    with pytest.raises(HayabusaValidationError) as err:
        EngineArgs.from_kwargs(stories_dir, **kw).create_engine_config()
    assert err.value.parameter == parameter and str(err.value).startswith(f"{parameter}=")
    # the right types pass the same checks
    EngineArgs.from_kwargs(stories_dir, seed=None, gpu_memory_utilization=1, cuda_graph_sizes=[1, 8],
                           enable_prefix_caching=None, enforce_eager=True, download_dir=None,
                           allowed_media_domains=["example.com"])._verify_args()


@pytest.mark.parametrize("port", ["99999", "-1", "http"])
def test_serve_refuses_a_port_outside_0_65535_before_loading(port, capsys):
    from hayabusa.entrypoints.cli import main

    with pytest.raises(SystemExit) as exit_:
        main(["serve", "--port", port])
    assert exit_.value.code == 2 and "--port" in capsys.readouterr().err
