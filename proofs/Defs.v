(** The setting of one (layer, head, decode step) cell.

    [n] cached tokens; [pt t] is the compressed attention distribution p̃ (the softmax of
    the compressed logits); [eps t] is the logit error ε_t, so the exact distribution is
    p_t ∝ p̃_t e^{-ε_t}; [c t] is the per-token bound, |ε_t| ≤ c_t.  This is the notation
    of "WitCert: Sound Runtime Risk Observability and Gating for KV-Cache Quantization"
    (Wei and Liu), Sec. 3. *)

From Coq Require Import Reals Lra Lia.
From WitCert Require Import Sums.
Open Scope R_scope.

(** p̃ is a probability distribution on [0, n). *)
Definition distribution (n : nat) (pt : nat -> R) : Prop :=
  (forall t, (t < n)%nat -> 0 <= pt t) /\ sum n pt = 1.

(** The hypotheses of every meter theorem. *)
Definition cell (n : nat) (pt eps c : nat -> R) : Prop :=
  distribution n pt /\ forall t, (t < n)%nat -> Rabs (eps t) <= c t.

(** Unnormalized exact weights, their total Z, and the exact distribution p. *)
Definition wt (pt eps : nat -> R) (t : nat) : R := pt t * exp (- eps t).
Definition Z (n : nat) (pt eps : nat -> R) : R := sum n (wt pt eps).
Definition p (n : nat) (pt eps : nat -> R) (t : nat) : R := wt pt eps t / Z n pt eps.

(** Total variation distance between two weight vectors on [0, n). *)
Definition TV (n : nat) (q r : nat -> R) : R := / 2 * sum n (fun t => Rabs (q t - r t)).

(** A = E_p̃[e^c] and A⁻ = E_p̃[e^{-c}]. *)
Definition A (n : nat) (pt c : nat -> R) : R := sum n (fun t => pt t * exp (c t)).
Definition Am (n : nat) (pt c : nat -> R) : R := sum n (fun t => pt t * exp (- c t)).

(** * Elementary facts about absolute values and exp *)

Lemma Rabs_le_inv x b : Rabs x <= b -> - b <= x <= b.
Proof. unfold Rabs. destruct (Rcase_abs x); intros; lra. Qed.

Lemma exp_le x y : x <= y -> exp x <= exp y.
Proof.
  intros [H|H]; [left; apply exp_increasing; exact H|subst; lra].
Qed.

Lemma exp_ge_1 x : 0 <= x -> 1 <= exp x.
Proof. intros H. rewrite <- exp_0. apply exp_le. exact H. Qed.

Lemma exp_le_1 x : x <= 0 -> exp x <= 1.
Proof. intros H. rewrite <- exp_0. apply exp_le. exact H. Qed.

Lemma exp_opp_mul x : exp x * exp (- x) = 1.
Proof. rewrite <- exp_plus. replace (x + - x) with 0 by ring. apply exp_0. Qed.

(** * Facts about a cell *)

Section Cell.
Context (n : nat) (pt eps c : nat -> R) (Hcell : cell n pt eps c).

Lemma pt_nonneg t : (t < n)%nat -> 0 <= pt t.
Proof. destruct Hcell as [[H _] _]. apply H. Qed.

Lemma pt_sum : sum n pt = 1.
Proof. destruct Hcell as [[_ H] _]. exact H. Qed.

Lemma eps_le t : (t < n)%nat -> Rabs (eps t) <= c t.
Proof. destruct Hcell as [_ H]. apply H. Qed.

Lemma c_nonneg t : (t < n)%nat -> 0 <= c t.
Proof. intros Ht. eapply Rle_trans; [apply Rabs_pos|apply eps_le; exact Ht]. Qed.

Lemma exp_eps_bounds t :
  (t < n)%nat -> exp (- c t) <= exp (- eps t) <= exp (c t).
Proof.
  intros Ht. pose proof (eps_le t Ht) as H. apply Rabs_le_inv in H.
  split; apply exp_le; lra.
Qed.

(** E_p̃[g] for a constant g is that constant. *)
Lemma expect_const k : sum n (fun t => pt t * k) = k.
Proof. rewrite sum_scal_r, pt_sum. ring. Qed.

Lemma Z_pos : 0 < Z n pt eps.
Proof.
  unfold Z, wt. apply sum_pos_weighted.
  - exact pt_nonneg.
  - intros. apply exp_pos.
  - rewrite pt_sum. lra.
Qed.

Lemma Am_pos : 0 < Am n pt c.
Proof.
  unfold Am. apply sum_pos_weighted.
  - exact pt_nonneg.
  - intros. apply exp_pos.
  - rewrite pt_sum. lra.
Qed.

Lemma A_pos : 0 < A n pt c.
Proof.
  unfold A. apply sum_pos_weighted.
  - exact pt_nonneg.
  - intros. apply exp_pos.
  - rewrite pt_sum. lra.
Qed.

(** A⁻ ≤ Z ≤ A. *)
Lemma Z_bounds : Am n pt c <= Z n pt eps <= A n pt c.
Proof.
  unfold Am, Z, A, wt. split; apply sum_le; intros t Ht;
    apply Rmult_le_compat_l; try (apply pt_nonneg; exact Ht);
    apply exp_eps_bounds; exact Ht.
Qed.

(** A⁻ ≤ 1 ≤ A (every c_t is non-negative). *)
Lemma A_ge_1 : 1 <= A n pt c.
Proof.
  rewrite <- pt_sum. unfold A. apply sum_le. intros t Ht.
  pose proof (pt_nonneg t Ht). pose proof (exp_ge_1 _ (c_nonneg t Ht)). nra.
Qed.

Lemma Am_le_1 : Am n pt c <= 1.
Proof.
  rewrite <- pt_sum. unfold Am. apply sum_le. intros t Ht.
  pose proof (pt_nonneg t Ht).
  assert (exp (- c t) <= 1) by (apply exp_le_1; pose proof (c_nonneg t Ht); lra). nra.
Qed.

(** A · A⁻ ≥ 1 (the paper's Cauchy–Schwarz step), via the tangent of 1/x at A:
    1/x ≥ 2/A − x/A² for x > 0. *)
Lemma A_Am_ge_1 : 1 <= A n pt c * Am n pt c.
Proof.
  pose proof A_pos as HA.
  set (a := A n pt c) in *.
  assert (Htan : forall t, (t < n)%nat ->
            pt t * (2 / a - exp (c t) / (a * a)) <= pt t * exp (- c t)).
  { intros t Ht. apply Rmult_le_compat_l; [apply pt_nonneg; exact Ht|].
    rewrite exp_Ropp. pose proof (exp_pos (c t)) as He.
    set (x := exp (c t)) in *.
    assert (0 <= (a - x) * (a - x)) by apply Rle_0_sqr.
    apply Rmult_le_reg_r with (r := x * (a * a)).
    { apply Rmult_lt_0_compat; [lra|apply Rmult_lt_0_compat; lra]. }
    replace ((2 / a - x / (a * a)) * (x * (a * a))) with (2 * x * a - x * x) by (field; lra).
    replace (/ x * (x * (a * a))) with (a * a) by (field; lra). nra. }
  assert (Hsum : sum n (fun t => pt t * (2 / a - exp (c t) / (a * a))) <= Am n pt c)
    by (apply sum_le; exact Htan).
  assert (Heq : sum n (fun t => pt t * (2 / a - exp (c t) / (a * a))) = 1 / a).
  { rewrite (sum_ext n _ (fun t => pt t * (2 / a) - pt t * exp (c t) * / (a * a)))
      by (intros; field; lra).
    rewrite sum_minus, !sum_scal_r, pt_sum. fold (A n pt c). fold a. field. lra. }
  rewrite Heq in Hsum.
  apply Rmult_le_reg_l with (r := / a); [apply Rinv_0_lt_compat; lra|].
  replace (/ a * (a * Am n pt c)) with (Am n pt c) by (field; lra).
  replace (/ a * 1) with (1 / a) by (field; lra). exact Hsum.
Qed.


(** * TV as a p̃-expectation of the likelihood-ratio deviation

    With r_t = e^{-ε_t}/Z we have p_t = p̃_t r_t, so TV(p, p̃) = ½ E_p̃ |r − 1|. *)

Definition ratio (t : nat) : R := exp (- eps t) / Z n pt eps.

Lemma ratio_pos t : 0 < ratio t.
Proof. unfold ratio. apply Rdiv_lt_0_compat; [apply exp_pos|apply Z_pos]. Qed.

Lemma TV_ratio :
  TV n (p n pt eps) pt = / 2 * sum n (fun t => pt t * Rabs (ratio t - 1)).
Proof.
  unfold TV. f_equal. apply sum_ext. intros t Ht.
  pose proof Z_pos. pose proof (pt_nonneg t Ht).
  replace (p n pt eps t - pt t) with (pt t * (ratio t - 1))
    by (unfold p, wt, ratio; field; lra).
  rewrite Rabs_mult, (Rabs_pos_eq (pt t)) by lra. reflexivity.
Qed.

(** Any per-token bound on |r_t − 1| yields a TV bound by taking the p̃-expectation. *)
Lemma TV_le_expect (g : nat -> R) :
  (forall t, (t < n)%nat -> Rabs (ratio t - 1) <= g t) ->
  TV n (p n pt eps) pt <= / 2 * sum n (fun t => pt t * g t).
Proof.
  intros Hg. rewrite TV_ratio. apply Rmult_le_compat_l; [lra|].
  apply sum_le. intros t Ht. apply Rmult_le_compat_l; [apply pt_nonneg; exact Ht|].
  apply Hg. exact Ht.
Qed.

(** r_t ∈ [e^{-c_t}/A, e^{c_t}/A⁻] because A⁻ ≤ Z ≤ A (Proposition 1's proof). *)
Lemma ratio_bounds t :
  (t < n)%nat -> exp (- c t) / A n pt c <= ratio t <= exp (c t) / Am n pt c.
Proof.
  intros Ht. pose proof Z_pos. pose proof A_pos. pose proof Am_pos.
  pose proof Z_bounds as [HZ1 HZ2]. pose proof (exp_eps_bounds t Ht) as [He1 He2].
  unfold ratio. split.
  - apply Rle_trans with (exp (- c t) / Z n pt eps).
    + unfold Rdiv. apply Rmult_le_compat_l; [left; apply exp_pos|].
      apply Rinv_le_contravar; lra.
    + unfold Rdiv. apply Rmult_le_compat_r; [left; apply Rinv_0_lt_compat; lra|lra].
  - apply Rle_trans with (exp (c t) / Z n pt eps).
    + unfold Rdiv. apply Rmult_le_compat_r; [left; apply Rinv_0_lt_compat; lra|lra].
    + unfold Rdiv. apply Rmult_le_compat_l; [left; apply exp_pos|].
      apply Rinv_le_contravar; lra.
Qed.

(** TV ≤ 1 always: the clamp min(1, ·) is sound. *)
Lemma p_sum : sum n (p n pt eps) = 1.
Proof.
  pose proof Z_pos. unfold p. rewrite sum_div_r. fold (Z n pt eps). field. lra.
Qed.

Lemma TV_le_1 : TV n (p n pt eps) pt <= 1.
Proof.
  unfold TV. pose proof Z_pos.
  apply Rle_trans with (/ 2 * sum n (fun t => p n pt eps t + pt t)).
  - apply Rmult_le_compat_l; [lra|]. apply sum_le. intros t Ht.
    pose proof (pt_nonneg t Ht).
    assert (0 <= p n pt eps t).
    { unfold p, wt. apply Rmult_le_pos; [apply Rmult_le_pos; [lra|left; apply exp_pos]|].
      left. apply Rinv_0_lt_compat. lra. }
    unfold Rabs. destruct Rcase_abs; lra.
  - rewrite sum_plus, p_sum, pt_sum. lra.
Qed.

End Cell.
