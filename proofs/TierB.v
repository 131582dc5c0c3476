(** Tier B ("WitCert: Sound Runtime Risk Observability and Gating for KV-Cache
    Quantization", Wei and Liu, Sec. 4.2), under named assumptions.

    The standard library has no measure theory, so probability enters as parameters of the
    section [TierB] (declared with [Context]; every theorem below takes them as arguments and
    rests on no axiom beyond the standard library's real numbers):
    - [Pr], a function from events to reals with the three properties any probability
      measure has and that the union bound uses: [Pr_mono], [Pr_union], [Pr_empty];
    - [subgaussian_tail]: for every token t and u ≥ 0,
      Pr(|ε_t| > u) ≤ 2 exp(−u² / (2 ς_t²)), for errors of any origin.
    Proved from them: the radius u_t = sqrt(2 ς_t² log(2S/δ)) makes each token's tail δ/S,
    the union bound over the S tokens gives a joint failure probability ≤ δ, on the
    complementary event the e-form with c := u bounds TV, and δ_loc = δ_req/(L·H·T) over
    L·H·T cells keeps a request's failure probability ≤ δ_req.

    For subtractive dither, section [TierBDither] proves [subgaussian_tail] (Lemma 2, through
    Chernoff's bound in Dither.v) from Markov's inequality, the independence of the channels'
    residuals and their uniform law, and restates the theorems without it
    ([tier_b_joint_dither], [tier_b_meter_dither], [tier_b_request_dither]). *)

From Coq Require Import Reals Lra Lia.
From WitCert Require Import Sums Defs EForm Dither.
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

(** * Tier B from dither: the tail is proved

    [TierBDither] replaces [subgaussian_tail] by more primitive named assumptions: Markov's
    inequality links [Pr] to an expectation [E] (both fields of the record [ProbSpace] of
    Dither.v, the section parameter [P]), and for each token t the residuals U_{t,c} of its D
    channels (the stored error is s_{t,c}·U_{t,c}) are
    - independent: [mgf_factorizes], the moment generating function of every weighted sum
      Σ_c b_c U_{t,c} is the product of the channels' ones;
    - uniform on [−½, ½]: [uniform_mgf], E[e^{μU}] = sinh(μ/2)/(μ/2).  That the residual of
      subtractive dither is uniform and independent of x is the classical fact (Schuchman's
      condition), assumed here; |U| ≤ ½ holds by construction ([dither_code_range]).
    The logit error is ε_t = Σ_c a_{t,c} U_{t,c} with a_{t,c} = sm·q_c·s_{t,c}, fixed numbers:
    the query must not depend on the dither (non-adaptive queries). *)

Definition dither_eps {Omega : Type} (D : nat) (a : nat -> nat -> R) (U : nat -> nat -> Omega -> R)
  (t : nat) (w : Omega) : R := sum D (fun c => a t c * U t c w).

Definition dither_s2 (D : nat) (a : nat -> nat -> R) (t : nat) : R := proxy D (a t).

(** ς_t² = (sm²/12)·Σ_c q_c² s_{t,c}², as the paper writes it. *)
Lemma dither_s2_logit D sm q s t :
  dither_s2 D (fun t c => sm * q c * s t c) t = sm ^ 2 / 12 * sum D (fun c => q c ^ 2 * s t c ^ 2).
Proof.
  unfold dither_s2, proxy. rewrite <- sum_scal_l, <- sum_div_r. apply sum_ext. intros. field.
Qed.

Section TierBDither.
Context (P : ProbSpace).
Context (S D : nat) (a : nat -> nat -> R) (U : nat -> nat -> Omega P -> R).
Context (U_indep : forall t, (t < S)%nat -> mgf_factorizes (E P) D (U t)).
Context (U_unif : forall t, (t < S)%nat -> uniform_mgf (E P) D (U t)).
Context (U_bound : forall t, (t < S)%nat -> bounded_half D (U t)).

(** Lemma 2 through Chernoff: the hypothesis [subgaussian_tail] of [TierB], proved. *)
Theorem dither_tail t x : (t < S)%nat -> 0 <= x ->
  Pr P (fun w => x < Rabs (dither_eps D a U t w))
    <= 2 * exp (- (x * x) / (2 * dither_s2 D a t)).
Proof.
  intros Ht Hx. unfold dither_eps, dither_s2.
  apply (subgaussian_sum P D (U t));
    [apply U_indep|apply U_unif|apply U_bound|]; assumption.
Qed.

(** With probability at least 1 − δ, |ε_t| ≤ u_t for every token jointly. *)
Theorem tier_b_joint_dither delta :
  (forall t, (t < S)%nat -> 0 < dither_s2 D a t) -> 0 < delta -> delta <= 2 * INR S ->
  Pr P (fun w => exists t, (t < S)%nat /\
         u S (dither_s2 D a) delta t < Rabs (dither_eps D a U t w)) <= delta.
Proof.
  apply (tier_b_joint (Omega P) (Pr P) (Pr_mono P) (Pr_union P) (Pr_empty P) S (dither_eps D a U)
           (dither_s2 D a)).
  exact dither_tail.
Qed.

(** Outside that event, Theorem 1 with c := u bounds the cell's TV. *)
Theorem tier_b_meter_dither delta (pt : nat -> R) (w : Omega P) :
  distribution S pt ->
  ~ (exists t, (t < S)%nat /\ u S (dither_s2 D a) delta t < Rabs (dither_eps D a U t w)) ->
  TV S (p S pt (fun t => dither_eps D a U t w)) pt <= eform (A S pt (u S (dither_s2 D a) delta)).
Proof. apply tier_b_meter. Qed.

End TierBDither.

(** A request of K cells (layer, query head, decode step), cell k with S_k tokens, weights
    a_k and residuals U_k: with δ_loc = δ_req/K per cell, some token of some cell leaves its
    radius with probability at most δ_req. *)
Section TierBRequest.
Context (P : ProbSpace).
Context (K D : nat) (S : nat -> nat) (a : nat -> nat -> nat -> R)
  (U : nat -> nat -> nat -> Omega P -> R).
Context (U_indep : forall k t, (k < K)%nat -> (t < S k)%nat -> mgf_factorizes (E P) D (U k t)).
Context (U_unif : forall k t, (k < K)%nat -> (t < S k)%nat -> uniform_mgf (E P) D (U k t)).
Context (U_bound : forall k t, (k < K)%nat -> (t < S k)%nat -> bounded_half D (U k t)).

Theorem tier_b_request_dither delta_req :
  (0 < K)%nat -> 0 < delta_req ->
  (forall k, (k < K)%nat -> delta_req / INR K <= 2 * INR (S k)) ->
  (forall k t, (k < K)%nat -> (t < S k)%nat -> 0 < dither_s2 D (a k) t) ->
  Pr P (fun w => exists k, (k < K)%nat /\ exists t, (t < S k)%nat /\
         u (S k) (dither_s2 D (a k)) (delta_req / INR K) t < Rabs (dither_eps D (a k) (U k) t w))
    <= delta_req.
Proof.
  intros HK Hd HS Hs.
  apply (request_budget (Omega P) (Pr P) (Pr_mono P) (Pr_union P) (Pr_empty P) K _ delta_req HK).
  intros k Hk.
  apply (tier_b_joint_dither P (S k) D (a k) (U k));
    [intros; apply U_indep; assumption|intros; apply U_unif; assumption
    |intros; apply U_bound; assumption|intros; apply Hs; assumption| |apply HS, Hk].
  apply Rdiv_lt_0_compat; [exact Hd|]. apply lt_0_INR. exact HK.
Qed.

End TierBRequest.
