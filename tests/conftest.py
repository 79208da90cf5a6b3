"""Every test sees 8 simulated CPU devices. XLA reads the flag once, when JAX initialises its backend, so it is set
here, before any test module imports jax (with the compile-time flags of tests/xla_flags.py).

The suite also shares one persistent compilation cache, fresh for each pytest run: many tests compile the very
programs another test (or a resumed script) compiled before, and XLA:CPU compiling is most of the suite's time.
pytest's own process creates the directory before the xdist workers start; they and every script the tests start
inherit it through the environment (JAX_COMPILATION_CACHE_DIR). Its keys hold the whole HLO, compile options and
XLA flags, so a hit is the program that would have been compiled (a read that races another process's write of
the same entry is a warning and a fresh compile in JAX). JAX_ENABLE_COMPILATION_CACHE=false turns it off."""
import atexit
import os
import shutil
import tempfile

from tests.xla_flags import cpu_devices

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + cpu_devices(8)).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
if "JAX_COMPILATION_CACHE_DIR" not in os.environ and "PYTEST_XDIST_WORKER" not in os.environ:
    _cache_dir = tempfile.mkdtemp(prefix="redline-test-compile-cache-")
    atexit.register(shutil.rmtree, _cache_dir, ignore_errors=True)
    os.environ["JAX_COMPILATION_CACHE_DIR"] = _cache_dir
# Every program, however small or quick to compile (the defaults skip those under a second).
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")

import jax  # noqa: E402
import pytest  # noqa: E402


@pytest.fixture(scope="session", autouse=True)
def _eight_devices():
    assert jax.device_count() == 8, f"tests need 8 simulated devices, got {jax.device_count()}"


# CI's time budget (`make test` under 10 minutes on 2 cores): these tests run with `-m slow` (`make test-slow`) only.
# Each is one of several of its kind (another variant, family or mesh of the same property stays in the default
# run), chosen by the suite's measured durations; a test file's own `@pytest.mark.slow` marks the rest.
SLOW_FOR_CI_TIME = {
    # the stateful-stream protocol stays by default in the restart and Grain tests of test_iterator_state.py
    "test_iterator_state.py::test_without_get_state_a_restart_reads_the_trained_examples_again_and_ends_the_same",
    "test_iterator_state.py::test_a_mixture_resumes_through_fit_from_its_state",
    # GPipe's tick count: the interleaved ones stay
    "test_pipeline.py::test_compiled_tick_loops_follow_the_schedule[1-2]",
    "test_moe.py::test_expert_parallel_trainer_step_equals_one_device[mesh3-shard_map-full]",
    "test_moe.py::test_lora_on_the_experts_merges_exactly_and_is_split_with_them",
    "test_scripts.py::test_train_lm_fine_tunes_resumes_and_generate_reads_workdir_and_hf_dir",
    "test_gemma.py::test_logits_match_transformers_and_round_trip[gemma2-False]",
    "test_gemma.py::test_scanned_remat_stack_keeps_logits_and_gradients[gemma2]",
    "test_lora.py::test_peft_adapter_round_trip_and_transformers_reads_it[llama-targets0]",
    "test_moe.py::test_trainer_step_on_2x2x2_equals_one_device",
    "test_plan.py::test_script_prints_one_json_line_of_the_run_defaults_and_rejects_a_bad_mesh",
    "test_gemma.py::test_sharded_checkpoint_streams_onto_a_mesh_and_lora_on_an_int8_base[gemma3]",
    "test_moe.py::test_quantized_experts_are_close_to_float_and_load_quantised_as_read[nf4-0.25]",
    "test_pipeline.py::test_pipelined_stack_equals_the_plain_one[llama-mesh0-options0]",
    "test_moe.py::test_expert_parallel_layer_equals_the_dense_reference_and_exchanges_by_all_to_all[mesh1]",
    "test_context_parallel.py::test_llama_on_a_context_mesh_beyond_its_heads_has_the_unsplit_gradients",
    "test_gemma.py::test_greedy_generate_matches_transformers_past_the_window[gemma3-False]",
    "test_moe.py::test_lora_on_an_int8_mixture_on_an_expert_mesh_trains_the_adapters_alone",
    "test_models.py::test_generate_eos_sampling_and_one_compile_per_bucket",
    "test_gemma.py::test_logits_match_transformers_and_round_trip[gemma3-False]",
    "test_lora.py::test_quantised_base_is_close_to_float_and_loads_quantised_as_read[nf4]",
    "test_models.py::test_beam_search_matches_transformers[llama-gqa-2.0]",
    "test_pipeline.py::test_stacked_layers_split_over_stage_and_only_activations_move",
    "test_moe.py::test_moe_layer_equals_a_dense_per_token_reference[True]",
    "test_flash_attention.py::test_invisible_kv_blocks_are_skipped_not_just_masked[mosaic_tpu-256-segments]",
    "test_gemma.py::test_greedy_generate_matches_transformers_past_the_window[gemma2-True]",
    "test_moe.py::test_quantized_experts_are_close_to_float_and_load_quantised_as_read[int8-0.02]",
    "test_flash_attention.py::test_matches_jax_nn[mosaic_tpu-causal-seg-h4kv2-t32s64-d128-bfloat16]",
    "test_mistral.py::test_load_sharded_train_and_generate",
    "test_flash_attention.py::test_matches_jax_nn[mosaic_tpu-causal-seg-h4kv1-t40s40-d64-float32]",
    "test_fit_patterns.py::test_grad_fn_replaces_the_engines_differentiation_on_every_step_kind[zero3]",
    "test_flash_attention.py::test_invisible_kv_blocks_are_skipped_not_just_masked[mosaic_tpu-256-causal]",
    "test_rlhf.py::test_reward_is_the_score_head_at_the_final_token",
    "test_moe.py::test_logits_and_load_balancing_match_transformers_and_round_trip[mixtral-True]",
    "test_models.py::test_beam_search_pads_after_eos_reorders_an_int8_cache_and_checks_its_settings",
    "test_rlhf.py::test_reward_loss_is_bradley_terry_and_training_ranks_the_sorted_list_first",
    "test_paged_generate.py::test_int8_pages_equal_generates_int8_cache",
    "test_fused_matmul.py::test_fused_matmul_matches_reference[mosaic_tpu-float32-ragged]",
    "test_context_parallel.py::test_llama_with_triton_kernels_on_a_context_mesh_has_the_unsplit_gradients",
    "test_plan.py::test_embedding_table_is_gathered_when_the_lookups_outnumber_its_rows",
    "test_fused_matmul.py::test_linear_cross_entropy_matches_reference[mosaic_tpu-float32-ragged]",
    "test_fit_patterns.py::test_grad_fn_replaces_the_engines_differentiation_on_every_step_kind[zero2]",
    "test_fused_matmul.py::test_gated_mlp_matches_reference[mosaic_tpu-float32-ragged]",
    "test_models.py::test_dropout_only_in_training_calls[t5-False-attention_dropout_rate]",
    "test_lora.py::test_fresh_adapters_change_nothing_and_merging_equals_the_adapted_model[llama-options1]",
    "test_lora.py::test_int8_base_through_the_fused_kernels_equals_the_plain_path[xla-False]",
    "test_models.py::test_dropout_only_in_training_calls[opt-True-dropout_rate]",
    "test_qwen.py::test_lora_on_an_int8_base_loaded_onto_a_mesh",
    "test_grouped_matmul.py::test_grouped_matmul_matches_reference[mosaic_tpu-float32-ragged]",
    "test_readme.py::test_three_function_example_runs[1]",
    "test_models.py::test_remat_keeps_logits_and_gradients[dots]",
    "test_flash_attention.py::test_dropout_matches_autodiff_of_the_materialised_oracle[triton-causal-seg-h4kv1-t40s40-d64-float32]",
    "test_flash_attention.py::test_dropout_matches_autodiff_of_the_materialised_oracle[triton-full-seg-h2kv1-t24s56-d128-float32]",
    "test_models.py::test_pallas_kernels_inside_the_model_match_plain_path[llama-triton-full-True]",
    "test_grouped_matmul.py::test_pallas_kernel_on_a_mesh_equals_the_reference",
    "test_paged_generate.py::test_window_shorter_than_the_outputs",
    "test_fused_matmul.py::test_linear_cross_entropy_matches_reference[triton-float32-aligned]",
    "test_models.py::test_dropout_only_in_training_calls[llama-True-dropout_rate]",
    "test_mistral.py::test_memory_plan_of_a_tiny_model[mistral]",
    "test_flash_attention.py::test_dropout_matches_autodiff_of_the_materialised_oracle[triton-causal-noseg-h4kv2-t33s50-d64-float32]",
    "test_compute_dtype.py::test_bf16_compute_makes_every_matmul_bf16[t5]",
    "test_flash_attention.py::test_decode_attention_equals_flash_attention_over_the_filled_cache[xla]",
    "test_fit_patterns.py::test_any_pytree_batch_trains_evaluates_and_predicts_like_a_flat_one[shard_map]",
    "test_fused_matmul.py::test_linear_cross_entropy_matches_reference[triton-bfloat16-ragged]",
    "test_preference.py::test_reference_log_probs_in_the_compute_dtype_give_a_zero_margin_at_the_start",
    "test_fused_matmul.py::test_int8_weights_match_the_dequantised_reference[triton-bfloat16]",
    "test_mistral.py::test_logits_match_transformers_and_round_trip[window-False]",
    "test_models.py::test_dropout_only_in_training_calls[gptj-False-dropout_rate]",
    "test_flash_attention.py::test_dropout_matches_autodiff_of_the_materialised_oracle[xla-causal-noseg-h4kv2-t33s50-d64-float32]",
    "test_paged_attention.py::test_equals_decode_attention_on_the_contiguous_cache[xla-bf16-window-softcap]",
    "test_mistral.py::test_greedy_generate_matches_transformers_past_the_window[False]",
    "test_models.py::test_segment_positions_and_named_configs",
    "test_fused_matmul.py::test_linear_cross_entropy_matches_reference[xla-float32-ragged]",
    "test_paged_generate.py::test_shared_prompt_pages",
    "test_models.py::test_fused_mlp_kernels_match_plain_path[llama]",
    "test_paged_attention.py::test_equals_decode_attention_on_the_contiguous_cache[xla-f32]",
    "test_flash_attention.py::test_dropout_matches_autodiff_of_the_materialised_oracle[xla-causal-seg-h4kv1-t40s40-d64-float32]",
    "test_models.py::test_greedy_generate_matches_transformers[t5-v1.0]",
    "test_moe.py::test_logits_and_load_balancing_match_transformers_and_round_trip[qwen3_moe-False]",
    "test_kernels_on_mesh.py::test_pallas_kernel_on_a_mesh_equals_the_reference[attention]",
    "test_scripts.py::test_a_run_stopped_by_a_signal_exits_128_plus_it_with_its_checkpoint",
    "test_examples.py::test_maml_adapts_to_held_out_classes_well_above_chance",
    "test_examples.py::test_ppo_raises_the_return_and_every_fit_trains",
    "test_examples.py::test_dp_sgd_clips_each_example_adds_the_noise_once_and_learns",
    "test_scripts.py::test_bench_kernels_prints_every_table",
    "test_scripts.py::test_a_full_disk_ends_with_one_line_and_status_1",
    "test_rlhf.py::test_grpo_trains_the_actor_alone_and_its_workdir_restores",
    "test_rlhf.py::test_grpo_rollout_groups_and_its_loss",
    "test_rlhf.py::test_with_lora_the_score_head_trains_beside_the_adapters",
    "test_fit_patterns.py::test_a_restarted_script_ends_exactly_where_the_uninterrupted_run_ends[max_steps-jit]",
    "test_fit_patterns.py::test_a_restarted_script_ends_exactly_where_the_uninterrupted_run_ends[total_epochs-jit]",
    "test_step.py::test_int8_zero3_step_trains_like_the_exact_one_and_sends_int8[1x8x1-full]",
    "test_step.py::test_bf16_gradients_are_held_in_bf16_and_differ_by_their_rounding[1x8x1]",
    "test_step.py::test_int8_data_parallel_step_trains_like_the_exact_one_and_sends_int8[8x1x1-0]",
    "test_step.py::test_pipelined_layer_stack_and_vocab_parallel_lookup[llama-1x8x1-3]",
    "test_step.py::test_shard_map_step_equals_jit_step[1x8x1-2-2]",
    "test_attention_window.py::test_matches_the_dense_masked_attention[mosaic_tpu-causal-w20_0-cap1.5-seg-h4kv2-t45s45]",
    "test_attention_window.py::test_tiles_outside_the_window_are_skipped_not_just_masked[mosaic_tpu-True-window2]",
    "test_trainer.py::test_processes_that_do_not_share_the_workdir_fail_at_start_in_one_line",
    "test_trainer.py::test_eval_every_keeps_the_best_checkpoint_across_a_resume",
    "test_trainer.py::test_frozen_parameters_stay_and_the_rest_train_as_with_a_masked_optimizer[mesh1-kwargs1]",
    "test_trainer.py::test_offloaded_optimizer_state_rests_on_the_host_and_changes_nothing",
    "test_pipeline.py::test_pipelined_stack_equals_the_plain_one[llama-mesh5-options5]",
    "test_plan.py::test_zero3_plan_matches_the_formulas",
    "test_fit_patterns.py::test_grad_fn_replaces_the_engines_differentiation_on_every_step_kind[shard_map]",
    "test_qwen.py::test_load_sharded_train_and_generate[qwen3]",
    "test_qwen.py::test_memory_plan_of_a_tiny_qwen3",
    "test_models.py::test_t5_from_scratch_initialises_like_transformers",
    "test_compute_dtype.py::test_bf16_compute_makes_every_matmul_bf16[mixtral]",
    "test_sequence_parallel.py::test_loss_and_gradients_equal_the_unsplit_model[gemma2-mesh6-options6]",
    "test_paged_generate.py::test_greedy_equals_generate_with_fewer_slots_than_requests_eos_and_sampled_neighbours",
    "test_diloco.py::test_streaming_fragments_match_a_reference[True]",
    "test_diloco.py::test_outer_steps_send_a_part_each_in_the_wire_format[int4-0.5]",
    "test_distributed.py::test_a_coordinator_whose_peers_never_join_names_it_within_its_timeout",
    "test_text_and_scripts.py::test_pack_pairs_keeps_whole_pairs_apart_and_t5_loss_unchanged",
    "test_checkpoint_faults.py::test_fit_with_save_best_sets_an_unreadable_best_aside",
    "test_pipeline.py::test_a_mixture_on_a_pipeline_adds_the_whole_batchs_router_losses[mesh3-options3-jit]",
    "test_pipeline.py::test_gpipe_keeps_no_more_per_micro_batch_than_the_plain_model[full]",
    "test_pipeline.py::test_shard_map_step_gathers_one_layer_a_tick_inside_a_stage[1f1b]",
    "test_context_parallel.py::test_whole_rows_without_segment_ids_train_as_rows_of_one_document[jit-mesh1-options1]",
    "test_fit_patterns.py::test_a_restarted_script_ends_exactly_where_the_uninterrupted_run_ends[max_steps alone-jit]",
    "test_data_inputs.py::test_reading_streams_in_flat_memory[arrow]",
    "test_trainer.py::test_accumulating_a_token_mean_equals_the_large_batch[jit]",
    "test_pipeline.py::test_stacked_layers_split_over_stage_and_only_activations_move[mesh0-1]",
    "test_pipeline.py::test_pipelined_stack_equals_the_plain_one[llama-mesh8-options8]",
    "test_saved_activations.py::test_a_bf16_step_keeps_no_float32_activation_and_only_the_mlps_projections[gptj-False]",
    "test_pipeline_1f1b.py::test_1f1b_equals_the_plain_model[mesh2-options2]",
    # CI time on a slower day (622 s wall): the 1F1B schedule stays in test_pipeline_1f1b.py, the chunked loss's
    # values and gradients in test_fused_matmul.py, LLaMA on a context mesh and a dense model's saved activations
    "test_plan.py::test_a_1f1b_plan_reports_its_schedules_idle_share",
    "test_step.py::test_chunked_loss_trains_like_plain_logits_in_both_steps",
    "test_context_parallel.py::test_shard_map_step_on_a_context_mesh_equals_one_device[mixtral-mesh4-options4-None]",
    "test_saved_activations.py::test_a_mixtures_experts_keep_two_tensors_of_their_width",
    # the watchdog's input-pipeline hang stays as a unit test (test_watchdog.py); router losses per micro-batch
    # under accumulation (22 s) beside the whole batch's router losses in a shard_map (test_moe.py)
    "test_watchdog.py::test_fit_with_a_hung_input_pipeline_exits_with_the_status_naming_it",
    "test_moe_shard_map.py::test_router_losses_under_gradient_accumulation_are_each_micro_batchs[jit]",
    # CI time (this machine's suite at 740 s): bf16's every-matmul and forward dtype tests stay beside the ZeRO-3
    # memory comparison; token-weighted losses (test_trainer.py) and per-layer gathers (a scanned stack without remat,
    # a pipeline's tick) beside the scanned LLaMA's; three of their kind's variants
    "test_compute_dtype.py::test_bf16_compute_holds_no_more_than_float32_in_the_zero3_shard_map_step",
    "test_step.py::test_scanned_llama_token_weighted_loss_and_per_layer_gathers",
    "test_models.py::test_a_call_without_a_mask_attends_without_segment_ids[gemma2]",
    "test_paged_attention.py::test_equals_decode_attention_on_the_contiguous_cache[xla-int8]",
    "test_context_parallel.py::test_ring_attention_on_a_context_mesh_equals_the_unsplit_attention[xla-4-2-mesh0-True-"
    "lengths0]",
    # CI time (672 s of tests on this machine's clean clone): two compiled-program properties of the pipeline (its
    # weights never move; GPipe reduces the weight gradients once), one tick-count variant (another stays) and
    # bench_pipeline.py's smoke run; the pipelines' equality, memory and gather tests stay by default
    "test_bench_pipeline.py::test_bench_pipeline_prints_each_schedule[llama]",
    "test_pipeline.py::test_stacked_layers_split_over_stage_and_only_activations_move[mesh1-2]",
    "test_pipeline.py::test_gpipe_reduces_weight_gradients_once_per_step",
    "test_pipeline.py::test_compiled_tick_loops_follow_the_schedule[2-2]",
}


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects by marker
def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.nodeid.removeprefix("tests/") in SLOW_FOR_CI_TIME:
            item.add_marker(pytest.mark.slow)
