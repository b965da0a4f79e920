"""Shared test setup: the `gpu` marker skips unless JAX has a GPU backend; `SLOW` marks the tests that the fast
loop (`pytest -m "not slow"`) leaves out."""

import atexit
import os
import shutil
import tempfile
from pathlib import Path

import pytest

# The suite compiles hundreds of small XLA:CPU programs that each run for milliseconds: LLVM's optimisation passes
# cost more than they save there (the model parity tests took 31% less CPU time at level 0, the engine tests 3%;
# 2026-12-02). Set before JAX starts, and inherited by the tests' subprocesses. Not where a GPU is, whose tests time
# kernels.
if shutil.which("nvidia-smi") is None and "xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} --xla_backend_optimization_level=0".strip()

# Many tests build engines of the same tiny models, so the same XLA programs compile again and again in different
# tests, workers and subprocesses. jax's persistent cache (keyed by the program, the compiler and its flags) shares
# them across one run: a subset of engine tests took 5:28 instead of 7:56 on 2 cores from an empty cache
# (2026-12-07). One fresh directory per run, made by the first process (pytest-xdist's workers and the tests'
# subprocesses inherit the variable) and removed by it at exit; a directory the caller set is used as it is.
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    _run_cache = tempfile.mkdtemp(prefix="strata_jax-test-xla-")
    os.environ["JAX_COMPILATION_CACHE_DIR"] = _run_cache
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.3")
    atexit.register(shutil.rmtree, _run_cache, ignore_errors=True)

FIXTURES = Path(__file__).parent / "fixtures"

# Tests marked `slow` (README: the fast loop). Whole files: benchmark smoke runs, CLI and server subprocesses, the
# notebook, speculative decoding end to end. Single tests: those that took over ~12 s on 2 cores (pytest
# --durations, 2026-12-01), mostly the full kernel matrix and engine runs that compile several step functions; each
# area keeps a quick test of the same behaviour in the fast loop.
SLOW_FILES = {
    "bench/test_bench.py", "bench/test_bench_tier.py", "bench/test_bench_kernels.py", "cli/test_cli.py",
    "cli/test_plan_cli.py", "cli/test_packaging.py", "server/test_server_cli.py", "server/test_serve_tier.py",
    "server/test_web_ui.py", "server/test_server_engine_openai.py",
    "kernels/test_notebook.py", "engine/test_speculative.py", "engine/test_engine_faults.py",
    "engine/test_agents_engine.py", "server/test_server_constrained.py", "engine/test_cpu_hang.py",
    "engine/test_prefill_in_place.py",  # compiles the prefill step twice (copy and in place) or per layer count
}
SLOW_TESTS = {
    "engine/test_adaptive_draft.py": {"test_eight_drafts_adaptive_equal_plain_greedy",
                                      "test_sixteen_ngram_drafts_equal_plain_greedy"},
    "bench/test_bench_speculation.py": {"test_oracle_through_the_engine_accepts_about_p",
                                        "test_step_mode_runs_the_mtp_head_and_gathers_ple_rows",
                                        "test_users_mode_drafts_with_the_synthetic_mtp_head_and_ple"},
    "engine/test_logprobs.py": {"test_logprobs_match_numpy_log_softmax"},
    "engine/test_constraints.py": {"test_constrained_answers_follow_their_grammar"},
    "bench/test_bench_agents.py": {"test_tiny_agents_run_on_the_demo_model"},
    "engine/test_mesh.py": {"test_mesh_matches_one_device"},  # a process per mesh, compiling its own steps
    "engine/test_engine.py": {"test_batched_equals_alone_together_and_staggered",
                              "test_bf16_cache_on_a_float32_model", "test_prefix_cache_hit_is_exact",
                              "test_sampling_is_reproducible_and_independent_of_batch"},
    "engine/test_engine_overlap.py": {"test_cancelling_one_request_leaves_the_others_exact",
                                      "test_a_short_prompt_bursts_beside_a_decoder",  # the policy's test is quick
                                      "test_overlap_off_takes_the_plain_path",
                                      "test_overlapped_decode_equals_the_plain_api"},
    "host/test_host_experts.py": {"test_matches_float64_reference"},
    "host/test_host_tier.py": {"test_placement_raises_hit_rate_and_keeps_outputs", "test_split_matches_all_resident"},
    "host/test_host_numba.py": {"test_model_with_a_numba_host_tier_matches_all_resident"},
    "host/test_expert_stream.py": {"test_model_split_matches_all_resident"},
    "host/test_expert_stream_bench.py": {"test_tier_mode_streams"},
    "kernels/test_decode_attention.py": {"test_model_through_the_kernel_matches_the_fixture"},
    "kernels/test_flash_prefill.py": {"test_model_through_the_kernel_matches_transformers",
                                      "test_model_through_cudnn_matches_transformers"},
    "kernels/test_kv_quant.py": {"test_decode_reads_the_stored_bytes_and_scales",
                                 "test_quantized_kernel_in_interpret_mode_at_flash_next_shapes"},
    "kernels/test_fused_matvec.py": {"test_model_through_the_fused_kernels_matches_the_fixture"},
    "kernels/test_fused_conv_rule.py": {"test_bf16_projection_and_tail"},
    "kernels/test_hyper_mix.py": {"test_matches_numpy_f32", "test_model_through_the_kernels_matches_the_fixture",
                                  "test_prefolded_model_matches_the_fixture"},
    "kernels/test_onebit_kernel.py": {"test_jnp_paths_match_float64", "test_pallas_interpret_matches_float64",
                                      "test_pallas_lowers_to_triton_without_a_gpu"},
    "model/test_cache_dtype.py": {"test_fixture_logits_within_tolerance", "test_greedy_tokens_unchanged",
                                  "test_prefill_chunks_and_decode_see_the_same_bytes",
                                  "test_prefix_cut_carries_the_scales",
                                  "test_engine_serves_the_demo_from_an_int8_cache"},
    "model/test_attention_filled.py": {"test_greedy_tokens_unchanged_on_a_long_cache"},
    "model/test_model_parity.py": {"test_eos_inside_sequence", "test_greedy_generation",
                                   "test_padded_rows_match_separate_runs", "test_prefill_in_odd_chunks"},
    "server/test_server_engine.py": {"test_eight_concurrent_streams_match_sequential_runs"},
    "server/test_server_hardening.py": {"test_health_stays_fast_while_a_10_mb_prompt_is_tokenized"},
    "weights/test_layer_draft.py": {"test_layer_draft_is_the_source_model_truncated"},
    "weights/test_gguf_llama.py": {"test_logits_and_greedy_match_llama_cpp", "test_quantize_from_gguf_round_trip",
                                   "test_engine_serves_a_gguf"},
    "weights/test_gguf_bench.py": {"test_gguf_mode_times_loads_and_decodes"},
    "weights/test_quantize.py": {"test_converted_directory_equals_quantize_on_load",
                                 "test_more_planes_track_the_dense_model_better",
                                 "test_rerun_resumes_and_rewrites_half_written_parts"},
}


@pytest.fixture(scope="module")
def tokenizer():
    """The fixture tokenizer (tests/fixtures/tokenizer); a test file may define its own."""
    from server_helpers import fixture_tokenizer

    return fixture_tokenizer()


@pytest.fixture
def serve(tokenizer):
    """Server tests: start(script, context_length=4096, **engine kwargs) -> (server, engine), the real app (no API
    key, served as "demo") over a `LogprobEngine` (tests/server/fake_engines.py) answering `script`; every server
    started is stopped after the test. A test file may define its own `serve`."""
    from fake_engines import LogprobEngine
    from server_helpers import ServerThread

    from server.app import create_app

    servers = []

    def start(script="Hello there.", context_length=4096, **kwargs):
        engine = LogprobEngine(tokenizer, script, context_length=context_length, **kwargs)
        server = ServerThread(create_app(engine, tokenizer, served_name="demo", api_key=None,
                                         context_length=context_length))
        servers.append(server)
        return server, engine

    yield start
    for server in servers:
        server.stop()


def _has_gpu() -> bool:
    import jax

    return jax.default_backend() == "gpu"


def pytest_configure(config):
    if _has_gpu():
        import jax

        # Parity is checked in true float32: TF32 matmuls would flip near-tied router choices.
        jax.config.update("jax_default_matmul_precision", "highest")


# jax >= 0.11 lowers Pallas kernels for CUDA only with a GPU (or an abstract one) to read its compute capability;
# jax 0.10 lowers them on any machine. The tests that check the Triton lowering without a GPU skip there, saying so.
_NO_GPU_TO_LOWER_FOR = "No supported GPU devices found"


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if (call.when == "call" and report.failed and call.excinfo is not None
            and _NO_GPU_TO_LOWER_FOR in str(call.excinfo.value) and not _has_gpu()):
        import jax

        report.outcome = "skipped"
        report.longrepr = (str(item.fspath), item.location[1] or 0,
                           f"Skipped: jax {jax.__version__} cannot lower for CUDA without a GPU")


def _is_slow(item) -> bool:
    path = Path(str(item.fspath)).resolve().relative_to(Path(__file__).parent).as_posix()
    return path in SLOW_FILES or item.originalname in SLOW_TESTS.get(path, ())


def pytest_collection_modifyitems(config, items):
    for item in items:
        if _is_slow(item):
            item.add_marker(pytest.mark.slow)
    if any("gpu" in item.keywords for item in items) and not _has_gpu():
        skip = pytest.mark.skip(reason="needs a GPU (jax.default_backend() != 'gpu')")
        for item in items:
            if "gpu" in item.keywords:
                item.add_marker(skip)
