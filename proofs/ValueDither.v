(** Value side of Tier B ("WitCert: Sound Runtime Risk Observability and Gating for KV-Cache
    Quantization", Wei and Liu, Sec. 4.2): the attention output's error from dithered values.

    Value token t, channel c is stored with its own dither: v̂_{t,c} − v_{t,c} = s_{t,c}·V_{t,c},
    the residuals V_{t,c} uniform on [−½, ½], independent of each other, of the keys' dither and
    of the query.  The output error of channel c is e_c = Σ_t p̃_t s_{t,c} V_{t,c}.

    [Pr] and [E] are conditional on the query and the keys' dither: the weights p̃_t, computed
    from them, are fixed numbers here, and the assumptions on V ([mgf_factorizes],
    [uniform_mgf], as in Dither.v) hold conditionally because V is independent of both.
    Removing the conditioning (a bound that holds for every p̃ holds on average) is not
    modelled.

    Proved: per channel, e_c is sub-Gaussian with proxy σ_c² = Σ_t p̃_t² s_{t,c}²/12
    ([value_channel_tail]); jointly over the d channels with probability ≥ 1 − δ
    ([value_joint]), hence ‖e‖₂ ≤ sqrt(2 ln(2d/δ)/12 · Σ_t p̃_t² ‖s_t‖²) ([value_l2_tail]);
    surely ‖e‖₂ ≤ Σ_t p̃_t ‖s_t‖/2 ([value_l2_det]), so the smaller of the two holds on the same
    event ([value_l2_min]); the same with sure bounds ρ_t ≥ ‖s_t‖/2, the form meter.cc computes
    ([value_rho_dominates], [value_l2_tail_rho], [value_l2_min_rho]); and a cell whose key side
    fails with probability ≤ δ_K and value side with ≤ δ_V fails with probability ≤ δ_K + δ_V
    ([cell_budget], [request_budget_kv]). *)

From Coq Require Import Reals Lra Lia.
From WitCert Require Import Sums Defs TierA ValueSide Dither TierB.
Open Scope R_scope.

Lemma sum_swap n d (f : nat -> nat -> R) :
  sum d (fun c => sum n (fun t => f t c)) = sum n (fun t => sum d (fun c => f t c)).
Proof.
  induction d as [|d IH]; simpl.
  - symmetry. apply sum_const0.
  - rewrite IH, <- sum_plus. reflexivity.
Qed.

(** A decidable property either holds at some c < d or at none. *)
Lemma some_or_none d (P : nat -> Prop) : (forall c, P c \/ ~ P c) ->
  (exists c, (c < d)%nat /\ P c) \/ (forall c, (c < d)%nat -> ~ P c).
Proof.
  intros Hdec. induction d as [|d IH]; [right; intros; lia|].
  destruct IH as [[c [Hc HP]]|Hn].
  - left. exists c. split; [lia|exact HP].
  - destruct (Hdec d) as [HP|HnP].
    + left. exists d. split; [lia|exact HP].
    + right. intros c Hc. destruct (Nat.eq_dec c d) as [->|Hne]; [exact HnP|]. apply Hn. lia.
Qed.

Section ValueDither.
Context (P : ProbSpace).
(** n tokens, d channels, weights p̃, value scales s_{t,c}, residuals V_{t,c}. *)
Context (n d : nat) (pt : nat -> R) (s : nat -> nat -> R) (V : nat -> nat -> Omega P -> R).
Context (V_indep : forall c, (c < d)%nat -> mgf_factorizes (E P) n (fun t => V t c)).
Context (V_unif : forall c, (c < d)%nat -> uniform_mgf (E P) n (fun t => V t c)).
Context (V_bound : forall c, (c < d)%nat -> bounded_half n (fun t => V t c)).

Definition verr (c : nat) (w : Omega P) : R := sum n (fun t => pt t * s t c * V t c w).
Definition vproxy (c : nat) : R := proxy n (fun t => pt t * s t c).
Definition vrad (delta : R) (c : nat) : R := radius (vproxy c) (INR d) delta.

Lemma vproxy_nonneg c : 0 <= vproxy c.
Proof.
  unfold vproxy, proxy. apply Rmult_le_pos; [|lra]. apply sum_nonneg. intros. nra.
Qed.

(** (i) One channel: Pr(|e_c| > sqrt(2σ_c² ln(2d/δ))) ≤ δ/d. *)
Theorem value_channel_tail delta c :
  (c < d)%nat -> 0 < vproxy c -> 0 < delta -> delta <= 2 * INR d ->
  Pr P (fun w => vrad delta c < Rabs (verr c w)) <= delta / INR d.
Proof.
  intros Hc Hs Hd HD. rewrite <- (radius_tail (vproxy c) (INR d) delta Hs Hd HD).
  apply (subgaussian_sum P n (fun t => V t c));
    [apply V_indep|apply V_unif|apply V_bound|apply sqrt_pos]; exact Hc.
Qed.

(** (ii) All d channels jointly, with probability ≥ 1 − δ. *)
Theorem value_joint delta :
  (forall c, (c < d)%nat -> 0 < vproxy c) -> 0 < delta -> delta <= 2 * INR d ->
  Pr P (fun w => exists c, (c < d)%nat /\ vrad delta c < Rabs (verr c w)) <= delta.
Proof.
  apply (tier_b_joint (Omega P) (Pr P) (Pr_mono P) (Pr_union P) (Pr_empty P) d verr vproxy).
  intros c x Hc Hx.
  apply (subgaussian_sum P n (fun t => V t c));
    [apply V_indep|apply V_unif|apply V_bound|]; assumption.
Qed.

(** The Euclidean bound, ‖e‖₂ ≤ sqrt(2 ln(2d/δ)/12 · Σ_t p̃_t² ‖s_t‖²). *)
Definition vbound_prob (delta : R) : R :=
  sqrt (2 * ln (2 * INR d / delta) / 12 * sum n (fun t => pt t ^ 2 * sum d (fun c => s t c ^ 2))).

(** (iii) Where every channel is within its radius, the Euclidean bound holds. *)
Theorem value_l2_on_event delta w :
  0 < delta -> delta <= 2 * INR d ->
  (forall c, (c < d)%nat -> Rabs (verr c w) <= vrad delta c) ->
  enorm d (fun c => verr c w) <= vbound_prob delta.
Proof.
  intros Hd HD Hw. unfold enorm, vbound_prob. apply sqrt_le_1_alt.
  set (L := ln (2 * INR d / delta)).
  assert (HL : 0 <= L).
  { unfold L. assert (Hq : 1 <= 2 * INR d / delta).
    { apply Rmult_le_reg_r with delta; [exact Hd|].
      replace (2 * INR d / delta * delta) with (2 * INR d) by (field; lra). lra. }
    destruct Hq as [Hq|Hq]; [|rewrite <- Hq, ln_1; lra].
    rewrite <- ln_1. left. apply ln_increasing; lra. }
  apply Rle_trans with (sum d (fun c => 2 * vproxy c * L)).
  - apply sum_le. intros c Hc. specialize (Hw c Hc).
    assert (Hr : vrad delta c * vrad delta c = 2 * vproxy c * L).
    { unfold vrad, radius. apply sqrt_sqrt. pose proof (vproxy_nonneg c).
      apply Rmult_le_pos; [lra|exact HL]. }
    rewrite <- Hr. pose proof (Rabs_pos (verr c w)).
    replace (verr c w * verr c w) with (Rabs (verr c w) * Rabs (verr c w))
      by (rewrite <- Rabs_mult; apply Rabs_pos_eq; nra).
    apply Rmult_le_compat; assumption.
  - right. unfold vproxy, proxy.
    rewrite (sum_ext d _ (fun c => 2 * L / 12 * sum n (fun t => pt t ^ 2 * s t c ^ 2))).
    + rewrite sum_scal_l, sum_swap.
      rewrite (sum_ext n (fun t => pt t ^ 2 * sum d (fun c => s t c ^ 2))
                         (fun t => sum d (fun c => pt t ^ 2 * s t c ^ 2)))
        by (intros; rewrite sum_scal_l; reflexivity).
      ring.
    + intros c _. rewrite (sum_ext n (fun t => (pt t * s t c) ^ 2) (fun t => pt t ^ 2 * s t c ^ 2))
        by (intros; ring). field.
Qed.

(** With probability ≥ 1 − δ, ‖e‖₂ ≤ sqrt(2 ln(2d/δ)/12 · Σ_t p̃_t² ‖s_t‖²). *)
Theorem value_l2_tail delta :
  (forall c, (c < d)%nat -> 0 < vproxy c) -> 0 < delta -> delta <= 2 * INR d ->
  Pr P (fun w => vbound_prob delta < enorm d (fun c => verr c w)) <= delta.
Proof.
  intros Hs Hd HD. eapply Rle_trans; [|apply (value_joint delta Hs Hd HD)].
  apply (Pr_mono P). intros w Hw.
  destruct (some_or_none d (fun c => vrad delta c < Rabs (verr c w))) as [Hex|Hnone].
  - intros c. destruct (Rlt_dec (vrad delta c) (Rabs (verr c w))); [left|right]; assumption.
  - exact Hex.
  - exfalso. apply (Rlt_not_le _ _ Hw). apply value_l2_on_event; [exact Hd|exact HD|].
    intros c Hc. apply Rnot_lt_le. apply Hnone. exact Hc.
Qed.

(** (iv) Surely, since |V| ≤ ½: ‖e‖₂ ≤ Σ_t p̃_t ‖s_t‖/2. *)
Theorem value_l2_det w :
  (forall t, (t < n)%nat -> 0 <= pt t) ->
  enorm d (fun c => verr c w) <= sum n (fun t => pt t * enorm d (s t)) / 2.
Proof.
  intros Hp. pose proof (enorm_is_norm d) as HN.
  rewrite (norm_ext _ HN (fun c => verr c w) (vsum n (fun t c => pt t * (s t c * V t c w))))
    by (intros c; unfold verr, vsum; apply sum_ext; intros; ring).
  eapply Rle_trans; [apply (norm_vsum _ HN)|].
  rewrite <- sum_div_r. apply sum_le. intros t Ht.
  rewrite (norm_scale _ HN (pt t) (fun c => s t c * V t c w)), Rabs_pos_eq by (apply Hp; exact Ht).
  unfold Rdiv. rewrite Rmult_assoc. apply Rmult_le_compat_l; [apply Hp; exact Ht|].
  rewrite Rmult_comm, <- (Rabs_pos_eq (/ 2)) at 1 by lra. rewrite <- (norm_scale _ HN).
  unfold enorm. apply sqrt_le_1_alt. apply sum_le. intros c Hc.
  pose proof (V_bound c Hc t w Ht) as HV. cbv beta in HV. apply Rabs_le_inv in HV.
  assert (V t c w * V t c w <= / 2 * / 2) by nra.
  assert (0 <= s t c * s t c) by nra. nra.
Qed.

(** The minimum of the two bounds holds with probability ≥ 1 − δ. *)
Theorem value_l2_min delta :
  (forall t, (t < n)%nat -> 0 <= pt t) ->
  (forall c, (c < d)%nat -> 0 < vproxy c) -> 0 < delta -> delta <= 2 * INR d ->
  Pr P (fun w => Rmin (vbound_prob delta) (sum n (fun t => pt t * enorm d (s t)) / 2)
                 < enorm d (fun c => verr c w)) <= delta.
Proof.
  intros Hp Hs Hd HD. eapply Rle_trans; [|apply (value_l2_tail delta Hs Hd HD)].
  apply (Pr_mono P). intros w Hw. pose proof (value_l2_det w Hp).
  unfold Rmin in Hw. destruct Rle_dec; lra.
Qed.

(** 1 ≤ 2d/δ, so ln(2d/δ) ≥ 0. *)
Lemma ln_ratio_nonneg delta : 0 < delta -> delta <= 2 * INR d -> 0 <= ln (2 * INR d / delta).
Proof.
  intros Hd HD. assert (Hq : 1 <= 2 * INR d / delta).
  { apply Rmult_le_reg_r with delta; [exact Hd|].
    replace (2 * INR d / delta * delta) with (2 * INR d) by (field; lra). lra. }
  destruct Hq as [Hq|Hq]; [|rewrite <- Hq, ln_1; lra].
  rewrite <- ln_1. left. apply ln_increasing; lra.
Qed.

(** The form meter.cc computes from sure bounds ρ_t ≥ ‖s_t‖₂/2: since ‖s_t‖² ≤ 4ρ_t²,
    sqrt(2 ln(2d/δ)/12 · Σ_t p̃_t²‖s_t‖²) ≤ sqrt(2 ln(2d/δ) · Σ_t p̃_t² ρ_t² / 3). *)
Theorem value_rho_dominates (rho : nat -> R) delta :
  (forall t, (t < n)%nat -> 0 <= rho t /\ enorm d (s t) <= 2 * rho t) ->
  0 < delta -> delta <= 2 * INR d ->
  vbound_prob delta
  <= sqrt (2 * ln (2 * INR d / delta) * sum n (fun t => pt t ^ 2 * rho t ^ 2) / 3).
Proof.
  intros Hrho Hd HD. unfold vbound_prob. apply sqrt_le_1_alt.
  pose proof (ln_ratio_nonneg delta Hd HD) as HL. set (L := ln (2 * INR d / delta)) in *.
  apply Rle_trans with (2 * L / 12 * sum n (fun t => 4 * (pt t ^ 2 * rho t ^ 2))).
  - apply Rmult_le_compat_l; [lra|]. apply sum_le. intros t Ht.
    destruct (Hrho t Ht) as [Hr Hs]. assert (He : 0 <= enorm d (s t)) by apply sqrt_pos.
    assert (Hsq : sum d (fun c => s t c ^ 2) = enorm d (s t) * enorm d (s t)).
    { unfold enorm. rewrite sqrt_sqrt by apply sumsq_nonneg. apply sum_ext. intros; ring. }
    rewrite Hsq. replace (4 * (pt t ^ 2 * rho t ^ 2)) with (pt t ^ 2 * ((2 * rho t) * (2 * rho t)))
      by ring.
    apply Rmult_le_compat_l; [apply pow2_ge_0|].
    apply Rmult_le_compat; [exact He|exact He|exact Hs|exact Hs].
  - right. rewrite sum_scal_l. field.
Qed.

(** With probability ≥ 1 − δ, ‖e‖₂ ≤ sqrt(2 ln(2d/δ) · Σ_t p̃_t² ρ_t² / 3). *)
Theorem value_l2_tail_rho (rho : nat -> R) delta :
  (forall t, (t < n)%nat -> 0 <= rho t /\ enorm d (s t) <= 2 * rho t) ->
  (forall c, (c < d)%nat -> 0 < vproxy c) -> 0 < delta -> delta <= 2 * INR d ->
  Pr P (fun w => sqrt (2 * ln (2 * INR d / delta) * sum n (fun t => pt t ^ 2 * rho t ^ 2) / 3)
                 < enorm d (fun c => verr c w)) <= delta.
Proof.
  intros Hrho Hs Hd HD. eapply Rle_trans; [|apply (value_l2_tail delta Hs Hd HD)].
  apply (Pr_mono P). intros w Hw. pose proof (value_rho_dominates rho delta Hrho Hd HD). lra.
Qed.

(** The minimum with the sure bound in ρ form, Σ_t p̃_t ρ_t ≥ Σ_t p̃_t ‖s_t‖/2. *)
Theorem value_l2_min_rho (rho : nat -> R) delta :
  (forall t, (t < n)%nat -> 0 <= pt t) ->
  (forall t, (t < n)%nat -> 0 <= rho t /\ enorm d (s t) <= 2 * rho t) ->
  (forall c, (c < d)%nat -> 0 < vproxy c) -> 0 < delta -> delta <= 2 * INR d ->
  Pr P (fun w => Rmin (sqrt (2 * ln (2 * INR d / delta)
                                * sum n (fun t => pt t ^ 2 * rho t ^ 2) / 3))
                      (sum n (fun t => pt t * rho t))
                 < enorm d (fun c => verr c w)) <= delta.
Proof.
  intros Hp Hrho Hs Hd HD. eapply Rle_trans; [|apply (value_l2_tail_rho rho delta Hrho Hs Hd HD)].
  apply (Pr_mono P). intros w Hw. pose proof (value_l2_det w Hp) as Hdet.
  assert (Hsum : sum n (fun t => pt t * enorm d (s t)) / 2 <= sum n (fun t => pt t * rho t)).
  { rewrite <- sum_div_r. apply sum_le. intros t Ht. destruct (Hrho t Ht) as [_ Hr].
    pose proof (Hp t Ht). nra. }
  unfold Rmin in Hw. destruct Rle_dec; lra.
Qed.

End ValueDither.

(** (v) The budget of a cell: key side δ_K, value side δ_V, together δ_K + δ_V. *)
Section Budget.
Context (Omega : Type) (Pr : (Omega -> Prop) -> R).
Context (Pr_mono : forall A B : Omega -> Prop, (forall w, A w -> B w) -> Pr A <= Pr B).
Context (Pr_union : forall A B : Omega -> Prop, Pr (fun w => A w \/ B w) <= Pr A + Pr B).
Context (Pr_empty : Pr (fun _ => False) = 0).

Theorem cell_budget (FK FV : Omega -> Prop) dK dV :
  Pr FK <= dK -> Pr FV <= dV -> Pr (fun w => FK w \/ FV w) <= dK + dV.
Proof. intros HK HV. eapply Rle_trans; [apply Pr_union|]. lra. Qed.

(** Over a request of K cells: δ_K + δ_V ≤ δ_req/K per cell keeps the request within δ_req. *)
Theorem request_budget_kv K (FK FV : nat -> Omega -> Prop) dK dV delta_req :
  (0 < K)%nat -> dK + dV <= delta_req / INR K ->
  (forall k, (k < K)%nat -> Pr (FK k) <= dK) -> (forall k, (k < K)%nat -> Pr (FV k) <= dV) ->
  Pr (fun w => exists k, (k < K)%nat /\ (FK k w \/ FV k w)) <= delta_req.
Proof.
  intros HK Hb HFK HFV.
  apply (request_budget Omega Pr Pr_mono Pr_union Pr_empty K (fun k w => FK k w \/ FV k w) delta_req HK).
  intros k Hk. eapply Rle_trans; [apply cell_budget; [apply HFK|apply HFV]; exact Hk|exact Hb].
Qed.

End Budget.
