(** Tier B ("WitCert: Sound Runtime Risk Observability and Gating for KV-Cache
    Quantization", Wei and Liu, Sec. 4.2), under named assumptions.

    The standard library has no measure theory, so probability enters as parameters of the
    section [TierB] (declared with [Context]; every theorem below takes them as arguments and
    rests on no axiom beyond the standard library's real numbers):
    - [Pr], a function from events to reals with the three properties any probability
      measure has and that the union bound uses: [Pr_mono], [Pr_union], [Pr_empty];
    - [subgaussian_tail]: for every token t and u ≥ 0,
      Pr(|ε_t| > u) ≤ 2 exp(−u² / (2 ς_t²)).  This is what Lemma 2 (the sub-Gaussian proxy of
      subtractive dither, with non-adaptive queries) gives through the Chernoff bound; it is
      assumed here, not proved.
    Proved from them: the radius u_t = sqrt(2 ς_t² log(2S/δ)) makes each token's tail δ/S,
    the union bound over the S tokens gives a joint failure probability ≤ δ, on the
    complementary event the e-form with c := u bounds TV, and δ_loc = δ_req/(L·H·T) over
    L·H·T cells keeps a request's failure probability ≤ δ_req. *)

From Coq Require Import Reals Lra Lia.
From WitCert Require Import Sums Defs EForm.
Open Scope R_scope.

Lemma sum_const n k : sum n (fun _ => k) = INR n * k.
Proof. induction n; simpl sum; [simpl; ring|]. rewrite IHn, S_INR. ring. Qed.

(** The Tier-B radius for variance proxy [s2], S tokens and failure budget [delta]. *)
Definition radius (s2 S delta : R) : R := sqrt (2 * s2 * ln (2 * S / delta)).

Lemma radius_tail s2 S delta :
  0 < s2 -> 0 < delta -> delta <= 2 * S ->
  2 * exp (- (radius s2 S delta * radius s2 S delta) / (2 * s2)) = delta / S.
Proof.
  intros Hs Hd HS. unfold radius.
  assert (HS0 : 0 < S) by lra.
  assert (Hq : 1 <= 2 * S / delta).
  { apply Rmult_le_reg_r with delta; [exact Hd|].
    replace (2 * S / delta * delta) with (2 * S) by (field; lra). lra. }
  assert (Hln : 0 <= ln (2 * S / delta)).
  { destruct Hq as [Hq|Hq]; [|rewrite <- Hq, ln_1; lra].
    rewrite <- ln_1. left. apply ln_increasing; lra. }
  rewrite sqrt_sqrt by (apply Rmult_le_pos; [lra|exact Hln]).
  replace (- (2 * s2 * ln (2 * S / delta)) / (2 * s2)) with (- ln (2 * S / delta))
    by (field; lra).
  rewrite exp_Ropp, exp_ln by (apply Rdiv_lt_0_compat; lra). field. lra.
Qed.

Section TierB.
Context (Omega : Type) (Pr : (Omega -> Prop) -> R).
Context (Pr_mono : forall E F : Omega -> Prop, (forall w, E w -> F w) -> Pr E <= Pr F).
Context (Pr_union : forall E F : Omega -> Prop, Pr (fun w => E w \/ F w) <= Pr E + Pr F).
Context (Pr_empty : Pr (fun _ => False) = 0).

(** The union bound over a finite family of events. *)
Theorem union_bound n (E : nat -> Omega -> Prop) :
  Pr (fun w => exists t, (t < n)%nat /\ E t w) <= sum n (fun t => Pr (E t)).
Proof.
  induction n as [|n IH].
  - simpl. rewrite <- Pr_empty. apply Pr_mono. intros w [t [Ht _]]. lia.
  - simpl. eapply Rle_trans; [|apply Rplus_le_compat_r; exact IH].
    eapply Rle_trans; [|apply Pr_union]. apply Pr_mono.
    intros w [t [Ht HE]]. destruct (Nat.eq_dec t n) as [->|Hne]; [right; exact HE|].
    left. exists t. split; [lia|exact HE].
Qed.

(** A request: L·H·T cells, each failing with probability at most δ_req/(L·H·T). *)
Theorem request_budget cells (F : nat -> Omega -> Prop) delta_req :
  (0 < cells)%nat ->
  (forall k, (k < cells)%nat -> Pr (F k) <= delta_req / INR cells) ->
  Pr (fun w => exists k, (k < cells)%nat /\ F k w) <= delta_req.
Proof.
  intros Hc HF. eapply Rle_trans; [apply union_bound|].
  eapply Rle_trans; [apply sum_le; exact HF|].
  rewrite sum_const. right. field. apply not_0_INR. lia.
Qed.

(** One cell: S tokens with logit errors ε_t (random) and variance proxies ς_t². *)
Context (S : nat) (eps : nat -> Omega -> R) (s2 : nat -> R).
Context (subgaussian_tail : forall t u, (t < S)%nat -> 0 <= u ->
           Pr (fun w => u < Rabs (eps t w)) <= 2 * exp (- (u * u) / (2 * s2 t))).

Definition u (delta : R) (t : nat) : R := radius (s2 t) (INR S) delta.

(** With probability at least 1 − δ, |ε_t| ≤ u_t for every token jointly. *)
Theorem tier_b_joint delta :
  (forall t, (t < S)%nat -> 0 < s2 t) -> 0 < delta -> delta <= 2 * INR S ->
  Pr (fun w => exists t, (t < S)%nat /\ u delta t < Rabs (eps t w)) <= delta.
Proof.
  intros Hs Hd HS.
  assert (HS0 : (0 < S)%nat).
  { destruct S; [simpl in HS; lra|lia]. }
  eapply Rle_trans; [apply union_bound|].
  eapply Rle_trans.
  - apply sum_le. intros t Ht. apply subgaussian_tail; [exact Ht|apply sqrt_pos].
  - rewrite (sum_ext S _ (fun _ => delta / INR S)).
    + rewrite sum_const. right. field. apply not_0_INR. lia.
    + intros t Ht. unfold u. apply radius_tail; auto.
Qed.

(** Outside that event, Theorem 1 with c := u bounds the cell's TV. *)
Theorem tier_b_meter delta (pt : nat -> R) (w : Omega) :
  distribution S pt ->
  ~ (exists t, (t < S)%nat /\ u delta t < Rabs (eps t w)) ->
  TV S (p S pt (fun t => eps t w)) pt <= eform (A S pt (u delta)).
Proof.
  intros Hd Hn. apply (eform_sound S pt (fun t => eps t w) (u delta)).
  split; [exact Hd|]. intros t Ht. apply Rnot_lt_le. intros Hlt. apply Hn.
  exists t. split; assumption.
Qed.

End TierB.
