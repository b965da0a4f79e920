"""The command line without rough edges, in-process (no model is loaded): help with every default, `--version`,
bare invocation, `bench --help` grouped by mode, card presets, serve's context floor, `generate --chat` output,
the bench's probe sized to memory and its tables saying where figures come from."""

import argparse
import sys

import pytest

from strata_jax.__main__ import (
    EXIT_DOES_NOT_FIT,
    EXIT_USAGE,
    MIN_ANSWER_TOKENS,
    _check_context_fits_the_template,
    _prog,
    answer_text,
    build_parser,
    main,
)
from strata_jax.cli_help import DefaultsFormatter, undocumented
from strata_jax.demo import DEMO_MODEL
from strata_jax.engine.cards import CARDS, card_budget_mib
from strata_jax.tokenizer import load_tokenizer


def test_every_option_has_help_stating_its_default():
    from strata_jax.bench.main import build_parser as bench_parser

    assert undocumented(build_parser()) == []
    assert undocumented(bench_parser()) == []
    serve_help = _subparser(build_parser(), "serve").format_help()
    assert "--slots SLOTS         concurrent requests decoded together (default: 4)" in serve_help
    assert "--metrics-public" in serve_help and "(default: off)" in serve_help
    assert "exit codes:" in serve_help and f"{EXIT_DOES_NOT_FIT}   plan, serve: does not fit" in serve_help


def test_undocumented_finds_what_is_missing():
    parser = argparse.ArgumentParser(prog="x", formatter_class=DefaultsFormatter)
    parser.add_argument("--a", type=int, default=3)  # no help
    parser.add_argument("--b", default=None, help="something")  # None: leaving it out must be explained
    parser.add_argument("--c", default=None, help="something (default: none)")
    parser.add_argument("--d", type=int, default=5, help="a number")  # the formatter states 5
    assert undocumented(parser) == ["x --a: no help", "x --b: no default stated (say what leaving it out does)"]
    assert "a number (default: 5)" in parser.format_help()


def test_bare_command_prints_help_and_version(capsys):
    assert main([]) == 0
    out = capsys.readouterr().out
    assert out.startswith("usage:") and all(c in out for c in ("generate", "serve", "quantize", "plan", "bench"))
    with pytest.raises(SystemExit) as exit_info:
        main(["--version"])
    assert exit_info.value.code == 0 and capsys.readouterr().out.strip() == "strata_jax 0.1.0"


def test_prog_is_the_console_script_when_run_as_it(monkeypatch):
    monkeypatch.setattr(sys, "argv", ["/venv/bin/strata-jax"])
    assert _prog() == "strata-jax" and build_parser().prog == "strata-jax"
    monkeypatch.setattr(sys, "argv", ["/repo/strata_jax/__main__.py"])
    assert _prog() == "python -m strata_jax"


def test_bench_help_is_grouped_by_mode():
    from strata_jax.bench.main import build_parser as bench_parser

    parser = bench_parser()
    groups = {g.title: {a.option_strings[0] for a in g._group_actions} for g in parser._action_groups}
    assert "--mode" in groups["what to run"]
    expected = {"step mode": "--verify-slots", "tier mode": "--budgets", "host and roundtrip modes": "--host-pairs",
                "deltanet mode": "--deltanet-tokens", "hyper mode": "--hyper-tokens",
                "attention mode": "--attn-tokens", "fuzz mode": "--bodies", "prefill mode": "--prompt-lengths"}
    for title, option in expected.items():
        assert option in groups[title], title
    users = next(options for title, options in groups.items() if title.startswith("users mode"))
    assert {"--users", "--prompt-tokens", "--gen-tokens"} <= users
    help_text = parser.format_help()
    assert help_text.startswith("usage: python -m strata_jax.bench [--mode MODE] [options of that mode]")
    assert "(default: 2 GiB, or an eighth of the free memory" in " ".join(help_text.split())


def test_bench_subcommand_is_the_bench(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", "--help"])
    assert exit_info.value.code == 0 and "modes (--mode):" in capsys.readouterr().out


def test_card_presets():
    assert card_budget_mib("24gb") == card_budget_mib("24") == card_budget_mib("24G") == 24_564
    assert card_budget_mib("141GB") == 143_771
    assert list(CARDS) == ["12gb", "16gb", "24gb", "32gb", "48gb", "80gb", "141gb"]
    with pytest.raises(ValueError, match="unknown card '7gb': choose one of 12gb, 16gb"):
        card_budget_mib("7gb")


def test_card_and_budget_flags_exclude_each_other(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["plan", "--card", "24gb", "--vram-budget-mib", "1000"])
    assert exit_info.value.code == EXIT_USAGE and "not allowed with argument" in capsys.readouterr().err


def test_serve_refuses_a_context_too_small_for_the_chat_template(capsys):
    assert main(["serve", "--ctx", "10", "--port", "0"]) == EXIT_USAGE
    err = capsys.readouterr().err
    smallest = len(load_tokenizer(DEMO_MODEL).apply_chat_template([{"role": "user", "content": "hi"}],
                                                                   add_generation_prompt=True, tokenize=True))
    need = smallest + MIN_ANSWER_TOKENS
    assert f"error: --ctx 10 is too small: the chat template alone takes {smallest} tokens" in err
    assert f"--ctx must be at least {need}" in err
    _check_context_fits_the_template(DEMO_MODEL, need)  # the floor itself is accepted
    with pytest.raises(ValueError, match="too small"):
        _check_context_fits_the_template(DEMO_MODEL, need - 1)


def test_generate_chat_answer_stops_before_the_end_of_turn_token():
    tok = load_tokenizer(DEMO_MODEL)
    im_end = tok.encode("<|im_end|>")
    assert len(im_end) == 1 and im_end[0] in tok.eos_token_ids
    body = tok.encode("<think>\nshort\n</think>\n\nprint(1)")
    assert answer_text(tok, body + im_end, set(tok.eos_token_ids)) == "<think>\nshort\n</think>\n\nprint(1)"
    assert answer_text(tok, body, set(tok.eos_token_ids)) == tok.decode(body)  # ended by length: nothing cut


def test_bandwidth_probe_is_sized_to_free_memory(monkeypatch):
    from strata_jax.bench import floors

    monkeypatch.setattr(floors, "free_memory_bytes", lambda device=None: 4 * 2**30)
    assert floors.probe_gib() == 0.5  # an eighth of 4 GiB
    monkeypatch.setattr(floors, "free_memory_bytes", lambda device=None: 64 * 2**30)
    assert floors.probe_gib() == 2.0  # capped
    monkeypatch.setattr(floors, "free_memory_bytes", lambda device=None: 2**20)
    assert floors.probe_gib() == floors.MIN_PROBE_GIB
    monkeypatch.setattr(floors, "free_memory_bytes", lambda device=None: None)
    assert floors.probe_gib() == 2.0


def test_free_memory_is_measured_here():
    from strata_jax.bench.floors import free_memory_bytes

    free = free_memory_bytes()
    assert free is not None and 0 < free < 2**50


def test_users_table_says_where_each_figure_comes_from(capsys):
    from strata_jax.bench.users import SEED, print_users_table

    row = {"users": 4, "speculation": "none", "per_user_tok_s": 12.5, "aggregate_tok_s": 48.0, "ttft_p50_s": 0.5,
           "ttft_p95_s": 0.9, "acceptance": None, "step_floor_ms": 1.0, "fraction_of_floor": 0.1,
           "seed_per_user_tok_s": SEED[4][0], "seed_aggregate_tok_s": SEED[4][1], "seed_ttft": SEED[4][2],
           "gpu_hit_rate": 1.0}
    print_users_table([row])
    out = capsys.readouterr().out
    import jax

    assert f"Measured on this machine ({jax.devices()[0].device_kind}, {jax.default_backend()} backend)" in out
    assert "the seed system's published figures (Strata on an RTX 5090" in out and "not measured here" in out
    assert "| tok/s per user here (seed) |" in out and "| 4 | none | 12.5 (38) | 48.0 (125) |" in out


def _subparser(parser: argparse.ArgumentParser, name: str) -> argparse.ArgumentParser:
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return action.choices[name]


def test_serve_pacing_flags_reach_the_engine_and_bad_values_are_refused(monkeypatch, capsys):
    import server.main
    import strata_jax
    import strata_jax.engine
    from strata_jax.engine.config import EngineConfig

    seen = {}

    class FakeEngine:
        context_length = 4096

        def __init__(self, model, config, drafter=None):
            seen["config"] = config

        def start(self):
            pass

    class FakeModel:
        tokenizer = object()

    monkeypatch.setattr(strata_jax, "load_model", lambda *a, **k: FakeModel())
    monkeypatch.setattr(strata_jax.engine, "Engine", FakeEngine)
    monkeypatch.setattr(server.main, "serve", lambda load_engine, **kw: (load_engine(), 0)[1])
    assert main(["serve", "--port", "0", "--compile-cache", "off", "--decode-share", "0.5", "--mixed-step-ms",
                 "1000", "--prefill-burst-ms", "0", "--share-by-requests"]) == 0
    config = seen["config"]
    assert (config.decode_share, config.mixed_step_ms, config.prefill_burst_ms, config.share_by_requests) == (
        0.5, 1000.0, 0.0, True)
    assert main(["serve", "--port", "0", "--compile-cache", "off"]) == 0  # the engine's own defaults
    default, got = EngineConfig(), seen["config"]
    assert (got.decode_share, got.mixed_step_ms, got.prefill_burst_ms, got.share_by_requests) == (
        default.decode_share, default.mixed_step_ms, default.prefill_burst_ms, default.share_by_requests)
    for flag, value in (("--decode-share", "1"), ("--mixed-step-ms", "-1"), ("--prefill-burst-ms", "nan")):
        seen.clear()
        assert main(["serve", "--port", "0", flag, value]) == EXIT_USAGE
        assert "--decode-share must be in [0, 1)" in capsys.readouterr().err and not seen
