(** Proposition 1 (two-sided form) of "WitCert: Sound Runtime Risk Observability and Gating
    for KV-Cache Quantization" (Wei and Liu), Sec. 4.3, in its aggregate form
      TV(p, p̃) ≤ ½ (A/A⁻ − A⁻/A),  A⁻ = E_p̃[e^{-c}],
    and in its per-token retention form
      TV(p, p̃) ≤ ½ Σ_t p̃_t · min(A e^{c_t} − 1, max(e^{c_t}/A⁻ − 1, 1 − e^{-c_t}/A)),
    which is at most both aggregate forms. *)

From Coq Require Import Reals Lra Lia.
From WitCert Require Import Sums Defs EForm.
Open Scope R_scope.

Definition two_sided (a am : R) : R := / 2 * (a / am - am / a).

(** The per-token factor of the retention form for a token with bound [ct]. *)
Definition retention_factor (a am ct : R) : R :=
  Rmin (a * exp ct - 1) (Rmax (exp ct / am - 1) (1 - exp (- ct) / a)).

Definition retention (n : nat) (pt c : nat -> R) : R :=
  / 2 * sum n (fun t => pt t * retention_factor (A n pt c) (Am n pt c) (c t)).

Section TwoSided.
Context (n : nat) (pt eps c : nat -> R) (Hcell : cell n pt eps c).

(** |r_t − 1| ≤ max(e^{c_t}/A⁻ − 1, 1 − e^{-c_t}/A) since r_t ∈ [e^{-c_t}/A, e^{c_t}/A⁻]. *)
Lemma ratio_two_sided t :
  (t < n)%nat ->
  Rabs (ratio n pt eps t - 1)
    <= Rmax (exp (c t) / Am n pt c - 1) (1 - exp (- c t) / A n pt c).
Proof.
  intros Ht. pose proof (ratio_bounds n pt eps c Hcell t Ht) as [Hlo Hhi].
  pose proof (Rmax_l (exp (c t) / Am n pt c - 1) (1 - exp (- c t) / A n pt c)).
  pose proof (Rmax_r (exp (c t) / Am n pt c - 1) (1 - exp (- c t) / A n pt c)).
  apply Rabs_le. split; lra.
Qed.

Lemma ratio_retention t :
  (t < n)%nat ->
  Rabs (ratio n pt eps t - 1) <= retention_factor (A n pt c) (Am n pt c) (c t).
Proof.
  intros Ht. unfold retention_factor. apply Rmin_glb.
  - apply (ratio_eform n pt eps c Hcell t Ht).
  - apply ratio_two_sided. exact Ht.
Qed.

(** Proposition 1, per-token retention form. *)
Theorem retention_sound : TV n (p n pt eps) pt <= retention n pt c.
Proof. apply (TV_le_expect n pt eps c Hcell). exact ratio_retention. Qed.

(** Both sides of the two-sided per-token factor are non-negative (A⁻ ≤ 1 ≤ A, c_t ≥ 0). *)
Lemma two_sided_parts_nonneg t :
  (t < n)%nat ->
  0 <= exp (c t) / Am n pt c - 1 /\ 0 <= 1 - exp (- c t) / A n pt c.
Proof.
  intros Ht.
  pose proof (A_pos n pt eps c Hcell). pose proof (Am_pos n pt eps c Hcell).
  pose proof (A_ge_1 n pt eps c Hcell). pose proof (Am_le_1 n pt eps c Hcell).
  pose proof (c_nonneg n pt eps c Hcell t Ht) as Hc.
  pose proof (exp_ge_1 _ Hc). assert (exp (- c t) <= 1) by (apply exp_le_1; lra).
  pose proof (exp_pos (- c t)).
  split.
  - apply Rle_trans with (exp (c t) - 1); [lra|].
    apply Rplus_le_compat_r. unfold Rdiv.
    rewrite <- (Rmult_1_r (exp (c t))) at 1. apply Rmult_le_compat_l; [lra|].
    rewrite <- Rinv_1. apply Rinv_le_contravar; lra.
  - assert (exp (- c t) / A n pt c <= 1); [|lra].
    apply Rmult_le_reg_r with (A n pt c); [lra|].
    replace (exp (- c t) / A n pt c * A n pt c) with (exp (- c t)) by (field; lra). lra.
Qed.

(** The aggregate factor: Σ_t p̃_t((e^{c_t}/A⁻ − 1) + (1 − e^{-c_t}/A)) = A/A⁻ − A⁻/A. *)
Lemma two_sided_sum :
  sum n (fun t => pt t * ((exp (c t) / Am n pt c - 1) + (1 - exp (- c t) / A n pt c)))
  = A n pt c / Am n pt c - Am n pt c / A n pt c.
Proof.
  pose proof (A_pos n pt eps c Hcell). pose proof (Am_pos n pt eps c Hcell).
  rewrite (sum_ext n _ (fun t => pt t * exp (c t) * / Am n pt c
                                 - pt t * exp (- c t) * / A n pt c))
    by (intros; field; lra).
  rewrite sum_minus, !sum_scal_r. fold (A n pt c) (Am n pt c). field. lra.
Qed.

(** Proposition 1, aggregate form. *)
Theorem two_sided_sound : TV n (p n pt eps) pt <= two_sided (A n pt c) (Am n pt c).
Proof.
  unfold two_sided. rewrite <- two_sided_sum.
  apply (TV_le_expect n pt eps c Hcell). intros t Ht.
  eapply Rle_trans; [apply ratio_two_sided; exact Ht|].
  destruct (two_sided_parts_nonneg t Ht). apply Rmax_lub; lra.
Qed.

(** The retention form is at most both aggregate forms. *)
Theorem retention_le_eform : retention n pt c <= eform (A n pt c).
Proof.
  unfold retention, eform. apply Rmult_le_compat_l; [lra|].
  apply Rle_trans with (sum n (fun t => A n pt c * (pt t * exp (c t)) - pt t)).
  - apply sum_le. intros t Ht. pose proof (pt_nonneg n pt eps c Hcell t Ht).
    unfold retention_factor.
    replace (A n pt c * (pt t * exp (c t)) - pt t) with (pt t * (A n pt c * exp (c t) - 1))
      by ring.
    apply Rmult_le_compat_l; [lra|apply Rmin_l].
  - right. rewrite sum_minus, sum_scal_l, (pt_sum n pt eps c Hcell). fold (A n pt c). ring.
Qed.

Theorem retention_le_two_sided : retention n pt c <= two_sided (A n pt c) (Am n pt c).
Proof.
  unfold retention, two_sided. rewrite <- two_sided_sum.
  apply Rmult_le_compat_l; [lra|]. apply sum_le. intros t Ht.
  pose proof (pt_nonneg n pt eps c Hcell t Ht).
  apply Rmult_le_compat_l; [lra|]. unfold retention_factor.
  eapply Rle_trans; [apply Rmin_r|].
  destruct (two_sided_parts_nonneg t Ht). apply Rmax_lub; lra.
Qed.

End TwoSided.
