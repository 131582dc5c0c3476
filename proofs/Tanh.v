(** The tanh shapes: TV(p, p̃) ≤ tanh(C/2) ≤ tanh(C) for any C ≥ max_t c_t, in particular for
    C = c_max.  tanh(max c) is the shape of the runtime-certified prior work that
    "WitCert: Sound Runtime Risk Observability and Gating for KV-Cache Quantization"
    (Wei and Liu) compares against (Sec. 6.4.2); tanh(c_max/2) is its tighter sound variant:
    the log-likelihood ratio log(p_t/p̃_t) spans an interval of width at most 2·c_max.
    [tanh] is the standard library's (Rtrigo_def: sinh x / cosh x). *)

From Coq Require Import Reals Lra Lia.
From WitCert Require Import Sums Defs.
Open Scope R_scope.

(** tanh x = (e^{2x} − 1)/(e^{2x} + 1), written with e^x · e^x. *)
Lemma tanh_exp x : tanh x = (exp x * exp x - 1) / (exp x * exp x + 1).
Proof.
  unfold tanh, sinh, cosh. rewrite exp_Ropp. pose proof (exp_pos x).
  field. split; [|lra]. nra.
Qed.

Lemma tanh_half_exp x : tanh (x / 2) = (exp x - 1) / (exp x + 1).
Proof.
  rewrite tanh_exp, <- exp_plus. replace (x / 2 + x / 2) with x by field. reflexivity.
Qed.

(** tanh(C/2) ≤ tanh(C) for C ≥ 0. *)
Lemma tanh_half_le_tanh C : 0 <= C -> tanh (C / 2) <= tanh C.
Proof.
  intros HC. rewrite tanh_half_exp, tanh_exp. pose proof (exp_ge_1 C HC) as HE.
  set (E := exp C) in *.
  apply Rmult_le_reg_r with ((E + 1) * (E * E + 1)); [nra|].
  replace ((E - 1) / (E + 1) * ((E + 1) * (E * E + 1))) with ((E - 1) * (E * E + 1))
    by (field; lra).
  replace ((E * E - 1) / (E * E + 1) * ((E + 1) * (E * E + 1)))
    with ((E * E - 1) * (E + 1)) by (field; nra).
  nra.
Qed.

(** The chord of |x − 1| over [lo, hi] ∋ 1 dominates it on that interval. *)
Lemma chord_bound lo hi r :
  lo <= 1 <= hi -> lo <= r <= hi ->
  (hi - lo) * Rabs (r - 1) <= (1 - lo) * (hi - lo) + (r - lo) * (hi + lo - 2).
Proof.
  intros [H1 H2] [H3 H4]. unfold Rabs. destruct (Rcase_abs (r - 1)).
  - (* the difference is 2 (hi − 1)(r − lo) *)
    assert (0 <= (hi - 1) * (r - lo)) by (apply Rmult_le_pos; lra). nra.
  - (* the difference is 2 (1 − lo)(hi − r) *)
    assert (0 <= (1 - lo) * (hi - r)) by (apply Rmult_le_pos; lra). nra.
Qed.

(** The algebra that turns the chord bound into tanh(C/2), with E = e^C > 1. *)
Lemma tanh_algebra E Z S :
  1 < E -> 0 < Z -> 0 <= S ->
  (E / Z - / E / Z) * S <= 2 * ((1 - / E / Z) * (E / Z - 1)) ->
  S <= 2 * ((E - 1) / (E + 1)).
Proof.
  intros HE HZ HS H.
  assert (Hk : 0 < E * Z * Z) by (apply Rmult_lt_0_compat; [nra|lra]).
  apply Rmult_le_compat_r with (r := E * Z * Z) in H; [|lra].
  replace ((E / Z - / E / Z) * S * (E * Z * Z)) with ((E * E - 1) * Z * S) in H
    by (field; lra).
  replace (2 * ((1 - / E / Z) * (E / Z - 1)) * (E * Z * Z))
    with (2 * ((E * Z - 1) * (E - Z))) in H by (field; lra).
  assert (Hsq : 0 <= E * ((Z - 1) * (Z - 1))) by (apply Rmult_le_pos; [lra|apply Rle_0_sqr]).
  assert (Hpos : 0 < (E + 1) * (E - 1) * Z)
    by (apply Rmult_lt_0_compat; [apply Rmult_lt_0_compat; lra|lra]).
  apply Rmult_le_reg_r with ((E + 1) * (E - 1) * Z); [exact Hpos|].
  replace (2 * ((E - 1) / (E + 1)) * ((E + 1) * (E - 1) * Z)) with (2 * (E - 1) * (E - 1) * Z)
    by (field; lra).
  nra.
Qed.

Section Tanh.
Context (n : nat) (pt eps c : nat -> R) (Hcell : cell n pt eps c).
Context (C : R) (HC : forall t, (t < n)%nat -> c t <= C).

Lemma exp_eps_bounds_C t : (t < n)%nat -> exp (- C) <= exp (- eps t) <= exp C.
Proof.
  intros Ht. pose proof (exp_eps_bounds n pt eps c Hcell t Ht) as [H1 H2].
  pose proof (HC t Ht).
  split; [eapply Rle_trans; [|exact H1]|eapply Rle_trans; [exact H2|]]; apply exp_le; lra.
Qed.

Lemma Z_bounds_C : exp (- C) <= Z n pt eps <= exp C.
Proof.
  unfold Z, wt. rewrite <- (expect_const n pt eps c Hcell (exp (- C))) at 1.
  rewrite <- (expect_const n pt eps c Hcell (exp C)).
  split; apply sum_le; intros t Ht; apply Rmult_le_compat_l;
    try (apply (pt_nonneg n pt eps c Hcell); exact Ht); apply exp_eps_bounds_C; exact Ht.
Qed.

Lemma C_nonneg : 0 <= C.
Proof.
  destruct (Rlt_or_le C 0) as [Hlt|Hle]; [|exact Hle]. exfalso.
  pose proof Z_bounds_C. pose proof (exp_increasing C (- C)). lra.
Qed.

Lemma ratio_bounds_C t :
  (t < n)%nat -> exp (- C) / Z n pt eps <= ratio n pt eps t <= exp C / Z n pt eps.
Proof.
  intros Ht. pose proof (Z_pos n pt eps c Hcell) as HZ. pose proof (exp_eps_bounds_C t Ht).
  unfold ratio, Rdiv. split; apply Rmult_le_compat_r; try lra;
    left; apply Rinv_0_lt_compat; exact HZ.
Qed.

(** TV(p, p̃) ≤ tanh(C/2). *)
Theorem tanh_half_sound_C : TV n (p n pt eps) pt <= tanh (C / 2).
Proof.
  rewrite tanh_half_exp. pose proof (Z_pos n pt eps c Hcell) as HZ.
  pose proof Z_bounds_C as [HZ1 HZ2]. rewrite exp_Ropp in HZ1.
  pose proof (exp_ge_1 C C_nonneg) as HE1.
  set (E := exp C) in *. set (z := Z n pt eps) in *.
  set (S := sum n (fun t => pt t * Rabs (ratio n pt eps t - 1))).
  assert (HS : 0 <= S).
  { apply sum_nonneg. intros t Ht. apply Rmult_le_pos;
      [apply (pt_nonneg n pt eps c Hcell); exact Ht|apply Rabs_pos]. }
  rewrite (TV_ratio n pt eps c Hcell). fold S.
  destruct (Rle_lt_or_eq_dec 1 E HE1) as [HE|HE].
  - (* C > 0: the chord bound, averaged under p̃ *)
    assert (Hlo : / E / z <= 1).
    { apply Rmult_le_reg_r with z; [lra|]. replace (/ E / z * z) with (/ E) by (field; lra).
      lra. }
    assert (Hhi : 1 <= E / z).
    { apply Rmult_le_reg_r with z; [lra|]. replace (E / z * z) with E by (field; lra).
      lra. }
    assert (Hchord : (E / z - / E / z) * S <=
                     sum n (fun t => pt t * ((1 - / E / z) * (E / z - / E / z)
                                             + (ratio n pt eps t - / E / z)
                                               * (E / z + / E / z - 2)))).
    { unfold S. rewrite <- sum_scal_l. apply sum_le. intros t Ht.
      pose proof (pt_nonneg n pt eps c Hcell t Ht).
      pose proof (ratio_bounds_C t Ht) as Hr. rewrite exp_Ropp in Hr. fold E z in Hr.
      replace ((E / z - / E / z) * (pt t * Rabs (ratio n pt eps t - 1)))
        with (pt t * ((E / z - / E / z) * Rabs (ratio n pt eps t - 1))) by ring.
      apply Rmult_le_compat_l; [lra|]. apply chord_bound; lra. }
    assert (Hmean : sum n (fun t => pt t * ratio n pt eps t) = 1).
    { rewrite <- (p_sum n pt eps c Hcell). apply sum_ext. intros t Ht.
      unfold p, ratio, wt. fold z. field. lra. }
    rewrite (sum_ext n _ (fun t => pt t * ((1 - / E / z) * (E / z - / E / z)
                                         - / E / z * (E / z + / E / z - 2))
                                 + pt t * ratio n pt eps t * (E / z + / E / z - 2)))
      in Hchord by (intros; ring).
    rewrite sum_plus, (expect_const n pt eps c Hcell), sum_scal_r, Hmean in Hchord.
    assert (Hfin : (E / z - / E / z) * S <= 2 * ((1 - / E / z) * (E / z - 1)))
      by (eapply Rle_trans; [exact Hchord|right; ring]).
    pose proof (tanh_algebra E z S HE HZ HS Hfin). lra.
  - (* C = 0: every ratio equals 1 *)
    assert (HzE : z = 1).
    { rewrite <- HE in HZ1, HZ2. rewrite Rinv_1 in HZ1. lra. }
    assert (S <= 0).
    { unfold S. rewrite <- (sum_const0 n). apply sum_le. intros t Ht.
      pose proof (ratio_bounds_C t Ht) as Hr. rewrite exp_Ropp in Hr. fold E z in Hr.
      rewrite <- HE, HzE, Rinv_1 in Hr.
      replace (ratio n pt eps t) with 1 by lra.
      replace (1 - 1) with 0 by ring. rewrite Rabs_R0. lra. }
    rewrite <- HE. replace ((1 - 1) / (1 + 1)) with 0 by field. lra.
Qed.

Theorem tanh_sound_C : TV n (p n pt eps) pt <= tanh C.
Proof.
  eapply Rle_trans; [apply tanh_half_sound_C|apply tanh_half_le_tanh; apply C_nonneg].
Qed.

End Tanh.

(** The same with C = c_max = max_t c_t, as the meter computes it. *)
Definition cmax (n : nat) (c : nat -> R) : R := maxn n c.

Theorem tanh_half_sound n pt eps c :
  cell n pt eps c -> TV n (p n pt eps) pt <= tanh (cmax n c / 2).
Proof. intros H. apply (tanh_half_sound_C n pt eps c H). intros. apply maxn_ge. assumption. Qed.

Theorem tanh_sound n pt eps c :
  cell n pt eps c -> TV n (p n pt eps) pt <= tanh (cmax n c).
Proof. intros H. apply (tanh_sound_C n pt eps c H). intros. apply maxn_ge. assumption. Qed.

(** Tokens of zero mass cannot move any mass, so C need only bound c_t where p̃_t > 0 (the
    code's c_max skips tokens with p̃_t = 0). *)
Definition mask (pt f : nat -> R) (t : nat) : R :=
  if Rlt_dec 0 (pt t) then f t else 0.

Lemma p_mask n pt eps :
  (forall t, (t < n)%nat -> 0 <= pt t) ->
  forall t, (t < n)%nat -> p n pt (mask pt eps) t = p n pt eps t.
Proof.
  intros Hpt.
  assert (Hw : forall t, (t < n)%nat -> wt pt (mask pt eps) t = wt pt eps t).
  { intros t Ht. unfold wt, mask. destruct Rlt_dec as [_|Hn]; [reflexivity|].
    assert (pt t = 0) as -> by (pose proof (Hpt t Ht); lra). ring. }
  intros t Ht. unfold p, Z. rewrite (Hw t Ht), (sum_ext n _ _ Hw). reflexivity.
Qed.

Lemma cell_mask n pt eps c : cell n pt eps c -> cell n pt (mask pt eps) (mask pt c).
Proof.
  intros [Hd Hc]. split; [exact Hd|]. intros t Ht. unfold mask.
  destruct Rlt_dec; [apply Hc; exact Ht|rewrite Rabs_R0; lra].
Qed.

Theorem tanh_half_sound_mass n pt eps c C :
  cell n pt eps c -> 0 <= C -> (forall t, (t < n)%nat -> 0 < pt t -> c t <= C) ->
  TV n (p n pt eps) pt <= tanh (C / 2).
Proof.
  intros H HC0 HC.
  assert (Hd := H). destruct Hd as [[Hpt _] _].
  replace (TV n (p n pt eps) pt) with (TV n (p n pt (mask pt eps)) pt).
  - apply (tanh_half_sound_C n pt (mask pt eps) (mask pt c) (cell_mask n pt eps c H) C).
    intros t Ht. unfold mask. destruct Rlt_dec as [Hp|_]; [apply HC; assumption|exact HC0].
  - unfold TV. f_equal. apply sum_ext. intros t Ht. rewrite p_mask by assumption.
    reflexivity.
Qed.

Theorem tanh_sound_mass n pt eps c C :
  cell n pt eps c -> 0 <= C -> (forall t, (t < n)%nat -> 0 < pt t -> c t <= C) ->
  TV n (p n pt eps) pt <= tanh C.
Proof.
  intros. eapply Rle_trans; [apply (tanh_half_sound_mass n pt eps c C); assumption|].
  apply tanh_half_le_tanh. assumption.
Qed.

(** c_max over the tokens of positive mass, as the code computes it. *)
Definition cmax_mass (n : nat) (pt c : nat -> R) : R := maxn n (mask pt c).

Lemma cmax_mass_ge n pt c t : (t < n)%nat -> 0 < pt t -> c t <= cmax_mass n pt c.
Proof.
  intros Ht Hp. unfold cmax_mass.
  replace (c t) with (mask pt c t) by (unfold mask; destruct Rlt_dec; [reflexivity|lra]).
  apply maxn_ge. exact Ht.
Qed.

Theorem tanh_half_sound_cmax_mass n pt eps c :
  cell n pt eps c -> TV n (p n pt eps) pt <= tanh (cmax_mass n pt c / 2).
Proof.
  intros H. apply (tanh_half_sound_mass n pt eps c); [exact H|apply maxn_nonneg|].
  intros. apply cmax_mass_ge; assumption.
Qed.

Theorem tanh_sound_cmax_mass n pt eps c :
  cell n pt eps c -> TV n (p n pt eps) pt <= tanh (cmax_mass n pt c).
Proof.
  intros H. apply (tanh_sound_mass n pt eps c); [exact H|apply maxn_nonneg|].
  intros. apply cmax_mass_ge; assumption.
Qed.
