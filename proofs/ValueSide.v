(** Value side: ‖y − ŷ‖ ≤ 2·TV(p, p̃)·max_t ‖v_t‖ + Σ_t p̃_t ρ^v_t with y = Σ_t p_t v_t,
    ŷ = Σ_t p̃_t v̂_t and ρ^v_t ≥ ‖v̂_t − v_t‖ ("WitCert: Sound Runtime Risk Observability and
    Gating for KV-Cache Quantization", Wei and Liu, Sec. 3 and Sec. 4.2).

    Proved for any norm (triangle inequality and absolute homogeneity) on vectors
    [nat -> R], then instantiated with the Euclidean norm on the first d coordinates. *)

From Coq Require Import Reals Lra Lia.
From WitCert Require Import Sums Defs TierA.
Open Scope R_scope.

(** Σ_t f_t as a vector, coordinate by coordinate. *)
Definition vsum (n : nat) (f : nat -> nat -> R) (i : nat) : R := sum n (fun t => f t i).

Record is_norm (N : (nat -> R) -> R) : Prop := {
  norm_ext : forall x y, (forall i, x i = y i) -> N x = N y;
  norm_triangle : forall x y, N (fun i => x i + y i) <= N x + N y;
  norm_scale : forall a x, N (fun i => a * x i) = Rabs a * N x
}.

Section Value.
Context (N : (nat -> R) -> R) (HN : is_norm N).

Lemma Rabs_m1 : Rabs (-1) = 1.
Proof. unfold Rabs. destruct Rcase_abs; lra. Qed.

Lemma norm_zero : N (fun _ => 0) = 0.
Proof.
  rewrite (norm_ext N HN (fun _ => 0) (fun i => 0 * 0)) by (intros; ring).
  rewrite (norm_scale N HN 0 (fun _ => 0)), Rabs_R0. ring.
Qed.

Lemma norm_nonneg x : 0 <= N x.
Proof.
  pose proof (norm_triangle N HN x (fun i => -1 * x i)) as H. cbv beta in H.
  rewrite (norm_ext N HN (fun i => x i + -1 * x i) (fun _ => 0)) in H by (intros; ring).
  rewrite norm_zero, (norm_scale N HN), Rabs_m1 in H. lra.
Qed.

Lemma norm_vsum n f : N (vsum n f) <= sum n (fun t => N (f t)).
Proof.
  induction n as [|n IH].
  - unfold vsum. simpl. rewrite norm_zero. lra.
  - rewrite (norm_ext N HN (vsum (S n) f) (fun i => vsum n f i + f n i)) by reflexivity.
    eapply Rle_trans; [apply (norm_triangle N HN)|]. simpl. lra.
Qed.

Lemma norm_sub_sym x y : N (fun i => x i - y i) = N (fun i => y i - x i).
Proof.
  rewrite (norm_ext N HN (fun i => x i - y i) (fun i => -1 * (y i - x i))) by (intros; ring).
  rewrite (norm_scale N HN), Rabs_m1. ring.
Qed.

(** The output bound for any weights p and any distribution-like p̃ ≥ 0. *)
Theorem value_output_bound_general n (q pt : nat -> R) (v vh : nat -> nat -> R)
    (vmax : R) (rho : nat -> R) :
  (forall t, (t < n)%nat -> 0 <= pt t) ->
  (forall t, (t < n)%nat -> N (v t) <= vmax) ->
  (forall t, (t < n)%nat -> N (fun i => vh t i - v t i) <= rho t) ->
  N (fun i => vsum n (fun t i => q t * v t i) i - vsum n (fun t i => pt t * vh t i) i)
    <= 2 * TV n q pt * vmax + sum n (fun t => pt t * rho t).
Proof.
  intros Hpt Hv Hrho.
  rewrite (norm_ext N HN _ (vsum n (fun t i => (q t - pt t) * v t i + pt t * (v t i - vh t i))))
    by (intros i; unfold vsum; rewrite <- sum_minus; apply sum_ext; intros; ring).
  eapply Rle_trans; [apply norm_vsum|].
  unfold TV. replace (2 * (/ 2 * sum n (fun t => Rabs (q t - pt t))) * vmax)
    with (sum n (fun t => Rabs (q t - pt t)) * vmax) by field.
  rewrite <- sum_scal_r, <- sum_plus. apply sum_le. intros t Ht.
  eapply Rle_trans; [apply (norm_triangle N HN)|]. cbv beta.
  rewrite (norm_scale N HN), (norm_scale N HN), (Rabs_pos_eq (pt t)) by (apply Hpt; exact Ht).
  rewrite norm_sub_sym.
  apply Rplus_le_compat.
  - apply Rmult_le_compat_l; [apply Rabs_pos|apply Hv; exact Ht].
  - apply Rmult_le_compat_l; [apply Hpt; exact Ht|apply Hrho; exact Ht].
Qed.

(** The attention cell: p is the exact distribution p ∝ p̃ e^{-ε}. *)
Theorem value_output_bound n pt eps c (v vh : nat -> nat -> R) (vmax : R) (rho : nat -> R) :
  cell n pt eps c ->
  (forall t, (t < n)%nat -> N (v t) <= vmax) ->
  (forall t, (t < n)%nat -> N (fun i => vh t i - v t i) <= rho t) ->
  N (fun i => vsum n (fun t i => p n pt eps t * v t i) i - vsum n (fun t i => pt t * vh t i) i)
    <= 2 * TV n (p n pt eps) pt * vmax + sum n (fun t => pt t * rho t).
Proof.
  intros Hc. apply value_output_bound_general. apply (pt_nonneg n pt eps c Hc).
Qed.

End Value.

(** * The Euclidean norm on the first d coordinates is a norm *)

Definition enorm (d : nat) (x : nat -> R) : R := sqrt (sum d (fun i => x i * x i)).

Lemma cauchy_schwarz d (x y : nat -> R) :
  sum d (fun i => x i * y i) * sum d (fun i => x i * y i)
  <= sum d (fun i => x i * x i) * sum d (fun i => y i * y i).
Proof.
  pose proof (cauchy_schwarz2 d x (fun _ => 0) y (fun _ => 0)) as H. simpl in H.
  rewrite (sum_ext d (fun k => x k * y k + 0 * 0) (fun i => x i * y i)) in H
    by (intros; ring).
  rewrite (sum_ext d (fun k => x k * x k + 0 * 0) (fun i => x i * x i)) in H
    by (intros; ring).
  rewrite (sum_ext d (fun k => y k * y k + 0 * 0) (fun i => y i * y i)) in H
    by (intros; ring).
  exact H.
Qed.

Lemma sumsq_nonneg d x : 0 <= sum d (fun i => x i * x i).
Proof. apply sum_nonneg. intros. apply Rle_0_sqr. Qed.

Theorem enorm_is_norm d : is_norm (enorm d).
Proof.
  split.
  - intros x y H. unfold enorm. f_equal. apply sum_ext. intros. rewrite H. reflexivity.
  - intros x y. unfold enorm.
    pose proof (sumsq_nonneg d x). pose proof (sumsq_nonneg d y).
    pose proof (cauchy_schwarz d x y) as Hcs.
    set (sx := sum d (fun i => x i * x i)) in *. set (sy := sum d (fun i => y i * y i)) in *.
    set (sxy := sum d (fun i => x i * y i)) in *.
    assert (Hxy : sxy <= sqrt sx * sqrt sy).
    { apply Rle_trans with (Rabs sxy); [apply Rle_abs|].
      rewrite <- sqrt_mult_alt by assumption. rewrite <- sqrt_Rsqr_abs.
      apply sqrt_le_1_alt. unfold Rsqr. exact Hcs. }
    rewrite <- (sqrt_Rsqr (sqrt sx + sqrt sy))
      by (apply Rplus_le_le_0_compat; apply sqrt_pos).
    apply sqrt_le_1_alt. unfold Rsqr.
    rewrite (sum_ext d (fun i => (x i + y i) * (x i + y i))
                       (fun i => x i * x i + 2 * (x i * y i) + y i * y i)) by (intros; ring).
    rewrite !sum_plus, sum_scal_l. fold sx sy sxy.
    pose proof (sqrt_sqrt sx H). pose proof (sqrt_sqrt sy H0). nra.
  - intros a x. unfold enorm.
    rewrite (sum_ext d (fun i => a * x i * (a * x i)) (fun i => Rsqr a * (x i * x i)))
      by (intros; unfold Rsqr; ring).
    rewrite sum_scal_l, sqrt_mult_alt by apply Rle_0_sqr.
    rewrite sqrt_Rsqr_abs. reflexivity.
Qed.

(** The value-side bound with Euclidean norms, as the paper states it. *)
Corollary value_output_bound_euclid d n pt eps c (v vh : nat -> nat -> R) vmax rho :
  cell n pt eps c ->
  (forall t, (t < n)%nat -> enorm d (v t) <= vmax) ->
  (forall t, (t < n)%nat -> enorm d (fun i => vh t i - v t i) <= rho t) ->
  enorm d (fun i => vsum n (fun t i => p n pt eps t * v t i) i
                    - vsum n (fun t i => pt t * vh t i) i)
    <= 2 * TV n (p n pt eps) pt * vmax + sum n (fun t => pt t * rho t).
Proof. apply value_output_bound. apply enorm_is_norm. Qed.
