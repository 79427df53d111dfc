"""Shared test settings. Fixtures that only one test file uses stay in that file.

The fast tier (``make test-fast``) is tests/ without the notebooks (nbval), the browser, the site and
every test marked ``slow``: by its own decorator, or by :data:`SLOW` below, the one list of what the
tier leaves out. ``make test`` (CI) runs everything.
"""

import os
import warnings

import pytest
import torch
from hypothesis import HealthCheck, settings

# Property tests run few, small examples: the suite must stay fast on a 2-core CPU,
# and Triton's interpreter has a fixed cost per operation.
settings.register_profile(
    "attnlab",
    max_examples=int(os.environ.get("ATTNLAB_HYPOTHESIS_EXAMPLES", "25")),
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
    derandomize=True,
)
settings.load_profile("attnlab")


@pytest.fixture(scope="module")
def one_thread():
    """Torch on one thread for a module of tiny models (``pytestmark = pytest.mark.usefixtures("one_thread")``):
    faster on small matrices, and no stall when the 2-core CPU is shared."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def large_fp16_qkv():
    """A maker of float16 q, k, v (1, 2, n, d) of magnitude about 100 (as peers' edge-case suites use)
    whose scores are large (about 2e4 to 3e4, where float16's spacing is 16 or 32) but differ by tens
    along a row, so the softmax is not one-hot: the keys share one large direction. Used by the
    float16 tests of standard attention and of the flash kernels' gradients."""

    def make(d, n=48, seed=0):
        g = torch.Generator().manual_seed(seed)
        q = 100 * torch.randn(1, 2, n, d, generator=g)
        k = 100 * torch.randn(1, 2, 1, d, generator=g) + 0.2 * torch.randn(1, 2, n, d, generator=g)
        v = 100 * torch.randn(1, 2, n, d, generator=g)
        return [t.half() for t in (q, k, v)]

    return make


# ---------------------------------------------------------------------------------------
# The fast tier's list. Each test below took a second or more in a timed run of the tier on
# this course's 2-core machine under load (pytest --durations=0; about half that quiet), less
# a few kept on purpose because they are the only check of something (the import cycles, the
# interpreter's thread-scoped patches, the native compile for sm_80, the float16 rule of the
# block-sparse kernel, the traced float16 and GQA traffic, one case each of the even-length and
# block-pattern kernels, three of exercise 09's mistakes). What stays: the library, every kernel,
# the masks, the grader's unit checks and most mistake tests of every exercise, at small sizes.
# File name -> None (the whole file) or the test names (a name without [params] is every case).
# ---------------------------------------------------------------------------------------
SLOW = {
    "test_approx.py": (
        "test_longest_sequence_finds_the_boundary",
    ),
    "test_benchmarks_cpu.py": None,
    "test_benchmarks_decode.py": None,
    "test_cli.py": (
        "test_each_command_module_needs_only_required_dependencies[checkpoints]",
        "test_each_command_module_needs_only_required_dependencies[gpt-checkpoint]",
    ),
    "test_distributed.py": (
        "test_exact_against_sdpa_and_bytes_equal_the_formulas",
        "test_the_triton_kernel_as_the_per_shard_attention",
        "test_launch_returns_every_rank_result",
        "test_an_error_on_one_rank_stops_the_others_and_is_raised_with_its_traceback",
        "test_ragged_shards_are_refused_on_every_rank",
        "test_ulysses_needs_heads_divisible_by_the_world_size",
        "test_the_benchmark_prints_bytes_equal_to_the_formulas",
    ),
    "test_exercise_01.py": (
        "test_the_crossing_appears_from_other_seeds_too",
    ),
    "test_exercise_03.py": (
        "test_wrong_implementation_fails_with_its_diagnosis[variance-experiment-divided-by-d]",
        "test_wrong_implementation_fails_with_its_diagnosis[variance-experiment-scaled-wrong-way]",
        "test_wrong_implementation_fails_with_its_diagnosis[variance-experiment-std-not-var]",
        "test_wrong_implementation_fails_with_its_diagnosis[variance-experiment-mean-not-var]",
        "test_wrong_implementation_fails_with_its_diagnosis[variance-experiment-summed-over-pairs]",
        "test_wrong_implementation_fails_with_its_diagnosis[variance-experiment-no-sum]",
        "test_wrong_implementation_fails_with_its_diagnosis[variance-experiment-same-draw]",
    ),
    "test_exercise_04.py": (
        "test_the_experiment_tolerance_separates_the_heads_from_a_blend",
    ),
    "test_exercise_05.py": (
        "test_wrong_implementation_fails_with_its_diagnosis[naive-time-experiment-copy-counted-once]",
        "test_wrong_implementation_fails_with_its_diagnosis[naive-time-experiment-milliseconds]",
        "test_wrong_implementation_fails_with_its_diagnosis[naive-time-experiment-softmax-skipped]",
        "test_a_right_experiment_passes_and_reports_the_miss",
        "test_an_experiment_that_times_something_else_fails_on_the_timing",
    ),
    "test_exercise_06.py": (
        "test_exercise_06_with_an_unmasked_part_1_runs_to_the_end_with_the_mask_named",
    ),
    "test_exercise_07.py": (
        "test_wrong_implementation_fails_with_its_diagnosis[tiled-forward-causal-blocks-not-skipped]",
        "test_wrong_implementation_fails_with_its_diagnosis[flash-kernel-loop-acc-not-rescaled]",
        "test_wrong_implementation_fails_with_its_diagnosis[flash-kernel-loop-scale-forgotten]",
        "test_wrong_implementation_fails_with_its_diagnosis[flash-kernel-loop-masked-keys-not-masked]",
        "test_wrong_implementation_fails_with_its_diagnosis[flash-kernel-loop-causal-off-by-one]",
        "test_wrong_implementation_fails_with_its_diagnosis[flash-kernel-loop-causal-diagonal-unmasked]",
        "test_wrong_implementation_fails_with_its_diagnosis[flash-kernel-loop-lse-missing-max]",
        "test_wrong_implementation_fails_with_its_diagnosis[flash-kernel-loop-scale-argument-ignored]",
        "test_wrong_implementation_fails_with_its_diagnosis[flash-kernel-loop-causal-positions-in-tile]",
        "test_wrong_implementation_fails_with_its_diagnosis[traffic-experiment-causal-ignored]",
        "test_wrong_implementation_fails_with_its_diagnosis[tiled-backward-holds-n-by-n]",
        "test_wrong_implementation_fails_with_its_diagnosis[dkdv-kernel-d-not-subtracted]",
        "test_wrong_implementation_fails_with_its_diagnosis[dkdv-kernel-ds-sign-flipped]",
        "test_wrong_implementation_fails_with_its_diagnosis[dkdv-kernel-grad-scale-forgotten]",
        "test_wrong_implementation_fails_with_its_diagnosis[dkdv-kernel-recompute-scale-forgotten]",
        "test_wrong_implementation_fails_with_its_diagnosis[dkdv-kernel-causal-mask-missing-in-backward]",
        "test_wrong_implementation_fails_with_its_diagnosis[dkdv-kernel-causal-blocks-not-skipped]",
        "test_wrong_implementation_fails_with_its_diagnosis[dkdv-kernel-padded-rows-not-zeroed]",
        "test_wrong_implementation_fails_with_its_diagnosis[dkdv-kernel-scale-argument-ignored]",
        "test_the_switch_free_versions_pass[tiled-forward]",
        "test_the_switch_free_versions_pass[flash-kernel-loop]",
        "test_the_switch_free_versions_pass[traffic-experiment]",
        "test_the_switch_free_versions_pass[tiled-backward]",
        "test_the_switch_free_versions_pass[dkdv-kernel]",
        "test_the_experiment_s_tolerance_is_one_percent",
    ),
    "test_exercise_08.py": (
        "test_the_learner_style_loop_passes_and_a_fake_kernel_is_refused",
        "test_the_learner_style_flex_kernel_passes_and_a_fake_kernel_is_refused",
        "test_the_experiment_passes_and_its_tolerance_is_tight",
        "test_wrong_implementation_fails_with_its_diagnosis[partial-blocks-full-treated-as-empty]",
        "test_wrong_implementation_fails_with_its_diagnosis[partial-blocks-mask-loaded-for-full-blocks]",
        "test_wrong_implementation_fails_with_its_diagnosis[partial-blocks-extra-traffic]",
        "test_wrong_implementation_fails_with_its_diagnosis[partial-blocks-mask-stride-ignored]",
        "test_wrong_implementation_fails_with_its_diagnosis[bytes-vs-density-dense-bytes]",
        "test_wrong_implementation_fails_with_its_diagnosis[bytes-vs-density-density-of-elements]",
        "test_wrong_implementation_fails_with_its_diagnosis[bytes-vs-density-density-partial-only]",
        "test_wrong_implementation_fails_with_its_diagnosis[bytes-vs-density-k-bytes-only]",
        "test_wrong_implementation_fails_with_its_diagnosis[bytes-vs-density-elements-not-bytes]",
        "test_wrong_implementation_fails_with_its_diagnosis[bytes-vs-density-total-bytes]",
    ),
    "test_exercise_09.py": (
        "test_wrong_implementation_fails_with_its_diagnosis[capstone-kernel-acc-not-rescaled]",
        "test_wrong_implementation_fails_with_its_diagnosis[capstone-kernel-scale-forgotten]",
        "test_wrong_implementation_fails_with_its_diagnosis[capstone-kernel-not-normalised]",
        "test_wrong_implementation_fails_with_its_diagnosis[capstone-kernel-causal-diagonal-excluded]",
        "test_wrong_implementation_fails_with_its_diagnosis[capstone-kernel-causal-mask-missing]",
        "test_wrong_implementation_fails_with_its_diagnosis[capstone-kernel-not-causal]",
        "test_wrong_implementation_fails_with_its_diagnosis[capstone-kernel-loop-bound-block-n]",
        "test_wrong_implementation_fails_with_its_diagnosis[capstone-kernel-dense-loop]",
        "test_wrong_implementation_fails_with_its_diagnosis[capstone-kernel-out-of-bounds-load]",
        "test_wrong_implementation_fails_with_its_diagnosis[capstone-kernel-out-of-bounds-store]",
        "test_wrong_implementation_fails_with_its_diagnosis[capstone-train-first-step-differs0]",
        "test_wrong_implementation_fails_with_its_diagnosis[capstone-train-first-step-differs1]",
        "test_right_answers_written_differently_pass",
        "test_the_experiment_tolerance_passes_rounding_and_fails_a_real_difference",
    ),
    "test_gpt.py": (
        "test_shapes_loss_and_generation",
        "test_block_sparse_with_every_tile_is_dense_attention_and_a_local_mask_is_the_masked_reference",
        "test_local_plus_global_trains_through_the_kernel",
        "test_shipped_checkpoint_is_small_matches_its_recipe_and_learnt_the_corpus",
        "test_short_run_reproduces_the_first_losses_of_the_shipped_checkpoint",
        "test_cli_route_writes_a_checkpoint",
    ),
    "test_gpt_decode.py": (
        "test_cached_generation_gives_the_tokens_of_the_cache_free_path[mha-flash]",
        "test_cached_generation_gives_the_tokens_of_the_cache_free_path[gqa-flash]",
        "test_cached_generation_gives_the_tokens_of_the_cache_free_path[mqa-flash]",
        "test_cached_generation_gives_the_tokens_of_the_cache_free_path[gqa-rope-sdpa]",
        "test_cached_generation_gives_the_tokens_of_the_cache_free_path[gqa-rope-reference]",
        "test_cached_generation_gives_the_tokens_of_the_cache_free_path[gqa-rope-flash]",
        "test_past_block_size_both_paths_slide_the_same_window",
        "test_rolling_cache_is_the_sink_window_mask",
    ),
    "test_grading_parts.py": (
        "test_the_reference_itself_passes[alignment-crossing]",
        "test_the_reference_itself_passes[loop-timing]",
        "test_the_reference_itself_passes[variance-experiment]",
        "test_the_reference_itself_passes[head-specialisation]",
        "test_the_reference_itself_passes[traffic-experiment]",
        "test_the_reference_itself_passes[tiled-backward]",
        "test_the_reference_itself_passes[capstone-local-global]",
        "test_the_grader_s_reference_is_refused_as_an_answer[split-merge]",
    ),
    "test_iomodel.py": (
        "test_model_equals_traced_bytes_of_the_kernels_with_gqa[False-1]",
        "test_model_equals_traced_bytes_of_the_kernels_with_gqa[False-2]",
        "test_model_equals_traced_bytes_of_the_kernels_with_gqa[True-1]",
    ),
    "test_kernels_attention.py": (
        "test_flash_even_lengths_skip_masks_exactly[False-64-64-16-32]",
        "test_flash_even_lengths_skip_masks_exactly[False-64-128-32-16]",
        "test_flash_even_lengths_skip_masks_exactly[False-128-32-16-16]",
        "test_flash_even_lengths_skip_masks_exactly[False-96-96-32-16]",
        "test_flash_even_lengths_skip_masks_exactly[False-64-96-16-32]",
        "test_flash_even_lengths_skip_masks_exactly[True-64-64-16-32]",
        "test_flash_even_lengths_skip_masks_exactly[True-64-128-32-16]",
        "test_flash_even_lengths_skip_masks_exactly[True-128-32-16-16]",
        "test_flash_even_lengths_skip_masks_exactly[True-96-96-32-16]",
        "test_flash_even_lengths_skip_masks_exactly[True-64-96-16-32]",
        "test_flash_large_logits_stay_finite",
        "test_flash_fp16_looser_tolerance",
        "test_fp16_gradients_with_large_inputs_keep_flash_attentions_rule[64-False-block-sparse]",
        "test_fp16_gradients_with_large_inputs_keep_flash_attentions_rule[64-True-block-sparse]",
        "test_fp16_gradients_with_large_inputs_keep_flash_attentions_rule[128-False-block-sparse]",
        "test_standard_attention_matches_sdpa",
    ),
    "test_kernels_block_sparse.py": (
        "test_pattern_matches_dense_masked_attention[False-causal]",
        "test_pattern_matches_dense_masked_attention[False-full]",
        "test_pattern_matches_dense_masked_attention[False-global]",
        "test_pattern_matches_dense_masked_attention[False-intersection]",
        "test_pattern_matches_dense_masked_attention[False-local]",
        "test_pattern_matches_dense_masked_attention[False-random]",
        "test_pattern_matches_dense_masked_attention[False-strided]",
        "test_pattern_matches_dense_masked_attention[False-union]",
        "test_pattern_matches_dense_masked_attention[True-causal]",
        "test_pattern_matches_dense_masked_attention[True-full]",
        "test_pattern_matches_dense_masked_attention[True-intersection]",
        "test_pattern_matches_dense_masked_attention[True-local]",
        "test_pattern_matches_dense_masked_attention[True-strided]",
        "test_pattern_matches_dense_masked_attention[True-union]",
        "test_flex_attention_agrees_with_same_block_mask",
        "test_block_mask_inspection",
    ),
    "test_kernels_decode.py": (
        "test_exact_against_the_reference_over_the_cache[5-1-4-4]",
        "test_exact_against_the_reference_over_the_cache[5-1-4-2]",
        "test_exact_against_the_reference_over_the_cache[5-3-4-4]",
        "test_paged_cache_equals_the_contiguous_one[16-3]",
        "test_paged_cache_equals_the_contiguous_one[16-8]",
        "test_paged_cache_equals_the_contiguous_one[32-8]",
        "test_the_merge_is_the_online_softmax_rescaling",
        "test_traced_bytes_equal_iomodel[4-1-True]",
        "test_traced_bytes_equal_iomodel[4-3-False]",
        "test_traced_bytes_equal_iomodel[4-3-True]",
        "test_traced_bytes_equal_iomodel[2-1-False]",
        "test_traced_bytes_equal_iomodel[2-1-True]",
        "test_traced_bytes_equal_iomodel[2-3-False]",
        "test_traced_bytes_equal_iomodel[2-3-True]",
        "test_traced_bytes_equal_iomodel[1-3-True]",
    ),
    "test_kernels_flex.py": (
        "test_flash_attention_gqa_equals_sdpa[4-2-70-50-True]",
        "test_flash_attention_gqa_equals_sdpa[3-1-33-65-False]",
        "test_offsets_past_2_to_the_31_on_a_view_with_huge_strides",
    ),
    "test_kernels_minimal.py": (
        "test_tutorial_softmax_matches_reference[shape0]",
        "test_step_b_masked_any_n[16-16-129]",
        "test_step_traffic_equals_iomodel_without_the_lse",
    ),
    "test_lab_settings.py": (
        "test_jupyter_notebook_and_lab_start_as_root_and_not_as_root",
    ),
    "test_memory.py": (
        "test_flash_forward_and_backward_equal_iomodel[shape0-False]",
        "test_flash_forward_and_backward_equal_iomodel[shape0-True]",
        "test_standard_forward_and_backward_equal_iomodel",
        "test_trace_ops_counts_unfused_softmax_like_triton_tutorial",
    ),
    "test_packaging.py": (
        "test_source_checkout_maps_kernels_to_the_top_level_folder",
        "test_cli_runs_as_module_and_lists_commands",
    ),
    "test_seq2seq.py": (
        "test_shapes",
        "test_padding_does_not_change_a_translation[RNNsearch]",
        "test_one_training_step_reduces_the_loss[RNNsearch]",
        "test_training_loop_is_seeded",
        "test_shipped_weights_are_the_best_evaluation",
        "test_checkpoints_load_decode_and_rnnsearch_wins_on_long_sentences",
        "test_command_reproduces_the_start_of_the_shipped_training",
        "test_cli_command_writes_checkpoints",
    ),
    "test_stdlib_text.py": (
        "test_a_changed_file_is_reported_and_odd_characters_are_mapped",
    ),
    "test_tiled_threads.py": (
        "test_peak_memory_counts_tiles_made_on_the_thread_pool",
    ),
    "test_transformer.py": (
        "test_training_reduces_the_loss_and_is_deterministic",
        "test_cosine_schedule_and_evaluations_during_training",
    ),
    "test_widgets.py": (
        "test_attention_map_layers_heads_and_query",
        "test_attention_map_batch_from_multihead_attention_and_from_a_list",
        "test_scaling_explorer_shows_why_scaling_keeps_gradients",
        "test_memory_traffic_counters_reach_the_trace_totals",
        "test_memory_traffic_several_heads_and_sram_study",
        "test_block_mask_editor_presets_match_the_kernels_helpers",
        "test_block_mask_editor_clicks_costs_and_kernel_mask",
        "test_stored_notebook_output_carries_a_png_that_nbconvert_shows",
        "test_block_mask_editor_greys_out_the_parameters_its_preset_ignores",
        "test_memory_traffic_says_its_sram_slider_is_in_the_folded_panel",
        "test_every_widget_hides_the_broken_link_icons_of_a_saved_view",
    ),
}


def _slow_entry(nodeid):
    """The SLOW entry matching ``nodeid`` ("tests/file.py::name[params]"), or None."""
    path, _, name = nodeid.partition("::")
    names = SLOW.get(os.path.basename(path), ())
    if names is None:
        return os.path.basename(path)
    for entry in names:
        if name == entry or ("[" not in entry and name.startswith(entry + "[")):
            return entry
    return None


@pytest.hookimpl(tryfirst=True)   # before -m "not slow" deselects
def pytest_collection_modifyitems(config, items):
    used = set()
    for item in items:
        entry = _slow_entry(item.nodeid)
        if entry is not None:
            item.add_marker(pytest.mark.slow)
            used.add((os.path.basename(item.nodeid.partition("::")[0]), entry))
    # an entry that names no collected test (renamed or removed) is said, when its file was collected
    files = {os.path.basename(i.nodeid.partition("::")[0]) for i in items}
    stale = [f"{f}::{n}" for f, names in SLOW.items() if f in files and names is not None
             for n in names if (f, n) not in used]
    if stale:
        warnings.warn("tests/conftest.py SLOW names tests that were not collected: " + ", ".join(stale))
