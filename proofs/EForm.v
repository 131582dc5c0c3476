(** Theorem 1 (e-form, sound replacement) of "WitCert: Sound Runtime Risk Observability and
    Gating for KV-Cache Quantization" (Wei and Liu), Sec. 3:
      TV(p, p̃) ≤ ½ (A² − 1),  A = E_p̃[e^c],
    and its clamped meter form min(1, ½ (A² − 1)). *)

From Coq Require Import Reals Lra Lia.
From WitCert Require Import Sums Defs.
Open Scope R_scope.

Definition eform (a : R) : R := / 2 * (a * a - 1).

Section EForm.
Context (n : nat) (pt eps c : nat -> R) (Hcell : cell n pt eps c).

(** |p_t/p̃_t − 1| ≤ A e^{c_t} − 1 (the proof of Theorem 1). *)
Lemma ratio_eform t :
  (t < n)%nat -> Rabs (ratio n pt eps t - 1) <= A n pt c * exp (c t) - 1.
Proof.
  intros Ht.
  pose proof (ratio_bounds n pt eps c Hcell t Ht) as [Hlo Hhi].
  pose proof (A_pos n pt eps c Hcell) as HA.
  pose proof (Am_pos n pt eps c Hcell) as HAm.
  pose proof (A_Am_ge_1 n pt eps c Hcell) as HAAm.
  pose proof (exp_pos (c t)) as He.
  set (a := A n pt c) in *. set (am := Am n pt c) in *.
  set (r := ratio n pt eps t) in *. set (x := exp (c t)) in *.
  rewrite exp_Ropp in Hlo. fold x in Hlo.
  (* upper side: r ≤ x / am ≤ a x because 1 ≤ a am *)
  assert (H1 : x / am <= a * x).
  { apply Rmult_le_reg_r with am; [exact HAm|].
    replace (x / am * am) with x by (field; lra). nra. }
  (* lower side: 1 − 1/(a x) ≤ a x − 1 because y + 1/y ≥ 2 *)
  assert (H2 : 1 - / x / a <= a * x - 1).
  { assert (Hy : 0 < a * x) by (apply Rmult_lt_0_compat; lra).
    replace (/ x / a) with (/ (a * x)) by (field; lra).
    apply Rmult_le_reg_r with (a * x); [exact Hy|].
    replace ((1 - / (a * x)) * (a * x)) with (a * x - 1) by (field; lra).
    assert (0 <= (a * x - 1) * (a * x - 1)) by apply Rle_0_sqr. nra. }
  apply Rabs_le. split; lra.
Qed.

(** Theorem 1. *)
Theorem eform_sound : TV n (p n pt eps) pt <= eform (A n pt c).
Proof.
  eapply Rle_trans.
  - apply (TV_le_expect n pt eps c Hcell (fun t => A n pt c * exp (c t) - 1)).
    apply ratio_eform.
  - unfold eform. apply Rmult_le_compat_l; [lra|]. right.
    rewrite (sum_ext n _ (fun t => A n pt c * (pt t * exp (c t)) - pt t))
      by (intros; ring).
    rewrite sum_minus, sum_scal_l, (pt_sum n pt eps c Hcell). fold (A n pt c). ring.
Qed.

(** The reported meter min(1, ½ (A² − 1)). *)
Theorem eform_meter_sound : TV n (p n pt eps) pt <= Rmin 1 (eform (A n pt c)).
Proof.
  apply Rmin_glb; [apply (TV_le_1 n pt eps c Hcell)|apply eform_sound].
Qed.

End EForm.
