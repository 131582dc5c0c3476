(** The axioms each main theorem rests on.  check.sh compiles this file and fails unless
    every axiom printed here is one of the standard library's real-number axioms. *)

From WitCert Require Import Sums Defs EForm TwoSided Tanh Meter
  Counterexample TierA SplitMerge ValueSide BlockRepair
  Monotone Dither TierB ValueDither.

Print Assumptions eform_sound.
Print Assumptions eform_meter_sound.
Print Assumptions two_sided_sound.
Print Assumptions retention_sound.
Print Assumptions retention_le_eform.
Print Assumptions retention_le_two_sided.
Print Assumptions tanh_half_sound.
Print Assumptions tanh_sound.
Print Assumptions tanh_half_sound_cmax_mass.
Print Assumptions tanh_sound_cmax_mass.
Print Assumptions meter_sound.
Print Assumptions flawed_counterexample.
Print Assumptions flawed_counterexample_values.
Print Assumptions flawed_unsound.
Print Assumptions band_norm_rotate.
Print Assumptions band_norm_residual_rotate.
Print Assumptions band_norm_rotate_interleaved.
Print Assumptions band_norm_rotate_neox.
Print Assumptions logit_band_bound.
Print Assumptions tier_a_sound.
Print Assumptions tier_a_sound_interleaved.
Print Assumptions tier_a_sound_neox.
Print Assumptions merge_avg.
Print Assumptions merge_A.
Print Assumptions merge_Am.
Print Assumptions merge_output.
Print Assumptions merge_cmax.
Print Assumptions lse_merge_represents.
Print Assumptions merge_log_A.
Print Assumptions merge_log_Am.
Print Assumptions value_output_bound_general.
Print Assumptions value_output_bound.
Print Assumptions enorm_is_norm.
Print Assumptions value_output_bound_euclid.
Print Assumptions repair_A.
Print Assumptions repair_Am.
Print Assumptions repair_rho.
Print Assumptions block_term_A_disjoint.
Print Assumptions repair_twice_A.
Print Assumptions repair_A_le.
Print Assumptions repair_cell.
Print Assumptions eform_sound_upper.
Print Assumptions two_sided_sound_bounds.
Print Assumptions retention_sound_bounds.
Print Assumptions radius_tail.
Print Assumptions union_bound.
Print Assumptions request_budget.
Print Assumptions tier_b_joint.
Print Assumptions tier_b_meter.
Print Assumptions sinh_le.
Print Assumptions uniform_mgf_integral.
Print Assumptions uniform_mgf_bound.
Print Assumptions mgf_unif_bound.
Print Assumptions mgf_unif_scaled_bound.
Print Assumptions dither_code_range.
Print Assumptions dither_code_bits.
Print Assumptions subgaussian_sum.
Print Assumptions dither_tail.
Print Assumptions tier_b_joint_dither.
Print Assumptions tier_b_meter_dither.
Print Assumptions tier_b_request_dither.
Print Assumptions value_channel_tail.
Print Assumptions value_joint.
Print Assumptions value_l2_on_event.
Print Assumptions value_l2_tail.
Print Assumptions value_l2_det.
Print Assumptions value_l2_min.
Print Assumptions cell_budget.
Print Assumptions request_budget_kv.
