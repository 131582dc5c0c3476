(** Subtractive dither: the real-analysis core of Lemma 2 of "WitCert: Sound Runtime Risk
    Observability and Gating for KV-Cache Quantization" (Wei and Liu, Sec. 4.2), and the
    Chernoff bound built on it.

    A key or value x is stored as x̂ = s·(k − ξ) with k an integer within ½ of x/s + ξ and
    ξ ~ U[−½, ½).  The error is x̂ − x = s·U with U = k − (x/s + ξ) ∈ [−½, ½].
    - (a) [sinh_le]: sinh x ≤ x·e^{x²/6} for x ≥ 0 (exponential series, term by term:
      (2k+1)! ≥ 6^k·k!).
    - (b) [uniform_mgf_integral], [uniform_mgf_bound], [mgf_unif_bound]: the moment generating
      function of U uniform on [−½, ½], ∫_{−½}^{½} e^{μu} du = sinh(μ/2)/(μ/2), is at most
      e^{μ²/24}: U is sub-Gaussian with variance proxy 1/12.
    - (d) [dither_code_range], [dither_code_bits]: with |x| ≤ (Q − ½)·s the code satisfies
      |k| ≤ Q = 2^{B−1} − 1 and |x̂ − x| ≤ s/2, for every bit width B; only s depends on B.
    - (c) [subgaussian_sum]: Chernoff's bound Pr(|Σ_i a_i U_i| > u) ≤ 2 e^{−u²/(2σ²)},
      σ² = Σ_i a_i²/12, for fixed weights a_i, from named assumptions (section [Chernoff]).

    The weights a_i must not depend on the dither: in Tier B the query is non-adaptive. *)

From Coq Require Import Reals Lra Lia.
From WitCert Require Import Sums Defs.
Open Scope R_scope.

(** * (a) sinh x ≤ x·e^{x²/6} *)

Lemma sum_f_R0_sum f n : sum_f_R0 f n = sum (S n) f.
Proof. induction n; simpl in *; [ring|]. rewrite IHn. reflexivity. Qed.

(** The terms x^i/i! of the exponential series, whose partial sums converge to exp x. *)
Definition exp_term (x : R) (i : nat) : R := / INR (fact i) * x ^ i.

Lemma exp_partial_cv x : Un_cv (fun n => sum (S n) (exp_term x)) (exp x).
Proof.
  intros e He. destruct (proj2_sig (exist_exp x) e He) as [N HN].
  exists N. intros n Hn. rewrite <- sum_f_R0_sum. apply HN. exact Hn.
Qed.

(** For x ≥ 0 the partial sums increase, so each is at most their limit. *)
Lemma exp_partial_le x n : 0 <= x -> sum n (exp_term x) <= exp x.
Proof.
  intros Hx. destruct n as [|n]; [simpl; left; apply exp_pos|].
  apply (growing_ineq (fun n => sum (S n) (exp_term x))); [|apply exp_partial_cv].
  intros k. change (sum (S (S k)) (exp_term x)) with (sum (S k) (exp_term x) + exp_term x (S k)).
  assert (0 <= exp_term x (S k)); [|lra].
  unfold exp_term. apply Rmult_le_pos; [left; apply Rinv_0_lt_compat, INR_fact_lt_0|].
  apply pow_le. exact Hx.
Qed.

(** (2k+1)! ≥ 6^k·k!: each step multiplies the left by (2k+3)(2k+2) ≥ 6(k+1). *)
Lemma fact_odd_ge k : (6 ^ k * fact k <= fact (2 * k + 1))%nat.
Proof.
  induction k as [|k IH]; [simpl; lia|].
  replace (2 * S k + 1)%nat with (S (S (2 * k + 1))) by lia.
  rewrite !fact_simpl, Nat.pow_succ_r'.
  set (F := fact (2 * k + 1)) in *. set (G := fact k) in *. set (P := (6 ^ k)%nat) in *.
  nia.
Qed.

(** So x^{2k+1}/(2k+1)! ≤ x·(x²/6)^k/k!, the k-th term of x·e^{x²/6}. *)
Lemma odd_term_le x k : 0 <= x ->
  / INR (fact (2 * k + 1)) * x ^ (2 * k + 1) <= x * exp_term (x ^ 2 / 6) k.
Proof.
  intros Hx. unfold exp_term.
  assert (Hle : 6 ^ k * INR (fact k) <= INR (fact (2 * k + 1))).
  { replace 6 with (INR 6) by (simpl; ring). rewrite <- pow_INR, <- mult_INR. apply le_INR, fact_odd_ge. }
  replace (x ^ (2 * k + 1)) with (x * (x ^ 2) ^ k) by (rewrite pow_add, pow_mult; ring).
  replace ((x ^ 2 / 6) ^ k) with ((x ^ 2) ^ k / 6 ^ k) by (unfold Rdiv; rewrite Rpow_mult_distr, pow_inv; reflexivity).
  assert (H2 : 0 <= (x ^ 2) ^ k) by (apply pow_le; nra).
  assert (Hf : 0 < INR (fact k)) by apply INR_fact_lt_0.
  assert (H6 : 0 < 6 ^ k) by (apply pow_lt; lra).
  replace (/ INR (fact k) * ((x ^ 2) ^ k / 6 ^ k)) with ((x ^ 2) ^ k * / (6 ^ k * INR (fact k))) by (field; lra).
  replace (/ INR (fact (2 * k + 1)) * (x * (x ^ 2) ^ k)) with (x * ((x ^ 2) ^ k * / INR (fact (2 * k + 1)))) by ring.
  apply Rmult_le_compat_l; [exact Hx|]. apply Rmult_le_compat_l; [exact H2|].
  apply Rinv_le_contravar; [apply Rmult_lt_0_compat; assumption|exact Hle].
Qed.

Lemma pow_opp_even x k : (- x) ^ (2 * k) = x ^ (2 * k).
Proof. rewrite !pow_mult. f_equal. ring. Qed.

(** The odd part of the exponential series: Σ_{i<2(n+1)} (x^i − (−x)^i)/i! = 2 Σ_{k≤n} x^{2k+1}/(2k+1)!. *)
Lemma odd_part x n :
  sum (2 * S n) (exp_term x) - sum (2 * S n) (exp_term (- x))
  = 2 * sum (S n) (fun k => / INR (fact (2 * k + 1)) * x ^ (2 * k + 1)).
Proof.
  rewrite <- sum_minus, Nat.mul_comm, sum_blocks, <- sum_scal_l.
  apply sum_ext. intros k _. simpl sum. unfold exp_term.
  replace (k * 2 + 0)%nat with (2 * k)%nat by lia.
  replace (k * 2 + 1)%nat with (2 * k + 1)%nat by lia.
  rewrite !pow_add, pow_opp_even. ring.
Qed.

(** (a) sinh x ≤ x·e^{x²/6} for x ≥ 0: the odd partial sums of (e^x − e^{−x})/2 are bounded
    term by term, and their limit is sinh x. *)
Theorem sinh_le x : 0 <= x -> sinh x <= x * exp (x ^ 2 / 6).
Proof.
  intros Hx. destruct (Rle_dec (sinh x) (x * exp (x ^ 2 / 6))) as [H|H]; [exact H|exfalso].
  apply Rnot_le_lt in H. set (e := sinh x - x * exp (x ^ 2 / 6)).
  assert (He : 0 < e) by (unfold e; lra).
  destruct (exp_partial_cv x e He) as [N1 H1].
  destruct (exp_partial_cv (- x) e He) as [N2 H2].
  set (m := (2 * max N1 N2 + 1)%nat).
  specialize (H1 m ltac:(unfold m; lia)). specialize (H2 m ltac:(unfold m; lia)).
  unfold R_dist in H1, H2. apply Rabs_def2 in H1. apply Rabs_def2 in H2.
  replace (S m) with (2 * S (max N1 N2))%nat in H1, H2 by (unfold m; lia).
  pose proof (odd_part x (max N1 N2)) as Ho.
  assert (Hb : sum (S (max N1 N2)) (fun k => / INR (fact (2 * k + 1)) * x ^ (2 * k + 1))
               <= x * exp (x ^ 2 / 6)).
  { eapply Rle_trans; [apply sum_le; intros k _; apply odd_term_le; exact Hx|].
    rewrite sum_scal_l. apply Rmult_le_compat_l; [exact Hx|].
    apply exp_partial_le. nra. }
  unfold e in *. unfold sinh in *. lra.
Qed.
(** * (b) The moment generating function of the uniform residual *)

Lemma sinh_opp x : sinh (- x) = - sinh x.
Proof. unfold sinh. rewrite Ropp_involutive. field. Qed.

Lemma sinh_pos x : 0 < x -> 0 < sinh x.
Proof. intros H. unfold sinh. assert (exp (- x) < exp x) by (apply exp_increasing; lra). lra. Qed.

(** sinh(x)/x ≤ e^{x²/6} for every x ≠ 0. *)
Lemma sinh_div_le x : x <> 0 -> sinh x / x <= exp (x ^ 2 / 6).
Proof.
  intros Hx. destruct (Rlt_or_le 0 x) as [Hp|Hn].
  - apply Rmult_le_reg_r with x; [exact Hp|].
    replace (sinh x / x * x) with (sinh x) by (field; lra).
    rewrite Rmult_comm. apply sinh_le. lra.
  - replace (sinh x / x) with (sinh (- x) / (- x)) by (rewrite sinh_opp; field; lra).
    replace (x ^ 2) with ((- x) ^ 2) by ring.
    apply Rmult_le_reg_r with (- x); [lra|].
    replace (sinh (- x) / - x * - x) with (sinh (- x)) by (field; lra).
    rewrite Rmult_comm. apply sinh_le. lra.
Qed.

Lemma sinh_div_pos x : x <> 0 -> 0 < sinh x / x.
Proof.
  intros Hx. destruct (Rlt_or_le 0 x) as [Hp|Hn].
  - apply Rdiv_lt_0_compat; [apply sinh_pos|]; lra.
  - replace (sinh x / x) with (sinh (- x) / (- x)) by (rewrite sinh_opp; field; lra).
    apply Rdiv_lt_0_compat; [apply sinh_pos|]; lra.
Qed.

(** (b) The moment generating function of U uniform on [−½, ½]: E[e^{μU}] = sinh(μ/2)/(μ/2),
    and 1 at μ = 0. *)
Definition mgf_unif (mu : R) : R :=
  if Req_EM_T mu 0 then 1 else sinh (mu / 2) / (mu / 2).

Theorem uniform_mgf_bound mu : mu <> 0 -> sinh (mu / 2) / (mu / 2) <= exp (mu ^ 2 / 24).
Proof.
  intros H. replace (mu ^ 2 / 24) with ((mu / 2) ^ 2 / 6) by field.
  apply sinh_div_le. lra.
Qed.

Theorem mgf_unif_bound mu : mgf_unif mu <= exp (mu ^ 2 / 24).
Proof.
  unfold mgf_unif. destruct (Req_EM_T mu 0) as [->|H].
  - apply exp_ge_1. lra.
  - apply uniform_mgf_bound. exact H.
Qed.

Lemma mgf_unif_pos mu : 0 < mgf_unif mu.
Proof.
  unfold mgf_unif. destruct (Req_EM_T mu 0) as [_|H]; [lra|]. apply sinh_div_pos. lra.
Qed.

(** For the residual s·U of a step s: E[e^{λsU}] ≤ e^{λ²s²/24}. *)
Corollary mgf_unif_scaled_bound lam s : mgf_unif (lam * s) <= exp (lam ^ 2 * s ^ 2 / 24).
Proof. replace (lam ^ 2 * s ^ 2) with ((lam * s) ^ 2) by ring. apply mgf_unif_bound. Qed.

(** [mgf_unif] is the uniform law's moment generating function: the integral of e^{μu} over
    [−½, ½], by the fundamental theorem of calculus with the primitive e^{μu}/μ. *)
Definition unif_prim (mu u : R) : R := / mu * exp (mu * u).

Lemma unif_prim_lim mu x : mu <> 0 -> derivable_pt_lim (unif_prim mu) x (exp (mu * x)).
Proof.
  intros H.
  pose proof (derivable_pt_lim_scal id mu x 1 (derivable_pt_lim_id x)) as H1.
  pose proof (derivable_pt_lim_comp (mult_real_fct mu id) exp x (mu * 1) _ H1
                (derivable_pt_lim_exp _)) as H2.
  pose proof (derivable_pt_lim_scal _ (/ mu) x _ H2) as H3.
  replace (/ mu * (exp (mult_real_fct mu id x) * (mu * 1))) with (exp (mu * x)) in H3
    by (unfold mult_real_fct, id; field; exact H).
  exact H3.
Qed.

Definition unif_prim_derivable mu (H : mu <> 0) : derivable (unif_prim mu) :=
  fun x => exist _ (exp (mu * x)) (unif_prim_lim mu x H).

Lemma exp_lin_continuous mu : continuity (fun x => exp (mu * x)).
Proof.
  intros x. change (continuity_pt (comp exp (mult_real_fct mu id)) x).
  apply continuity_pt_comp; [apply continuity_pt_scal, derivable_continuous_pt, derivable_pt_id|].
  apply derivable_continuous_pt, derivable_pt_exp.
Qed.

Definition unif_prim_C1 mu (H : mu <> 0) : C1_fun :=
  {| c1 := unif_prim mu; diff0 := unif_prim_derivable mu H; cont1 := exp_lin_continuous mu |}.

(** ∫_{−½}^{½} e^{μu} du = mgf_unif μ: sinh(μ/2)/(μ/2), and 1 at μ = 0. *)
Theorem uniform_mgf_integral mu (pr : Riemann_integrable (fun u => exp (mu * u)) (- / 2) (/ 2)) :
  RiemannInt pr = mgf_unif mu.
Proof.
  unfold mgf_unif. destruct (Req_EM_T mu 0) as [->|H].
  - rewrite (RiemannInt_P18 pr (RiemannInt_P14 (- / 2) (/ 2) 1)); [|lra|].
    + rewrite RiemannInt_P15. field.
    + intros x _. unfold fct_cte. rewrite Rmult_0_l. apply exp_0.
  - set (f := unif_prim_C1 mu H).
    rewrite (RiemannInt_P18 pr (RiemannInt_P32 f (- / 2) (/ 2))); [|lra|reflexivity].
    rewrite FTC_Riemann. simpl. unfold unif_prim, sinh.
    replace (mu * - / 2) with (- (mu / 2)) by field.
    replace (mu * / 2) with (mu / 2) by field. field. exact H.
Qed.

(** * (d) Codes of B bits *)

Lemma IZR_le_half_int (k Q : BinNums.Z) : IZR k <= IZR Q + / 2 -> (k <= Q)%Z.
Proof.
  intros H. destruct (Z_le_gt_dec k Q) as [Hl|Hg]; [exact Hl|exfalso].
  assert (Hk : (Q + 1 <= k)%Z) by lia. apply IZR_le in Hk. rewrite plus_IZR in Hk. lra.
Qed.

(** No clipping: |x| ≤ (Q − ½)·s and |x/s + ξ − k| ≤ ½ give |k| ≤ Q and |x̂ − x| ≤ s/2. *)
Theorem dither_code_range (Q k : BinNums.Z) (s x xi : R) :
  0 < s -> Rabs x <= (IZR Q - / 2) * s -> - / 2 <= xi < / 2 ->
  Rabs (x / s + xi - IZR k) <= / 2 ->
  (Z.abs k <= Q)%Z /\ Rabs (s * (IZR k - xi) - x) <= s / 2.
Proof.
  intros Hs Hx Hxi Hk.
  assert (Hxs : Rabs (x / s) <= IZR Q - / 2).
  { unfold Rdiv. rewrite Rabs_mult, Rabs_inv, (Rabs_pos_eq s) by lra.
    apply Rmult_le_reg_r with s; [exact Hs|]. replace (Rabs x * / s * s) with (Rabs x) by (field; lra).
    exact Hx. }
  apply Rabs_le_inv in Hxs. apply Rabs_le_inv in Hk. split.
  - assert (H1 : (k <= Q)%Z) by (apply IZR_le_half_int; lra).
    assert (H2 : (- k <= Q)%Z) by (apply IZR_le_half_int; rewrite opp_IZR; lra).
    lia.
  - replace (s * (IZR k - xi) - x) with (- s * (x / s + xi - IZR k)) by (field; lra).
    rewrite Rabs_mult, Rabs_Ropp, (Rabs_pos_eq s) by lra.
    replace (s / 2) with (s * / 2) by field. apply Rmult_le_compat_l; [lra|].
    apply Rabs_le. lra.
Qed.

(** With Q = 2^{B−1} − 1: the code fits in B signed bits and the error is at most s/2 (for
    B ≤ 1 no x satisfies the premise). *)
Theorem dither_code_bits (B : nat) (k : BinNums.Z) (s x xi : R) :
  0 < s -> Rabs x <= (IZR (2 ^ (Z.of_nat B - 1) - 1) - / 2) * s -> - / 2 <= xi < / 2 ->
  Rabs (x / s + xi - IZR k) <= / 2 ->
  (- (2 ^ (Z.of_nat B - 1) - 1) <= k <= 2 ^ (Z.of_nat B - 1) - 1)%Z
  /\ Rabs (s * (IZR k - xi) - x) <= s / 2.
Proof.
  intros Hs Hx Hxi Hk.
  destruct (dither_code_range _ k s x xi Hs Hx Hxi Hk) as [H1 H2]. split; [lia|exact H2].
Qed.

(** The error is the step times the rounding residual U = k − (x/s + ξ) ∈ [−½, ½]. *)
Lemma dither_error (k s x xi : R) : s <> 0 -> s * (k - xi) - x = s * (k - (x / s + xi)).
Proof. intros H. field. exact H. Qed.

(** * (c) Chernoff's bound for a weighted sum of independent uniform residuals *)

Fixpoint rprod (n : nat) (f : nat -> R) : R :=
  match n with
  | O => 1
  | S k => rprod k f * f k
  end.

Lemma rprod_le n f g : (forall i, (i < n)%nat -> 0 <= f i <= g i) -> rprod n f <= rprod n g.
Proof.
  induction n as [|n IH]; intros H; simpl; [lra|].
  assert (Hn : 0 <= f n <= g n) by (apply H; lia).
  assert (Hp : 0 <= rprod n f).
  { clear IH. induction n as [|n IHn]; simpl; [lra|].
    apply Rmult_le_pos; [apply IHn; intros; apply H; lia|]. apply H. lia. }
  apply Rmult_le_compat; try lra. apply IH. intros. apply H. lia.
Qed.

Lemma rprod_exp n f : rprod n (fun i => exp (f i)) = exp (sum n f).
Proof. induction n as [|n IH]; simpl; [rewrite exp_0; ring|]. rewrite IH, exp_plus. ring. Qed.

Lemma sum_sq_zero n (a : nat -> R) :
  sum n (fun i => a i ^ 2) = 0 -> forall i, (i < n)%nat -> a i = 0.
Proof.
  induction n as [|n IH]; intros H i Hi; [lia|]. rewrite sum_S in H.
  assert (H0 : 0 <= sum n (fun i => a i ^ 2)) by (apply sum_nonneg; intros; nra).
  assert (H1 : 0 <= a n ^ 2) by nra.
  destruct (Nat.eq_dec i n) as [->|Hne]; [nra|]. apply IH; [lra|lia].
Qed.

(** The variance proxy of Σ_i a_i U_i: σ² = Σ_i a_i²/12. *)
Definition proxy (n : nat) (a : nat -> R) : R := sum n (fun i => a i ^ 2) / 12.

(** The primitive assumptions on n residuals V_0 … V_{n−1}, for an expectation [E]:
    independence, as the factorization of the moment generating function of every weighted
    sum; the uniform law on [−½, ½], as its moment generating function ([mgf_unif], the
    integral [uniform_mgf_integral]); and |V_i| ≤ ½, which holds by construction. *)
Definition mgf_factorizes {Omega : Type} (E : (Omega -> R) -> R) (n : nat)
  (V : nat -> Omega -> R) : Prop :=
  forall b : nat -> R,
    E (fun w => exp (sum n (fun i => b i * V i w))) = rprod n (fun i => E (fun w => exp (b i * V i w))).

Definition uniform_mgf {Omega : Type} (E : (Omega -> R) -> R) (n : nat)
  (V : nat -> Omega -> R) : Prop :=
  forall i mu, (i < n)%nat -> E (fun w => exp (mu * V i w)) = mgf_unif mu.

Definition bounded_half {Omega : Type} (n : nat) (V : nat -> Omega -> R) : Prop :=
  forall i w, (i < n)%nat -> Rabs (V i w) <= / 2.

(** The probability space, written once and taken as the single section parameter
    [Context (P : ProbSpace)] of [Chernoff] here, of [TierBDither] and [TierBRequest] in
    TierB.v and of [ValueDither] in ValueDither.v: a probability [Pr] on events (monotone,
    subadditive, zero on the empty event) and an expectation [E] on random variables, linked
    only by Markov's inequality for bounded nonnegative variables.  Any probability space
    satisfies them (Pr an outer measure, E an upper integral); Markov is stated for bounded
    variables only, since an unbounded one may have no finite expectation. *)
Record ProbSpace := {
  Omega : Type;
  Pr : (Omega -> Prop) -> R;
  E : (Omega -> R) -> R;
  Pr_mono : forall A B : Omega -> Prop, (forall w, A w -> B w) -> Pr A <= Pr B;
  Pr_union : forall A B : Omega -> Prop, Pr (fun w => A w \/ B w) <= Pr A + Pr B;
  Pr_empty : Pr (fun _ => False) = 0;
  markov : forall (X : Omega -> R) (a M : R), 0 < a -> (forall w, 0 <= X w <= M) ->
    Pr (fun w => a <= X w) <= E X / a }.

Section Chernoff.
Context (P : ProbSpace).
Context (n : nat) (V : nat -> Omega P -> R).
Context (V_indep : mgf_factorizes (E P) n V) (V_unif : uniform_mgf (E P) n V)
  (V_bound : bounded_half n V).

Lemma mgf_sum_bound (b : nat -> R) :
  E P (fun w => exp (sum n (fun i => b i * V i w))) <= exp (sum n (fun i => b i ^ 2) / 24).
Proof.
  rewrite V_indep. rewrite <- sum_div_r, <- rprod_exp. apply rprod_le. intros i Hi.
  rewrite (V_unif i (b i) Hi). split; [left; apply mgf_unif_pos|].
  apply mgf_unif_bound.
Qed.

Lemma sum_bounded (b : nat -> R) w :
  Rabs (sum n (fun i => b i * V i w)) <= sum n (fun i => Rabs (b i)).
Proof.
  eapply Rle_trans; [apply sum_abs|]. apply sum_le. intros i Hi.
  rewrite Rabs_mult. specialize (V_bound i w Hi).
  pose proof (Rabs_pos (b i)). nra.
Qed.

(** One side: Pr(Σ a_i V_i > u) ≤ e^{λ²Σa_i²/24 − λu} for every λ ≥ 0. *)
Lemma chernoff_upper (a : nat -> R) (u lam : R) : 0 <= lam ->
  Pr P (fun w => u < sum n (fun i => a i * V i w))
    <= exp (lam ^ 2 * sum n (fun i => a i ^ 2) / 24 - lam * u).
Proof.
  intros Hl.
  set (X := fun w => exp (sum n (fun i => (lam * a i) * V i w))).
  assert (HX : forall w, X w = exp (lam * sum n (fun i => a i * V i w))).
  { intros w. unfold X. f_equal. rewrite <- sum_scal_l. apply sum_ext. intros. ring. }
  apply Rle_trans with (Pr P (fun w => exp (lam * u) <= X w)).
  { apply (Pr_mono P). intros w Hw. rewrite HX. apply exp_le. apply Rmult_le_compat_l; lra. }
  eapply Rle_trans.
  { apply (markov P X (exp (lam * u)) (exp (sum n (fun i => Rabs (lam * a i))))); [apply exp_pos|].
    intros w. split; [left; apply exp_pos|]. apply exp_le.
    eapply Rle_trans; [apply Rle_abs|]. apply sum_bounded. }
  pose proof (mgf_sum_bound (fun i => lam * a i)) as H. cbv beta in H. fold X in H.
  rewrite (sum_ext n (fun i => (lam * a i) ^ 2) (fun i => lam ^ 2 * a i ^ 2)) in H by (intros; ring).
  rewrite sum_scal_l in H.
  unfold Rminus. rewrite exp_plus, exp_Ropp. unfold Rdiv at 1.
  apply Rmult_le_compat_r; [left; apply Rinv_0_lt_compat, exp_pos|].
  exact H.
Qed.

(** Optimized at λ = u/σ². *)
Lemma chernoff_opt (a : nat -> R) (u : R) : 0 <= u ->
  Pr P (fun w => u < sum n (fun i => a i * V i w)) <= exp (- (u * u) / (2 * proxy n a)).
Proof.
  intros Hu. unfold proxy.
  set (q := sum n (fun i => a i ^ 2)).
  assert (Hq : 0 <= q) by (apply sum_nonneg; intros; nra).
  destruct Hq as [Hq|Hq].
  - eapply Rle_trans; [apply (chernoff_upper a u (12 * u / q))|].
    + apply Rmult_le_pos; [lra|left; apply Rinv_0_lt_compat; exact Hq].
    + right. f_equal. fold q. field. lra.
  - (* σ² = 0: every a_i is 0, the sum is 0 and the event is empty *)
    apply Rle_trans with (Pr P (fun _ => False)).
    + apply (Pr_mono P). intros w Hw.
      rewrite (sum_ext n _ (fun _ => 0)) in Hw by (intros i Hi; rewrite (sum_sq_zero n a (eq_sym Hq) i Hi); ring).
      rewrite sum_const0 in Hw. lra.
    + rewrite (Pr_empty P). left. apply exp_pos.
Qed.

(** Two sides: Pr(|Σ_i a_i V_i| > u) ≤ 2 e^{−u²/(2σ²)}, σ² = Σ_i a_i²/12. *)
Theorem subgaussian_sum (a : nat -> R) (u : R) : 0 <= u ->
  Pr P (fun w => u < Rabs (sum n (fun i => a i * V i w)))
    <= 2 * exp (- (u * u) / (2 * proxy n a)).
Proof.
  intros Hu.
  apply Rle_trans with (Pr P (fun w => u < sum n (fun i => a i * V i w)
                                     \/ u < sum n (fun i => (- a i) * V i w))).
  { apply (Pr_mono P). intros w Hw.
    rewrite (sum_ext n (fun i => - a i * V i w) (fun i => - (a i * V i w))) by (intros; ring).
    rewrite sum_opp. unfold Rabs in Hw. destruct Rcase_abs; [right|left]; lra. }
  eapply Rle_trans; [apply (Pr_union P)|].
  assert (Hp : proxy n (fun i => - a i) = proxy n a).
  { unfold proxy. f_equal. apply sum_ext. intros. ring. }
  pose proof (chernoff_opt a u Hu). pose proof (chernoff_opt (fun i => - a i) u Hu) as H2.
  rewrite Hp in H2. lra.
Qed.

End Chernoff.
