(** The meter: the minimum of every sound shape, clamped to 1.  Each shape bounds
    TV(p, p̃) (EForm.v, TwoSided.v, Tanh.v) and TV ≤ 1 always (Defs.v), so the minimum
    does as well.  c_max is taken over the tokens of positive mass, as the code takes it. *)

From Coq Require Import Reals Lra Lia.
From WitCert Require Import Sums Defs EForm TwoSided Tanh.
Open Scope R_scope.

Definition meter (n : nat) (pt c : nat -> R) : R :=
  Rmin 1 (Rmin (eform (A n pt c))
         (Rmin (two_sided (A n pt c) (Am n pt c))
         (Rmin (retention n pt c)
         (Rmin (tanh (cmax_mass n pt c)) (tanh (cmax_mass n pt c / 2)))))).

Theorem meter_sound n pt eps c :
  cell n pt eps c -> TV n (p n pt eps) pt <= meter n pt c.
Proof.
  intros H. unfold meter.
  repeat apply Rmin_glb.
  - apply (TV_le_1 n pt eps c H).
  - apply (eform_sound n pt eps c H).
  - apply (two_sided_sound n pt eps c H).
  - apply (retention_sound n pt eps c H).
  - apply (tanh_sound_cmax_mass n pt eps c H).
  - apply (tanh_half_sound_cmax_mass n pt eps c H).
Qed.
