"""Test-session setup shared by every test module, and the test tiers.

Tiers are assigned here, in one place, by test module and test name (not by decorators in
each file), so that moving a test between tiers is a one-line change in this file:

    make test-fast        python -m pytest -m "not slow"   (the edit loop, < 3 min on 2 cores)
    make test             everything (what .ci/run runs), on TEST_WORKERS pytest-xdist workers
    python -m pytest -m triton | slurm | distributed | pipeline | lm_eval

``slow`` = anything outside the fast tier: every test that carries one of the other
markers, plus the tests named in SLOW_TESTS (measured with ``--durations``: seconds or
more on a quiet 2-core machine, mostly training runs and subprocess command lines).
Markers are registered in pyproject.toml.
"""

import os
import sys
import warnings

import pytest

# The tests run the Triton kernels (the key-query convolution, the experimental
# model.attn_impl=triton) on CPU tensors, in Triton's interpreter, GPU or not (on a GPU,
# scripts/bench_attention.py --device cuda runs them compiled). The variable must be set
# before the kernels are defined (first use).
os.environ.setdefault("TRITON_INTERPRET", "1")


def _worker_threads() -> int | None:
    """Each pytest-xdist worker's share of the cores (None outside xdist). With torch's
    default, one intra-op thread per core in every worker, N workers run N x cores OpenMP
    threads that spin against each other: on 2 cores with 2 workers the same tests took
    15-25% more CPU time (test_train_rundir, test_memory, test_train and test_gqa on -n 2:
    70 s against 62 s, and 98 s against 80 s on a busier machine), the tiny pipeline's
    jobs 1.7x."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers <= 1:
        return None
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, cores // workers)


# Set before torch starts its thread pool (and inherited by the subprocesses the tests run);
# an OMP_NUM_THREADS the caller set is left alone.
_THREADS = _worker_threads()
if _THREADS is not None and "OMP_NUM_THREADS" not in os.environ:
    os.environ["OMP_NUM_THREADS"] = str(_THREADS)
    if "torch" in sys.modules:  # imported by a plugin before this file: too late for the variable
        sys.modules["torch"].set_num_threads(_THREADS)

# Whole modules (paths relative to tests/) -> markers besides `slow`.
MODULE_MARKERS = {
    "test_slurm.py": ("slurm",),
    "distributed/test_train_distributed.py": ("distributed",),
    "distributed/test_train_reshard.py": ("distributed",),
    "test_eval_data_parallel.py": ("distributed",),
    "experimental/test_attn_triton.py": ("triton",),
    "experimental/test_attn_stored.py": ("triton",),
    "test_kq_conv_triton.py": ("triton",),
    "experimental/test_kernel_hazards.py": ("triton",),
    "experimental/test_triton_parity.py": ("triton",),
    # Liger-Kernel's Triton kernels, in the interpreter on CPU
    "test_mta_liger.py": ("triton",),
    "test_pipeline.py": ("pipeline",),
    "test_train_e2e.py": ("pipeline",),
    # lm-eval's task index (parsing ~15,000 YAMLs: 30 s and more before its cache exists)
    # or lm-eval's own command line
    "test_eval_lm_eval.py": ("lm_eval",),
    "test_eval_lm_eval_cli.py": ("lm_eval",),
    "test_eval_tasks.py": ("lm_eval",),
    "test_lm_eval_index_cache.py": ("lm_eval",),
}

# Single tests (module, test-function name: every parametrization) -> markers besides
# `slow`. Multi-rank tests inside otherwise fast modules, and subprocess command lines.
TEST_MARKERS = {
    ("test_data.py", "test_two_real_ranks_match_in_process_loaders"): ("distributed",),
    ("test_train_signals.py", "test_two_ranks_agree_and_read_only_on_logging_steps"): ("distributed",),
    ("experimental/test_roofline.py", "test_a_real_sm90_compile_counts_its_tensor_core_dot"): ("triton",),
    ("experimental/test_roofline.py", "test_the_shipped_kernel_compiles_for_an_h200_within_its_limits"): ("triton",),
    # the module's fixture runs a whole local pipeline in subprocesses (81.6 s of setup in the
    # fast tier on -n 2: pytest -m "not slow" --durations=30 --durations-min=5)
    ("test_pipeline_llama3.py", "test_plan_order_and_dependencies"): ("pipeline",),
    ("test_pipeline_llama3.py", "test_import_check_finetune_report"): ("pipeline",),
    ("test_pipeline_llama3.py", "test_rerun_skips_everything_and_a_changed_folder_reimports"): ("pipeline",),
    ("test_pipeline_llama3.py", "test_slurm_chain_import_check_train"): ("pipeline",),
}

# Tests (module, test-function name) that are slow for their own sake: seconds or more
# each on 2 cores (measured with --durations; see the module docstring).
SLOW_TESTS = {
    # command lines run as subprocesses (an interpreter start, imports, Hydra: seconds each)
    ("test_config_params.py", "test_params_cli_prints_json"),
    ("test_data_integrity.py", "test_prepare_fails_with_the_list_then_skip_keeps_the_rest"),
    ("test_eval_cli.py", "test_cli_lm_eval_tasks_on_local_data"),
    ("test_eval_cli.py", "test_cli_writes_results"),
    ("test_eval_cli.py", "test_errors_before_work"),
    ("test_eval_cli.py", "test_export_cli_help_and_one_line_error"),
    ("test_errors.py", "test_train_cli_fault_in_a_loader_keeps_its_traceback"),
    ("test_errors.py", "test_train_cli_user_errors_are_one_line"),
    ("test_eval_context.py", "test_refusal_is_one_line_rc2_and_extrapolate_allows_it"),
    ("test_eval_load_robust.py", "test_cli_errors_are_one_line"),
    ("test_hf_llama3.py", "test_import_holds_one_copy_of_the_weights"),
    ("test_hf_llama3.py", "test_import_names_a_missing_shard"),
    ("test_llama3_configs.py", "test_appendix_i_llama3_pipeline_dry_run_prints_plan_and_every_sbatch"),
    ("test_gpu_acceptance.py", "test_quick_cpu_run_writes_every_section"),
    ("test_generate_cli.py", "test_generate_command"),
    ("test_generate_cli.py", "test_generate_errors_and_help"),
    ("test_hf.py", "test_cli"),
    ("test_packaging.py", "test_model_data_train_import_without_the_extras"),
    ("test_mta_op.py", "test_the_op_imports_without_hydra_omegaconf_transformers_lm_eval_or_wandb"),
    ("test_pipeline_configs.py", "test_plain_run_dir_in_a_sweep_is_refused_before_any_job"),
    ("test_release.py", "test_convert_cli_composes_and_trains_from_release_checkpoint"),
    ("test_table5_small.py", "test_two_points_end_to_end"),
    ("test_toy.py", "test_killed_run_resumes_exactly"),
    ("test_toy.py", "test_script_sigterm_stops_workers_and_rerun_resumes"),
    ("test_train.py", "test_sbatch_dry_run"),
    ("test_conftest_groups.py", "test_a_shared_fixture_module_runs_on_one_xdist_worker"),
    ("test_train_rundir.py", "test_a_failed_start_leaves_no_run_dir"),
    ("test_trust_inputs.py", "test_the_commands_as_a_user_runs_them"),
    ("test_trust_inputs.py", "test_export_into_a_foreign_folder_needs_force_and_replaces_our_own"),
    ("test_train_validation.py", "test_progress_lines_without_a_tty"),
    # training runs, resumes, whole-config sweeps and end-to-end evaluations in-process
    ("test_eval_needle.py", "test_run_needle_end_to_end_on_tiny_model"),
    ("test_attn_impls.py", "test_blocked_model_traces_under_torch_compile"),
    # transformers' generate() (three families, beam search) and its Trainer (accelerate) on tiny models
    ("test_mta_hf.py", "test_generate_with_the_models_cache_equals_a_full_recompute"),
    ("test_mta_hf.py", "test_training_with_the_hf_trainer_lowers_the_loss"),
    ("test_data_integrity.py", "test_trainer_logs_the_bad_records"),
    ("test_memory.py", "test_shipped_experiments_fit_an_h200"),
    ("test_memory_measured.py", "test_preflight_matches_a_measured_cpu_step_for_baseline_and_mta"),
    ("test_weights_safety.py", "test_eval_pipeline_and_train_processes_refuse"),
    ("test_weights_safety.py", "test_train_eval_and_weights_do_not_import_the_release_converter"),
    ("test_release.py", "test_every_release_config_matches_our_experiment"),
    ("test_train_corrupt.py", "test_truncated_distcp_falls_back_to_the_previous_and_resumes_exactly"),
    ("test_train_signals.py", "test_ctrl_c_saves_at_the_interrupted_step_and_says_how_to_resume"),
    ("test_train_signals.py", "test_no_host_sync_between_logging_steps"),
    ("test_train_corrupt.py", "test_truncated_distcp_is_named_and_refused_with_on_corrupt_raise"),
    ("test_train_validation.py", "test_validation_matches_the_eval_ppl_on_the_same_weights"),
    ("test_train_metrics_history.py", "test_a_sigkill_during_the_rewrite_leaves_the_history_whole"),
    ("test_data_bad_counts.py", "test_trainer_metrics_have_the_counts_from_the_first_step"),
    ("test_train_nothing_lost.py", "test_twenty_double_starts_never_delete_the_winners_files"),
    ("test_train_nothing_lost.py", "test_resume_without_config_yaml_is_checked_against_the_checkpoints_config"),
    ("test_train_nothing_lost.py", "test_checkpoint_is_fsynced_before_it_is_marked_complete"),
    ("test_train_nothing_lost.py", "test_a_full_disk_is_one_line_and_leaves_no_partial_checkpoint"),
    ("test_train_nothing_lost.py", "test_an_unresolvable_env_var_is_one_line"),
    ("test_train_nothing_lost.py", "test_a_non_finite_loss_is_one_line_naming_the_checkpoint"),
    ("test_gpu_acceptance.py", "test_a_run_killed_mid_way_leaves_the_sections_it_finished"),
    ("test_attn_selfcheck.py", "test_a_wrong_and_a_nan_implementation_fall_back_with_one_line_each"),
    ("test_attn_selfcheck.py", "test_strict_refuses_naming_the_implementation"),
    ("test_attn_selfcheck.py", "test_the_trainer_runs_and_records_the_fallback"),
    ("test_attn_selfcheck.py", "test_strict_refuses_to_train_in_one_line_rc_2"),
    # trainers and evaluations as subprocesses; reports and exports of a few tiny runs
    ("test_provenance.py", "test_a_shard_replaced_between_run_and_resume_is_refused_then_accepted"),
    ("test_provenance.py", "test_evals_beside_a_trainer_that_saves_and_prunes_every_step_succeed"),
    ("test_provenance.py", "test_a_swapped_tokenizer_is_refused_by_resume_eval_and_a_stage_start"),
    ("test_provenance.py", "test_the_report_marks_rows_of_another_tokenizer_or_an_older_checkpoint"),
    ("test_provenance.py", "test_an_hf_export_records_what_its_weights_came_from"),
    # Inductor's C++ codegen (tens of seconds a graph on 2 cores)
    ("test_inductor.py", "test_the_compiled_block_under_inductor_matches_eager_without_breaks"),
    ("test_inductor.py", "test_distributed_compile_trains_under_inductor_like_eager"),
    # a venv of the GPU image's packages built from the registry, Triton 3.6's interpreter
    ("test_device_image.py", "test_the_trainer_and_kernels_run_with_only_the_image_and_its_wheels"),
}

# Modules with module- or session-scoped fixtures (built once, used by several tests): one
# pytest-xdist worker each (below). tests/test_conftest_groups.py keeps this list complete.
SHARED_FIXTURE_MODULES = {
    "test_eval_lm_eval.py", "test_eval_tasks.py", "test_pipeline.py", "test_pipeline_llama3.py", "test_slurm.py",
    "test_table5_small.py", "test_train_corrupt.py", "test_train_e2e.py", "test_train_rundir.py",
    "test_train_stop_phases.py", "test_train_validation.py",
}

# The order in which `make test` hands work to its pytest-xdist workers, longest first (it
# passes --no-loadscope-reorder, so work units go out in collection order; this order is
# applied on the workers only, a run without xdist keeps the files' order): the SLURM
# group, the critical path on one worker, then the other units of a minute or more
# (seconds: --durations on 2 cores), so that no worker starts a minutes-long test while
# the other one is finishing. Then the other shared-fixture groups, the rest of the slow
# tier, the fast tier. A module name stands for its group; (module, test) for one test.
LONGEST_FIRST = (
    "test_slurm.py",  # ~250 s: cluster jobs one after the other (~210 s), renderings
    "test_pipeline.py",  # the tiny pipeline (~90 s) and its reruns
    ("test_provenance.py", "test_evals_beside_a_trainer_that_saves_and_prunes_every_step_succeed"),  # ~55 s
    ("test_memory_measured.py", "test_preflight_matches_a_measured_cpu_step_for_baseline_and_mta"),  # ~50 s
    ("test_device_image.py", "test_the_trainer_and_kernels_run_with_only_the_image_and_its_wheels"),  # ~50 s
    ("distributed/test_train_distributed.py", "test_two_ranks_match_one_rank_on_the_same_global_batch"),  # ~45 s
    "test_inductor.py",  # ~45 s and ~35 s: Inductor's C++ codegen
    "test_pipeline_llama3.py",  # ~40 s fixture
    "test_table5_small.py",  # ~35 s
    ("test_gpu_acceptance.py", "test_quick_cpu_run_writes_every_section"),  # ~35 s
    ("test_eval_data_parallel.py", "test_two_ranks_equal_one_process"),  # ~30 s
)

# Warnings a test provokes on purpose without asserting them, ignored for that test only
# (pyproject.toml filters the two that come from tiny configs everywhere): anything else
# printed in the warnings summary is worth reading.
EXPECTED_WARNINGS = {
    # Inductor's CPU codegen calls it (torch 2.13), not our code
    ("test_inductor.py", "test_the_compiled_block_under_inductor_matches_eager_without_breaks"):
        "ignore:`torch.jit.script_method` is deprecated",
    ("test_inductor.py", "test_distributed_compile_trains_under_inductor_like_eager"):
        "ignore:`torch.jit.script_method` is deprecated",
    ("test_weights_safety.py", "test_eval_names_a_corrupt_checkpoint_and_its_fallback_in_one_line"):
        "ignore:.* is unreadable",
}


def _where(item) -> str:
    path = os.path.relpath(str(item.path), os.path.dirname(__file__))
    return path.replace(os.sep, "/")


def _schedule_rank(item) -> int:
    """Where an item goes in LONGEST_FIRST's order (sorted() keeps the rest in file order,
    so a module's tests stay together)."""
    module = _where(item)
    name = getattr(item, "originalname", None) or item.name.split("[")[0]
    for i, entry in enumerate(LONGEST_FIRST):
        if entry == module or entry == (module, name):
            return i
    n = len(LONGEST_FIRST)
    if module in SHARED_FIXTURE_MODULES:
        return n
    return n + 1 if item.get_closest_marker("slow") else n + 2


# tryfirst: pytest-xdist's workers read the xdist_group marks in their own hook of this name
@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    seen_modules, seen = set(), set()
    for item in items:
        module = _where(item)
        name = getattr(item, "originalname", None) or item.name.split("[")[0]
        seen_modules.add(module)
        seen.add((module, name))
        marks = set(MODULE_MARKERS.get(module, ())) | set(TEST_MARKERS.get((module, name), ()))
        # Triton's interpreter, wherever a test parametrizes over implementations
        if "triton" in item.name.split("[", 1)[-1] and "[" in item.name:
            marks.add("triton")
        if marks or (module, name) in SLOW_TESTS or item.get_closest_marker("slow"):
            marks.add("slow")
        for m in sorted(marks):
            item.add_marker(getattr(pytest.mark, m))
        # `make test` runs the suite on several pytest-xdist workers (--dist loadgroup): the
        # SLURM tests share one single-node cluster and its queue, so they run on one worker,
        # one after the other, as they would alone; a module whose fixtures are built once per
        # module (a trained tiny run, a pipeline) keeps its tests on one worker, so that the
        # fixture is built once, not once per worker
        if config.pluginmanager.hasplugin("xdist") and ("slurm" in marks or module in SHARED_FIXTURE_MODULES):
            item.add_marker(pytest.mark.xdist_group(module))
        if (module, name) in EXPECTED_WARNINGS:
            item.add_marker(pytest.mark.filterwarnings(EXPECTED_WARNINGS[(module, name)]))
    if hasattr(config, "workerinput"):  # a pytest-xdist worker: its order is the schedule's
        items[:] = sorted(items, key=_schedule_rank)
    # A renamed test would silently fall into the fast tier: name the stale entries.
    listed = set(SLOW_TESTS) | set(TEST_MARKERS) | set(EXPECTED_WARNINGS) | {
        e for e in LONGEST_FIRST if isinstance(e, tuple)}
    stale = [f"{m}::{n}" for m, n in sorted(listed) if m in seen_modules and (m, n) not in seen]
    if stale and not config.getoption("keyword") and not config.getoption("markexpr", ""):
        warnings.warn(pytest.PytestConfigWarning(
            f"tests/conftest.py names tests that do not exist (renamed?): {stale}"), stacklevel=1)
