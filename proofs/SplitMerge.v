(** Split-KV merge: the meter's statistics of a cell split into two token ranges, merged
    with log-sum-exp weights, equal the statistics of the unsplit cell, so merging never
    changes the meter ("WitCert: Sound Runtime Risk Observability and Gating for KV-Cache
    Quantization", Wei and Liu, Sec. 4.3 and the split-KV argument of Sec. 6.2.2).

    Tokens [0, n1) form the first split and [n1, n1 + n2) the second; [shift n1 f] reads the
    second split's token t as token n1 + t.  More splits merge pairwise. *)

From Coq Require Import Reals Lra Lia.
From WitCert Require Import Sums Defs.
Open Scope R_scope.

Definition shift (n1 : nat) (f : nat -> R) (t : nat) : R := f (n1 + t)%nat.

(** Partial softmax sum Z = Σ_t e^{z_t} and softmax-weighted sum and average of g. *)
Definition Zs (n : nat) (z : nat -> R) : R := sum n (fun t => exp (z t)).
Definition wsum (n : nat) (z g : nat -> R) : R := sum n (fun t => exp (z t) * g t).
Definition avg (n : nat) (z g : nat -> R) : R := wsum n z g / Zs n z.
Definition softmax (n : nat) (z : nat -> R) (t : nat) : R := exp (z t) / Zs n z.

Lemma Zs_split n1 n2 z : Zs (n1 + n2) z = Zs n1 z + Zs n2 (shift n1 z).
Proof. unfold Zs. rewrite sum_split. reflexivity. Qed.

Lemma wsum_split n1 n2 z g :
  wsum (n1 + n2) z g = wsum n1 z g + wsum n2 (shift n1 z) (shift n1 g).
Proof. unfold wsum. rewrite sum_split. reflexivity. Qed.

Lemma Zs_pos n z : (0 < n)%nat -> 0 < Zs n z.
Proof.
  destruct n as [|n]; [lia|]. intros _. unfold Zs. simpl.
  pose proof (exp_pos (z n)).
  assert (0 <= sum n (fun t => exp (z t))) by (apply sum_nonneg; intros; left; apply exp_pos).
  lra.
Qed.

(** The merge of two softmax-weighted averages: (Z1·a1 + Z2·a2)/(Z1 + Z2) is the average
    over the union, for any per-token quantity g. *)
Theorem merge_avg n1 n2 z g :
  (0 < n1)%nat -> (0 < n2)%nat ->
  (Zs n1 z * avg n1 z g + Zs n2 (shift n1 z) * avg n2 (shift n1 z) (shift n1 g))
    / (Zs n1 z + Zs n2 (shift n1 z))
  = avg (n1 + n2) z g.
Proof.
  intros H1 H2. pose proof (Zs_pos n1 z H1). pose proof (Zs_pos n2 (shift n1 z) H2).
  unfold avg. rewrite Zs_split, wsum_split. field. lra.
Qed.

(** A and A⁻ of Defs.v, with p̃ = softmax(z̃), are such averages. *)
Lemma A_softmax n z c : (0 < n)%nat -> A n (softmax n z) c = avg n z (fun t => exp (c t)).
Proof.
  intros Hn. pose proof (Zs_pos n z Hn).
  unfold A, softmax, avg, wsum. rewrite <- sum_div_r. apply sum_ext. intros. field. lra.
Qed.

Lemma Am_softmax n z c :
  (0 < n)%nat -> Am n (softmax n z) c = avg n z (fun t => exp (- c t)).
Proof.
  intros Hn. pose proof (Zs_pos n z Hn).
  unfold Am, softmax, avg, wsum. rewrite <- sum_div_r. apply sum_ext. intros. field. lra.
Qed.

(** Merged A, A⁻ and attention output (any coordinate i of Σ_t p̃_t v_t) equal the unsplit
    values; c_max merges by max. *)
Theorem merge_A n1 n2 z c :
  (0 < n1)%nat -> (0 < n2)%nat ->
  (Zs n1 z * A n1 (softmax n1 z) c
   + Zs n2 (shift n1 z) * A n2 (softmax n2 (shift n1 z)) (shift n1 c))
    / (Zs n1 z + Zs n2 (shift n1 z))
  = A (n1 + n2) (softmax (n1 + n2) z) c.
Proof.
  intros H1 H2. rewrite !A_softmax by lia. apply (merge_avg n1 n2 z (fun t => exp (c t)));
  assumption.
Qed.

Theorem merge_Am n1 n2 z c :
  (0 < n1)%nat -> (0 < n2)%nat ->
  (Zs n1 z * Am n1 (softmax n1 z) c
   + Zs n2 (shift n1 z) * Am n2 (softmax n2 (shift n1 z)) (shift n1 c))
    / (Zs n1 z + Zs n2 (shift n1 z))
  = Am (n1 + n2) (softmax (n1 + n2) z) c.
Proof.
  intros H1 H2. rewrite !Am_softmax by lia.
  apply (merge_avg n1 n2 z (fun t => exp (- c t))); assumption.
Qed.

Theorem merge_output n1 n2 z (v : nat -> nat -> R) (i : nat) :
  (0 < n1)%nat -> (0 < n2)%nat ->
  (Zs n1 z * sum n1 (fun t => softmax n1 z t * v t i)
   + Zs n2 (shift n1 z) * sum n2 (fun t => softmax n2 (shift n1 z) t * v (n1 + t)%nat i))
    / (Zs n1 z + Zs n2 (shift n1 z))
  = sum (n1 + n2) (fun t => softmax (n1 + n2) z t * v t i).
Proof.
  intros H1 H2.
  assert (Hav : forall n z' g, (0 < n)%nat ->
            sum n (fun t => softmax n z' t * g t) = avg n z' g).
  { intros n z' g Hn. pose proof (Zs_pos n z' Hn). unfold softmax, avg, wsum.
    rewrite <- sum_div_r. apply sum_ext. intros. field. lra. }
  rewrite (Hav n1 z (fun t => v t i)) by exact H1.
  rewrite (Hav n2 (shift n1 z) (fun t => v (n1 + t)%nat i)) by exact H2.
  rewrite (Hav (n1 + n2)%nat z (fun t => v t i)) by lia.
  apply (merge_avg n1 n2 z (fun t => v t i)); assumption.
Qed.

Theorem merge_cmax n1 n2 c :
  maxn (n1 + n2) c = Rmax (maxn n1 c) (maxn n2 (shift n1 c)).
Proof. apply maxn_split. Qed.

(** * The log-domain form the code uses

    A log-sum-exp is held as (m, s) with LSE = m + ln s and s = Σ_t e^{x_t − m}; two
    partial ones merge by rescaling to the larger reference point. *)

Record lse := { lse_m : R; lse_s : R }.

Definition represents (l : lse) (n : nat) (x : nat -> R) : Prop :=
  lse_s l = sum n (fun t => exp (x t - lse_m l)).

Definition lse_value (l : lse) : R := lse_m l + ln (lse_s l).

Definition lse_merge (l1 l2 : lse) : lse :=
  if Rle_dec (lse_m l2) (lse_m l1)
  then {| lse_m := lse_m l1; lse_s := lse_s l1 + lse_s l2 * exp (lse_m l2 - lse_m l1) |}
  else {| lse_m := lse_m l2; lse_s := lse_s l1 * exp (lse_m l1 - lse_m l2) + lse_s l2 |}.

Theorem lse_merge_represents l1 l2 n1 n2 x :
  represents l1 n1 x -> represents l2 n2 (shift n1 x) ->
  represents (lse_merge l1 l2) (n1 + n2) x.
Proof.
  unfold represents, lse_merge, shift. intros H1 H2.
  rewrite sum_split. destruct Rle_dec; simpl; rewrite H1, H2.
  - rewrite <- sum_scal_r. f_equal. apply sum_ext. intros.
    rewrite <- exp_plus. f_equal. ring.
  - rewrite <- sum_scal_r. f_equal. apply sum_ext. intros.
    rewrite <- exp_plus. f_equal. ring.
Qed.

Lemma lse_value_sum l n x :
  represents l n x -> (0 < n)%nat -> lse_value l = ln (Zs n x).
Proof.
  unfold represents, lse_value, Zs. intros H Hn.
  assert (Hs : sum n (fun t => exp (x t)) = exp (lse_m l) * lse_s l).
  { rewrite H, <- sum_scal_l. apply sum_ext. intros. rewrite <- exp_plus. f_equal. ring. }
  assert (0 < lse_s l).
  { rewrite H. apply (Zs_pos n (fun t => x t - lse_m l) Hn). }
  rewrite Hs, ln_mult, ln_exp; [reflexivity|apply exp_pos|assumption].
Qed.

(** log A = LSE(z̃ + c) − LSE(z̃): merged in the log domain, it is the unsplit log A. *)
Theorem merge_log_A l1 l2 k1 k2 n1 n2 z c :
  (0 < n1)%nat -> (0 < n2)%nat ->
  represents l1 n1 z -> represents l2 n2 (shift n1 z) ->
  represents k1 n1 (fun t => z t + c t) -> represents k2 n2 (shift n1 (fun t => z t + c t)) ->
  lse_value (lse_merge k1 k2) - lse_value (lse_merge l1 l2)
  = ln (A (n1 + n2) (softmax (n1 + n2) z) c).
Proof.
  intros Hn1 Hn2 H1 H2 H3 H4.
  rewrite (lse_value_sum _ (n1 + n2) _ (lse_merge_represents _ _ _ _ _ H3 H4)) by lia.
  rewrite (lse_value_sum _ (n1 + n2) _ (lse_merge_represents _ _ _ _ _ H1 H2)) by lia.
  assert (Hpos : (0 < n1 + n2)%nat) by lia.
  pose proof (Zs_pos _ z Hpos). pose proof (Zs_pos _ (fun t => z t + c t) Hpos).
  rewrite A_softmax by exact Hpos. unfold avg, wsum, Zs in *.
  rewrite (sum_ext _ (fun t => exp (z t) * exp (c t)) (fun t => exp (z t + c t)))
    by (intros; rewrite exp_plus; reflexivity).
  unfold Rdiv. rewrite ln_mult, ln_Rinv; try ring; try lra; apply Rinv_0_lt_compat; lra.
Qed.

Theorem merge_log_Am l1 l2 k1 k2 n1 n2 z c :
  (0 < n1)%nat -> (0 < n2)%nat ->
  represents l1 n1 z -> represents l2 n2 (shift n1 z) ->
  represents k1 n1 (fun t => z t - c t) -> represents k2 n2 (shift n1 (fun t => z t - c t)) ->
  lse_value (lse_merge k1 k2) - lse_value (lse_merge l1 l2)
  = ln (Am (n1 + n2) (softmax (n1 + n2) z) c).
Proof.
  intros Hn1 Hn2 H1 H2 H3 H4.
  rewrite (lse_value_sum _ (n1 + n2) _ (lse_merge_represents _ _ _ _ _ H3 H4)) by lia.
  rewrite (lse_value_sum _ (n1 + n2) _ (lse_merge_represents _ _ _ _ _ H1 H2)) by lia.
  assert (Hpos : (0 < n1 + n2)%nat) by lia.
  pose proof (Zs_pos _ z Hpos). pose proof (Zs_pos _ (fun t => z t - c t) Hpos).
  rewrite Am_softmax by exact Hpos. unfold avg, wsum, Zs in *.
  rewrite (sum_ext _ (fun t => exp (z t) * exp (- c t)) (fun t => exp (z t - c t)))
    by (intros; rewrite <- exp_plus; reflexivity).
  unfold Rdiv. rewrite ln_mult, ln_Rinv; try ring; try lra; apply Rinv_0_lt_compat; lra.
Qed.
