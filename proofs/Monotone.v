(** Every aggregate shape is monotone: non-decreasing in A, non-increasing in A⁻.  Hence a
    shape evaluated at an upper bound on A and a lower bound on A⁻ (what the log-domain code
    computes, with outward rounding margins) is still at least TV(p, p̃). *)

From Coq Require Import Reals Lra Lia.
From WitCert Require Import Sums Defs EForm TwoSided.
Open Scope R_scope.

Lemma eform_mono a a' : 0 <= a -> a <= a' -> eform a <= eform a'.
Proof. intros. unfold eform. apply Rmult_le_compat_l; [lra|]. nra. Qed.

Lemma two_sided_mono a a' am am' :
  0 < a -> a <= a' -> 0 < am' -> am' <= am -> two_sided a am <= two_sided a' am'.
Proof.
  intros Ha Haa Ham Hamm. unfold two_sided. apply Rmult_le_compat_l; [lra|].
  assert (a / am <= a' / am').
  { unfold Rdiv. apply Rmult_le_compat; try lra.
    - left. apply Rinv_0_lt_compat. lra.
    - apply Rinv_le_contravar; lra. }
  assert (am' / a' <= am / a).
  { unfold Rdiv. apply Rmult_le_compat; try lra.
    - left. apply Rinv_0_lt_compat. lra.
    - apply Rinv_le_contravar; lra. }
  lra.
Qed.

Lemma retention_factor_mono a a' am am' ct :
  0 < a -> a <= a' -> 0 < am' -> am' <= am ->
  retention_factor a am ct <= retention_factor a' am' ct.
Proof.
  intros Ha Haa Ham Hamm. unfold retention_factor.
  pose proof (exp_pos ct). pose proof (exp_pos (- ct)).
  assert (H1 : a * exp ct - 1 <= a' * exp ct - 1) by nra.
  assert (H2 : exp ct / am - 1 <= exp ct / am' - 1).
  { unfold Rdiv. apply Rplus_le_compat_r. apply Rmult_le_compat_l; [lra|].
    apply Rinv_le_contravar; lra. }
  assert (H3 : 1 - exp (- ct) / a <= 1 - exp (- ct) / a').
  { unfold Rdiv. apply Rplus_le_compat_l. apply Ropp_le_contravar.
    apply Rmult_le_compat_l; [lra|]. apply Rinv_le_contravar; lra. }
  unfold Rmin, Rmax. repeat destruct Rle_dec; lra.
Qed.

(** Soundness from bounds: any a ≥ A and am ≤ A⁻ (am > 0) still bound TV. *)
Theorem eform_sound_upper n pt eps c a :
  cell n pt eps c -> A n pt c <= a -> TV n (p n pt eps) pt <= eform a.
Proof.
  intros H Ha. eapply Rle_trans; [apply (eform_sound n pt eps c H)|].
  apply eform_mono; [left; apply (A_pos n pt eps c H)|exact Ha].
Qed.

Theorem two_sided_sound_bounds n pt eps c a am :
  cell n pt eps c -> A n pt c <= a -> 0 < am -> am <= Am n pt c ->
  TV n (p n pt eps) pt <= two_sided a am.
Proof.
  intros H Ha Ham Hamm. eapply Rle_trans; [apply (two_sided_sound n pt eps c H)|].
  apply two_sided_mono; try assumption. apply (A_pos n pt eps c H).
Qed.

Theorem retention_sound_bounds n pt eps c a am :
  cell n pt eps c -> A n pt c <= a -> 0 < am -> am <= Am n pt c ->
  TV n (p n pt eps) pt
    <= / 2 * sum n (fun t => pt t * retention_factor a am (c t)).
Proof.
  intros H Ha Ham Hamm. eapply Rle_trans; [apply (retention_sound n pt eps c H)|].
  unfold retention. apply Rmult_le_compat_l; [lra|]. apply sum_le. intros t Ht.
  apply Rmult_le_compat_l; [apply (pt_nonneg n pt eps c H t Ht)|].
  apply retention_factor_mono; try assumption. apply (A_pos n pt eps c H).
Qed.
