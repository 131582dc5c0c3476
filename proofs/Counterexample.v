(** The flawed certificate is unsound (Sec. 3 of "WitCert: Sound Runtime Risk Observability
    and Gating for KV-Cache Quantization", Wei and Liu).

    The flawed form is ½ e^{2 c_max} (E_p̃|c − c̄| + c̄ (e^{c_max} − 1)), c̄ = E_p̃[c].  For
    p̃ = (½, ½), c = (0.1, 0.1), ε = (0.1, −0.1) it is below the true TV by a factor above 7
    (true TV ≈ 0.049834, flawed form ≈ 0.006423).  The value of e^{0.1} is pinned down by
    hand-made interval arithmetic: 1 + y ≤ e^y (standard library) at y = ±1/10240, squared ten
    times with the bounds rounded outward at each step. *)

From Coq Require Import Reals Lra Lia.
From WitCert Require Import Sums Defs Tanh.
Open Scope R_scope.

Definition cbar (n : nat) (pt c : nat -> R) : R := sum n (fun t => pt t * c t).

Definition flawed (n : nat) (pt c : nat -> R) : R :=
  / 2 * exp (2 * cmax n c)
  * (sum n (fun t => pt t * Rabs (c t - cbar n pt c)) + cbar n pt c * (exp (cmax n c) - 1)).

(** The instance. *)
Definition ce_pt (t : nat) : R := / 2.
Definition ce_c (t : nat) : R := 1 / 10.
Definition ce_eps (t : nat) : R := match t with O => 1 / 10 | _ => - (1 / 10) end.

Lemma ce_cell : cell 2 ce_pt ce_eps ce_c.
Proof.
  split; [split|].
  - intros. unfold ce_pt. lra.
  - simpl. unfold ce_pt. lra.
  - intros t Ht. unfold ce_eps, ce_c.
    destruct t as [|[|t]]; [| |lia];
      [rewrite Rabs_pos_eq by lra|rewrite Rabs_Ropp, Rabs_pos_eq by lra]; lra.
Qed.

Lemma exp_twice y : exp (2 * y) = exp y * exp y.
Proof. rewrite <- exp_plus. f_equal. ring. Qed.

Lemma sq_lb a a' e : 0 <= a -> a <= e -> a' <= a * a -> a' <= e * e.
Proof. intros. nra. Qed.

(** 1.105165521306 ≤ e^{0.1} ≤ 1.105176315385. *)
Lemma exp_tenth_lower : 1105165521306 / 1000000000000 <= exp (1 / 10).
Proof.
  assert (H0 : 1000097656250 / 1000000000000 <= exp ((1 / 10240))) by (pose proof (exp_ineq1_le ((1 / 10240))); lra).
  assert (H1 : 1000195322036 / 1000000000000 <= exp ((1 / 5120))).
  { replace ((1 / 5120)) with (2 * ((1 / 10240))) by field. rewrite exp_twice.
    apply (sq_lb (1000097656250 / 1000000000000)); [lra|exact H0|lra]. }
  assert (H2 : 1000390682222 / 1000000000000 <= exp ((1 / 2560))).
  { replace ((1 / 2560)) with (2 * ((1 / 5120))) by field. rewrite exp_twice.
    apply (sq_lb (1000195322036 / 1000000000000)); [lra|exact H1|lra]. }
  assert (H3 : 1000781517076 / 1000000000000 <= exp ((1 / 1280))).
  { replace ((1 / 1280)) with (2 * ((1 / 2560))) by field. rewrite exp_twice.
    apply (sq_lb (1000390682222 / 1000000000000)); [lra|exact H2|lra]. }
  assert (H4 : 1001563644920 / 1000000000000 <= exp ((1 / 640))).
  { replace ((1 / 640)) with (2 * ((1 / 1280))) by field. rewrite exp_twice.
    apply (sq_lb (1000781517076 / 1000000000000)); [lra|exact H3|lra]. }
  assert (H5 : 1003129734825 / 1000000000000 <= exp ((1 / 320))).
  { replace ((1 / 320)) with (2 * ((1 / 640))) by field. rewrite exp_twice.
    apply (sq_lb (1001563644920 / 1000000000000)); [lra|exact H4|lra]. }
  assert (H6 : 1006269264890 / 1000000000000 <= exp ((1 / 160))).
  { replace ((1 / 160)) with (2 * ((1 / 320))) by field. rewrite exp_twice.
    apply (sq_lb (1003129734825 / 1000000000000)); [lra|exact H5|lra]. }
  assert (H7 : 1012577833462 / 1000000000000 <= exp ((1 / 80))).
  { replace ((1 / 80)) with (2 * ((1 / 160))) by field. rewrite exp_twice.
    apply (sq_lb (1006269264890 / 1000000000000)); [lra|exact H6|lra]. }
  assert (H8 : 1025313868818 / 1000000000000 <= exp ((1 / 40))).
  { replace ((1 / 40)) with (2 * ((1 / 80))) by field. rewrite exp_twice.
    apply (sq_lb (1012577833462 / 1000000000000)); [lra|exact H7|lra]. }
  assert (H9 : 1051268529590 / 1000000000000 <= exp ((1 / 20))).
  { replace ((1 / 20)) with (2 * ((1 / 40))) by field. rewrite exp_twice.
    apply (sq_lb (1025313868818 / 1000000000000)); [lra|exact H8|lra]. }
  assert (H10 : 1105165521306 / 1000000000000 <= exp ((1 / 10))).
  { replace ((1 / 10)) with (2 * ((1 / 20))) by field. rewrite exp_twice.
    apply (sq_lb (1051268529590 / 1000000000000)); [lra|exact H9|lra]. }
  exact H10.
Qed.

Lemma exp_tenth_upper : exp (1 / 10) <= 1105176315385 / 1000000000000.
Proof.
  assert (H0 : 999902343750 / 1000000000000 <= exp (- (1 / 10240))) by (pose proof (exp_ineq1_le (- (1 / 10240))); lra).
  assert (H1 : 999804697036 / 1000000000000 <= exp (- (1 / 5120))).
  { replace (- (1 / 5120)) with (2 * (- (1 / 10240))) by field. rewrite exp_twice.
    apply (sq_lb (999902343750 / 1000000000000)); [lra|exact H0|lra]. }
  assert (H2 : 999609432215 / 1000000000000 <= exp (- (1 / 2560))).
  { replace (- (1 / 2560)) with (2 * (- (1 / 5120))) by field. rewrite exp_twice.
    apply (sq_lb (999804697036 / 1000000000000)); [lra|exact H1|lra]. }
  assert (H3 : 999219016973 / 1000000000000 <= exp (- (1 / 1280))).
  { replace (- (1 / 1280)) with (2 * (- (1 / 2560))) by field. rewrite exp_twice.
    apply (sq_lb (999609432215 / 1000000000000)); [lra|exact H2|lra]. }
  assert (H4 : 998438643880 / 1000000000000 <= exp (- (1 / 640))).
  { replace (- (1 / 640)) with (2 * (- (1 / 1280))) by field. rewrite exp_twice.
    apply (sq_lb (999219016973 / 1000000000000)); [lra|exact H3|lra]. }
  assert (H5 : 996879725592 / 1000000000000 <= exp (- (1 / 320))).
  { replace (- (1 / 320)) with (2 * (- (1 / 640))) by field. rewrite exp_twice.
    apply (sq_lb (998438643880 / 1000000000000)); [lra|exact H4|lra]. }
  assert (H6 : 993769187296 / 1000000000000 <= exp (- (1 / 160))).
  { replace (- (1 / 160)) with (2 * (- (1 / 320))) by field. rewrite exp_twice.
    apply (sq_lb (996879725592 / 1000000000000)); [lra|exact H5|lra]. }
  assert (H7 : 987577197618 / 1000000000000 <= exp (- (1 / 80))).
  { replace (- (1 / 80)) with (2 * (- (1 / 160))) by field. rewrite exp_twice.
    apply (sq_lb (993769187296 / 1000000000000)); [lra|exact H6|lra]. }
  assert (H8 : 975308721255 / 1000000000000 <= exp (- (1 / 40))).
  { replace (- (1 / 40)) with (2 * (- (1 / 80))) by field. rewrite exp_twice.
    apply (sq_lb (987577197618 / 1000000000000)); [lra|exact H7|lra]. }
  assert (H9 : 951227101756 / 1000000000000 <= exp (- (1 / 20))).
  { replace (- (1 / 20)) with (2 * (- (1 / 40))) by field. rewrite exp_twice.
    apply (sq_lb (975308721255 / 1000000000000)); [lra|exact H8|lra]. }
  assert (H10 : 904832999115 / 1000000000000 <= exp (- (1 / 10))).
  { replace (- (1 / 10)) with (2 * (- (1 / 20))) by field. rewrite exp_twice.
    apply (sq_lb (951227101756 / 1000000000000)); [lra|exact H9|lra]. }
  pose proof (exp_opp_mul (1 / 10)). pose proof (exp_pos (1 / 10)).
  assert (exp (1 / 10) * (904832999115 / 1000000000000) <= 1) by nra.
  lra.
Qed.

(** With x = e^{0.1}: TV = (x² − 1) / (2 (x² + 1)). *)
Lemma ce_TV :
  TV 2 (p 2 ce_pt ce_eps) ce_pt
  = (exp (1 / 10) * exp (1 / 10) - 1) / (2 * (exp (1 / 10) * exp (1 / 10) + 1)).
Proof.
  pose proof (exp_ineq1 (1 / 10)) as Hx. pose proof (exp_pos (1 / 10)).
  unfold TV, p, Z, wt, ce_pt, ce_eps. simpl.
  rewrite Ropp_involutive, exp_Ropp. set (x := exp (1 / 10)) in *.
  assert (1 < x) by (apply Rlt_le_trans with (1 + 1 / 10); [lra|left; apply Hx; lra]).
  replace (/ 2 * / x / (0 + / 2 * / x + / 2 * x) - / 2)
    with (- ((x * x - 1) / (2 * (x * x + 1)))) by (field; nra).
  replace (/ 2 * x / (0 + / 2 * / x + / 2 * x) - / 2)
    with ((x * x - 1) / (2 * (x * x + 1))) by (field; nra).
  assert (0 <= (x * x - 1) / (2 * (x * x + 1))).
  { apply Rmult_le_pos; [nra|left; apply Rinv_0_lt_compat; nra]. }
  rewrite Rabs_Ropp, Rabs_pos_eq by lra. field. nra.
Qed.

(** With x = e^{0.1}: the flawed form is ½ x² · 0.1 (x − 1) (the dispersion term is 0). *)
Lemma ce_flawed :
  flawed 2 ce_pt ce_c = / 2 * (exp (1 / 10) * exp (1 / 10)) * (1 / 10 * (exp (1 / 10) - 1)).
Proof.
  assert (Hm : cmax 2 ce_c = 1 / 10).
  { unfold cmax, ce_c. simpl. unfold Rmax. repeat destruct Rle_dec; lra. }
  assert (Hb : cbar 2 ce_pt ce_c = 1 / 10) by (unfold cbar, ce_pt, ce_c; simpl; field).
  unfold flawed. rewrite Hm, Hb, exp_twice. unfold ce_pt, ce_c. simpl.
  replace (1 / 10 - 1 / 10) with 0 by ring. rewrite Rabs_R0. ring.
Qed.

(** The counterexample: the true TV exceeds seven times the flawed form. *)
Theorem flawed_counterexample :
  cell 2 ce_pt ce_eps ce_c /\
  TV 2 (p 2 ce_pt ce_eps) ce_pt > 7 * flawed 2 ce_pt ce_c.
Proof.
  split; [exact ce_cell|].
  rewrite ce_TV, ce_flawed.
  pose proof exp_tenth_lower. pose proof exp_tenth_upper.
  set (x := exp (1 / 10)) in *.
  assert (Hd : 0 < 2 * (x * x + 1)) by nra.
  apply Rlt_gt. apply Rmult_lt_reg_r with (2 * (x * x + 1)); [exact Hd|].
  replace ((x * x - 1) / (2 * (x * x + 1)) * (2 * (x * x + 1))) with ((x - 1) * (x + 1))
    by (field; nra).
  assert (Hx2 : x * x <= 100 / 81) by nra.
  assert (Hq : x * x * (x * x + 1) <= 100 / 81 * (181 / 81)) by nra.
  assert (0 < x - 1) by lra.
  assert (Hk : 7 / 10 * (x * x * (x * x + 1)) < x + 1) by lra.
  replace (7 * (/ 2 * (x * x) * (1 / 10 * (x - 1))) * (2 * (x * x + 1)))
    with ((x - 1) * (7 / 10 * (x * x * (x * x + 1)))) by field.
  apply Rmult_lt_compat_l; lra.
Qed.

(** The numbers: TV > 0.04983 and flawed form < 0.006424. *)
Theorem flawed_counterexample_values :
  TV 2 (p 2 ce_pt ce_eps) ce_pt > 4983 / 100000 /\ flawed 2 ce_pt ce_c < 6424 / 1000000.
Proof.
  rewrite ce_TV, ce_flawed.
  pose proof exp_tenth_lower. pose proof exp_tenth_upper.
  set (x := exp (1 / 10)) in *.
  split.
  - apply Rlt_gt. apply Rmult_lt_reg_r with (2 * (x * x + 1)); [nra|].
    replace ((x * x - 1) / (2 * (x * x + 1)) * (2 * (x * x + 1))) with (x * x - 1)
      by (field; nra).
    nra.
  - assert (0 <= x - 1 <= 1105176315385 / 1000000000000 - 1) by lra.
    assert (x * x <= 1105176315385 / 1000000000000 * (1105176315385 / 1000000000000)) by nra.
    assert (x * x * (x - 1) <= 1105176315385 / 1000000000000 * (1105176315385 / 1000000000000)
                               * (1105176315385 / 1000000000000 - 1)) by nra.
    lra.
Qed.

(** Hence the flawed form is no TV bound. *)
Theorem flawed_unsound :
  ~ (forall n pt eps c, cell n pt eps c -> TV n (p n pt eps) pt <= flawed n pt c).
Proof.
  intros H. destruct flawed_counterexample as [Hc Hlt].
  specialize (H 2%nat ce_pt ce_eps ce_c Hc).
  assert (0 <= flawed 2 ce_pt ce_c).
  { rewrite ce_flawed. pose proof exp_tenth_lower.
    assert (0 < exp (1 / 10)) by apply exp_pos. nra. }
  lra.
Qed.
