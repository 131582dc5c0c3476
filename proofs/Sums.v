(** Finite sums over the index range [0, n): the carrier of every other file.

    [sum n f] is [f 0 + f 1 + ... + f (n-1)], defined by recursion on [n], so every
    general fact about it is proved by induction on [n]. *)

From Coq Require Import Reals Lra Lia.
Open Scope R_scope.

Fixpoint sum (n : nat) (f : nat -> R) : R :=
  match n with
  | O => 0
  | S k => sum k f + f k
  end.

Lemma sum_0 f : sum 0 f = 0.
Proof. reflexivity. Qed.

Lemma sum_S n f : sum (S n) f = sum n f + f n.
Proof. reflexivity. Qed.

Lemma sum_ext n f g : (forall t, (t < n)%nat -> f t = g t) -> sum n f = sum n g.
Proof.
  induction n as [|n IH]; intros H; simpl; [reflexivity|].
  rewrite IH by (intros; apply H; lia). rewrite (H n) by lia. reflexivity.
Qed.

Lemma sum_le n f g : (forall t, (t < n)%nat -> f t <= g t) -> sum n f <= sum n g.
Proof.
  induction n as [|n IH]; intros H; simpl; [lra|].
  assert (sum n f <= sum n g) by (apply IH; intros; apply H; lia).
  assert (f n <= g n) by (apply H; lia). lra.
Qed.

Lemma sum_nonneg n f : (forall t, (t < n)%nat -> 0 <= f t) -> 0 <= sum n f.
Proof.
  intros H. replace 0 with (sum n (fun _ => 0)).
  - apply sum_le. assumption.
  - induction n; simpl; [reflexivity|]. rewrite IHn by (intros; apply H; lia). lra.
Qed.

Lemma sum_const0 n : sum n (fun _ => 0) = 0.
Proof. induction n; simpl; [reflexivity|]. rewrite IHn. lra. Qed.

Lemma sum_plus n f g : sum n (fun t => f t + g t) = sum n f + sum n g.
Proof. induction n; simpl; [lra|]. rewrite IHn. lra. Qed.

Lemma sum_minus n f g : sum n (fun t => f t - g t) = sum n f - sum n g.
Proof. induction n; simpl; [lra|]. rewrite IHn. lra. Qed.

Lemma sum_opp n f : sum n (fun t => - f t) = - sum n f.
Proof. induction n; simpl; [lra|]. rewrite IHn. lra. Qed.

Lemma sum_scal_l n a f : sum n (fun t => a * f t) = a * sum n f.
Proof. induction n; simpl; [lra|]. rewrite IHn. lra. Qed.

Lemma sum_scal_r n a f : sum n (fun t => f t * a) = sum n f * a.
Proof. induction n; simpl; [lra|]. rewrite IHn. lra. Qed.

Lemma sum_div_r n a f : sum n (fun t => f t / a) = sum n f / a.
Proof. unfold Rdiv. apply sum_scal_r. Qed.

(** Triangle inequality for finite sums. *)
Lemma sum_abs n f : Rabs (sum n f) <= sum n (fun t => Rabs (f t)).
Proof.
  induction n; simpl.
  - rewrite Rabs_R0. lra.
  - eapply Rle_trans; [apply Rabs_triang|]. lra.
Qed.

(** Splitting a range: the first [n1] indices, then the next [n2]. *)
Lemma sum_split n1 n2 f :
  sum (n1 + n2) f = sum n1 f + sum n2 (fun t => f (n1 + t)%nat).
Proof.
  induction n2 as [|n2 IH]; simpl.
  - rewrite Nat.add_0_r. lra.
  - rewrite Nat.add_succ_r. simpl. rewrite IH. lra.
Qed.

(** Regrouping [B*P] indices into [B] contiguous blocks of [P]. *)
Lemma sum_blocks B P f :
  sum (B * P) f = sum B (fun b => sum P (fun k => f (b * P + k)%nat)).
Proof.
  induction B as [|B IH]; simpl; [reflexivity|].
  replace (P + B * P)%nat with (B * P + P)%nat by lia.
  rewrite sum_split, IH. reflexivity.
Qed.

(** A weighted sum of positive terms with positive total weight is positive. *)
Lemma sum_pos_weighted n p g :
  (forall t, (t < n)%nat -> 0 <= p t) ->
  (forall t, (t < n)%nat -> 0 < g t) ->
  0 < sum n p -> 0 < sum n (fun t => p t * g t).
Proof.
  induction n as [|n IH]; intros Hp Hg Hs; simpl in *; [lra|].
  assert (0 <= sum n p) by (apply sum_nonneg; intros; apply Hp; lia).
  assert (0 <= p n) by (apply Hp; lia).
  assert (0 < g n) by (apply Hg; lia).
  destruct (Rlt_dec 0 (sum n p)) as [Hpos|Hz].
  - assert (0 < sum n (fun t => p t * g t)).
    { apply IH; [intros t Ht; apply Hp; lia | intros t Ht; apply Hg; lia | exact Hpos]. }
    assert (0 <= p n * g n) by (apply Rmult_le_pos; lra). lra.
  - assert (0 <= sum n (fun t => p t * g t)).
    { apply sum_nonneg. intros t Ht. apply Rmult_le_pos; [apply Hp; lia|].
      left. apply Hg. lia. }
    assert (0 < p n) by lra.
    assert (0 < p n * g n) by (apply Rmult_lt_0_compat; lra). lra.
Qed.

(** The maximum of [f 0, ..., f (n-1)] and 0 (the meter's [c_max]; every [c_t] is
    non-negative, so including 0 changes nothing). *)
Fixpoint maxn (n : nat) (f : nat -> R) : R :=
  match n with
  | O => 0
  | S k => Rmax (maxn k f) (f k)
  end.

Lemma maxn_ge n f t : (t < n)%nat -> f t <= maxn n f.
Proof.
  induction n as [|n IH]; intros Ht; simpl; [lia|].
  destruct (Nat.eq_dec t n) as [->|Hne].
  - apply Rmax_r.
  - eapply Rle_trans; [apply IH; lia|apply Rmax_l].
Qed.

Lemma maxn_nonneg n f : 0 <= maxn n f.
Proof.
  induction n; simpl; [lra|]. eapply Rle_trans; [exact IHn|apply Rmax_l].
Qed.

Lemma maxn_split n1 n2 f :
  maxn (n1 + n2) f = Rmax (maxn n1 f) (maxn n2 (fun t => f (n1 + t)%nat)).
Proof.
  induction n2 as [|n2 IH]; simpl.
  - rewrite Nat.add_0_r. symmetry. apply Rmax_left. apply maxn_nonneg.
  - rewrite Nat.add_succ_r. simpl. rewrite IH.
    unfold Rmax. repeat destruct Rle_dec; lra.
Qed.
