(** The axioms each main theorem rests on.  check.sh compiles this file and fails unless
    every axiom printed here is one of the standard library's real-number axioms. *)

From WitCert Require Import Sums Defs EForm TwoSided Tanh Meter
  Counterexample TierA.

Print Assumptions eform_sound.
Print Assumptions eform_meter_sound.
Print Assumptions two_sided_sound.
Print Assumptions retention_sound.
Print Assumptions retention_le_eform.
Print Assumptions retention_le_two_sided.
Print Assumptions tanh_half_sound.
Print Assumptions tanh_sound.
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
