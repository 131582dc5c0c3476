(** Tier A: Lemma 1 (RoPE band unitarity) and Theorem 2 (sound black-box logit bound) of
    "WitCert: Sound Runtime Risk Observability and Gating for KV-Cache Quantization"
    (Wei and Liu), Sec. 4.1.

    A head vector is a function [nat -> R] on coordinates [0, d), d = 2m, m = B·P: the m
    RoPE frequency pairs are grouped into B contiguous bands of P pairs (band b holds pairs
    b·P, ..., b·P + P − 1).  A pair layout names the two coordinates of pair j: interleaved
    (2j, 2j+1) or NeoX half-split (j, j + m).  RoPE at any position rotates pair j by an
    angle [ang j] (n·θ_j at position n); the theorems hold for every angle vector, hence for
    every position. *)

From Coq Require Import Reals Lra Lia.
From WitCert Require Import Sums.
Open Scope R_scope.

Record layout := { lo : nat -> nat; hi : nat -> nat }.

Definition interleaved : layout := {| lo j := (2 * j)%nat; hi j := (2 * j + 1)%nat |}.
Definition neox (m : nat) : layout := {| lo j := j; hi j := (j + m)%nat |}.

(** The Euclidean dot product on [0, d). *)
Definition dot (d : nat) (q r : nat -> R) : R := sum d (fun i => q i * r i).

(** Band b's share of the dot product and its squared norm. *)
Definition band_dot (L : layout) (P : nat) (q r : nat -> R) (b : nat) : R :=
  sum P (fun k => q (lo L (b * P + k)%nat) * r (lo L (b * P + k)%nat)
                  + q (hi L (b * P + k)%nat) * r (hi L (b * P + k)%nat)).

Definition band_sq (L : layout) (P : nat) (x : nat -> R) (b : nat) : R :=
  band_dot L P x x b.

Definition band_norm (L : layout) (P : nat) (x : nat -> R) (b : nat) : R :=
  sqrt (band_sq L P x b).

(** * RoPE *)

(** [R] rotates pair j (j < m) of every vector by the angle [ang j]. *)
Definition rotates (L : layout) (m : nat) (ang : nat -> R) (R : (nat -> R) -> nat -> R) :=
  forall x j, (j < m)%nat ->
    R x (lo L j) = cos (ang j) * x (lo L j) - sin (ang j) * x (hi L j) /\
    R x (hi L j) = sin (ang j) * x (lo L j) + cos (ang j) * x (hi L j).

(** The interleaved rotation, coordinate by coordinate. *)
Definition rope_interleaved (ang : nat -> R) (x : nat -> R) (i : nat) : R :=
  let j := Nat.div2 i in
  if Nat.even i then cos (ang j) * x i - sin (ang j) * x (S i)
  else sin (ang j) * x (pred i) + cos (ang j) * x i.

(** The NeoX half-split rotation of a 2m-dimensional head. *)
Definition rope_neox (m : nat) (ang : nat -> R) (x : nat -> R) (i : nat) : R :=
  if (i <? m)%nat then cos (ang i) * x i - sin (ang i) * x (i + m)%nat
  else sin (ang (i - m)%nat) * x (i - m)%nat + cos (ang (i - m)%nat) * x i.

Lemma even_double j : Nat.even (2 * j) = true.
Proof.
  induction j; [reflexivity|].
  replace (2 * S j)%nat with (S (S (2 * j))) by lia. exact IHj.
Qed.

Lemma even_succ_double j : Nat.even (S (2 * j)) = false.
Proof.
  induction j; [reflexivity|].
  replace (S (2 * S j))%nat with (S (S (S (2 * j)))) by lia. exact IHj.
Qed.

Lemma rope_interleaved_rotates m ang : rotates interleaved m ang (rope_interleaved ang).
Proof.
  intros x j _. unfold rope_interleaved; cbn [lo hi interleaved neox]. split.
  - rewrite even_double, Nat.div2_double.
    replace (S (2 * j)) with (2 * j + 1)%nat by lia. reflexivity.
  - replace (2 * j + 1)%nat with (S (2 * j)) by lia.
    rewrite even_succ_double, Nat.div2_succ_double. reflexivity.
Qed.

Lemma rope_neox_rotates m ang : rotates (neox m) m ang (rope_neox m ang).
Proof.
  intros x j Hj. unfold rope_neox; cbn [lo hi interleaved neox]. split.
  - destruct (Nat.ltb_spec j m); [reflexivity|lia].
  - destruct (Nat.ltb_spec (j + m) m); [lia|].
    replace (j + m - m)%nat with j by lia. reflexivity.
Qed.

(** * Lemma 1: RoPE preserves every band's norm *)

Lemma rot_pair_sq a b s c :
  Rsqr s + Rsqr c = 1 ->
  (c * a - s * b) * (c * a - s * b) + (s * a + c * b) * (s * a + c * b) = a * a + b * b.
Proof.
  intros H. unfold Rsqr in H.
  replace ((c * a - s * b) * (c * a - s * b) + (s * a + c * b) * (s * a + c * b))
    with ((s * s + c * c) * (a * a + b * b)) by ring.
  rewrite H. ring.
Qed.

Section Rope.
Context (L : layout) (B P : nat) (ang : nat -> R) (R : (nat -> R) -> nat -> R).
Context (Hrot : rotates L (B * P) ang R).

Lemma band_sq_rotate x b :
  (b < B)%nat -> band_sq L P (R x) b = band_sq L P x b.
Proof.
  intros Hb. unfold band_sq, band_dot. apply sum_ext. intros k Hk.
  assert (Hj : (b * P + k < B * P)%nat) by nia.
  destruct (Hrot x _ Hj) as [H1 H2]. rewrite H1, H2.
  apply rot_pair_sq. apply sin2_cos2.
Qed.

(** Lemma 1. *)
Theorem band_norm_rotate x b :
  (b < B)%nat -> band_norm L P (R x) b = band_norm L P x b.
Proof. intros Hb. unfold band_norm. rewrite band_sq_rotate by exact Hb. reflexivity. Qed.

(** The witness of a post-RoPE residual R k̂ − R k equals that of the pre-RoPE residual
    k̂ − k, at every position. *)
Theorem band_norm_residual_rotate khat k b :
  (b < B)%nat ->
  band_norm L P (fun i => R khat i - R k i) b = band_norm L P (fun i => khat i - k i) b.
Proof.
  intros Hb. unfold band_norm, band_sq, band_dot. f_equal. apply sum_ext. intros j Hj.
  assert (Hj' : (b * P + j < B * P)%nat) by nia.
  destruct (Hrot khat _ Hj') as [H1 H2]. destruct (Hrot k _ Hj') as [H3 H4].
  rewrite H1, H2, H3, H4.
  set (c := cos (ang (b * P + j)%nat)). set (s := sin (ang (b * P + j)%nat)).
  set (u := khat (lo L (b * P + j)%nat) - k (lo L (b * P + j)%nat)).
  set (v := khat (hi L (b * P + j)%nat) - k (hi L (b * P + j)%nat)).
  transitivity ((c * u - s * v) * (c * u - s * v) + (s * u + c * v) * (s * u + c * v)).
  - unfold u, v. ring.
  - apply rot_pair_sq. apply sin2_cos2.
Qed.

End Rope.

(** * Cauchy–Schwarz within a band *)

Lemma sq_le_sq_le x y : 0 <= y -> x * x <= y * y -> x <= y.
Proof. intros Hy H. destruct (Rle_or_lt x y) as [|Hlt]; [assumption|nra]. Qed.

Lemma cs_step S A0 B0 u al be :
  0 <= A0 -> 0 <= B0 -> 0 <= al -> 0 <= be ->
  S * S <= A0 * B0 -> u * u <= al * be ->
  (S + u) * (S + u) <= (A0 + al) * (B0 + be).
Proof.
  intros HA HB Hal Hbe HS Hu.
  assert (H4 : (2 * S * u) * (2 * S * u) <= (A0 * be + al * B0) * (A0 * be + al * B0)).
  { apply Rle_trans with (4 * ((A0 * B0) * (al * be))).
    - replace ((2 * S * u) * (2 * S * u)) with (4 * ((S * S) * (u * u))) by ring.
      apply Rmult_le_compat_l; [lra|].
      apply Rmult_le_compat; try assumption; apply Rle_0_sqr.
    - assert (0 <= (A0 * be - al * B0) * (A0 * be - al * B0)) by apply Rle_0_sqr. nra. }
  assert (H5 : 2 * S * u <= A0 * be + al * B0).
  { apply sq_le_sq_le; [|exact H4].
    apply Rplus_le_le_0_compat; apply Rmult_le_pos; assumption. }
  nra.
Qed.

(** (Σ_k (a_k b_k + a'_k b'_k))² ≤ Σ_k (a_k² + a'_k²) · Σ_k (b_k² + b'_k²). *)
Lemma cauchy_schwarz2 n (a a' b b' : nat -> R) :
  let S := sum n (fun k => a k * b k + a' k * b' k) in
  let A0 := sum n (fun k => a k * a k + a' k * a' k) in
  let B0 := sum n (fun k => b k * b k + b' k * b' k) in
  S * S <= A0 * B0.
Proof.
  induction n as [|n IH]; simpl in *; [lra|].
  apply cs_step; try assumption.
  - apply sum_nonneg. intros. pose proof (Rle_0_sqr (a t)). pose proof (Rle_0_sqr (a' t)).
    unfold Rsqr in *. lra.
  - apply sum_nonneg. intros. pose proof (Rle_0_sqr (b t)). pose proof (Rle_0_sqr (b' t)).
    unfold Rsqr in *. lra.
  - pose proof (Rle_0_sqr (a n)). pose proof (Rle_0_sqr (a' n)). unfold Rsqr in *. lra.
  - pose proof (Rle_0_sqr (b n)). pose proof (Rle_0_sqr (b' n)). unfold Rsqr in *. lra.
  - assert (0 <= (a n * b' n - a' n * b n) * (a n * b' n - a' n * b n)) by apply Rle_0_sqr.
    nra.
Qed.

Lemma band_sq_nonneg L P x b : 0 <= band_sq L P x b.
Proof.
  unfold band_sq, band_dot. apply sum_nonneg. intros.
  pose proof (Rle_0_sqr (x (lo L (b * P + t)%nat))).
  pose proof (Rle_0_sqr (x (hi L (b * P + t)%nat))). unfold Rsqr in *. lra.
Qed.

(** |q_b · r_b| ≤ ‖q_b‖ ‖r_b‖. *)
Lemma band_cauchy_schwarz L P q r b :
  Rabs (band_dot L P q r b) <= band_norm L P q b * band_norm L P r b.
Proof.
  unfold band_norm. rewrite <- sqrt_mult_alt by apply band_sq_nonneg.
  rewrite <- sqrt_Rsqr_abs. apply sqrt_le_1_alt. unfold Rsqr.
  apply (cauchy_schwarz2 P).
Qed.

(** * The dot product splits into bands, for both layouts *)

Definition splits (L : layout) (m : nat) : Prop :=
  forall q r, dot (2 * m) q r
              = sum m (fun j => q (lo L j) * r (lo L j) + q (hi L j) * r (hi L j)).

Lemma interleaved_splits m : splits interleaved m.
Proof.
  intros q r. unfold dot. cbn [lo hi interleaved neox]. induction m as [|m IH]; [reflexivity|].
  replace (2 * S m)%nat with (S (S (2 * m))) by lia.
  rewrite !sum_S, IH. replace (S (2 * m)) with (2 * m + 1)%nat by lia. ring.
Qed.

Lemma neox_splits m : splits (neox m) m.
Proof.
  intros q r. unfold dot. cbn [lo hi interleaved neox].
  replace (2 * m)%nat with (m + m)%nat by lia.
  rewrite sum_split, <- sum_plus. apply sum_ext. intros j _.
  rewrite (Nat.add_comm m j). reflexivity.
Qed.

Lemma dot_bands L B P q r :
  splits L (B * P) -> dot (2 * (B * P)) q r = sum B (band_dot L P q r).
Proof.
  intros Hs. rewrite Hs, sum_blocks. reflexivity.
Qed.

(** * Theorem 2 *)

Section Theorem2.
Context (L : layout) (B P : nat) (Hsplit : splits L (B * P)).

(** |sm · q·r| ≤ sm · Σ_b ‖q_b‖ ‖r_b‖ for every q and r. *)
Theorem logit_band_bound sm q r :
  0 <= sm ->
  Rabs (sm * dot (2 * (B * P)) q r)
    <= sm * sum B (fun b => band_norm L P q b * band_norm L P r b).
Proof.
  intros Hsm. rewrite Rabs_mult, (Rabs_pos_eq sm Hsm).
  apply Rmult_le_compat_l; [exact Hsm|].
  rewrite (dot_bands L B P q r Hsplit).
  eapply Rle_trans; [apply sum_abs|].
  apply sum_le. intros b _. apply band_cauchy_schwarz.
Qed.

(** Theorem 2 with the stored witness: if w_b ≥ ‖(k̂ − k)_b‖ for every band (the witness of
    the pre-RoPE residual, equivalently, by Lemma 1, of the post-RoPE residual at any
    position), then for every query q and every RoPE position (angles [ang]) the logit error
    ε = sm·q·(R k̂) − sm·q·(R k) satisfies |ε| ≤ c := sm · Σ_b ‖q_b‖ · w_b. *)
Theorem tier_a_sound (ang : nat -> R) (R : (nat -> R) -> nat -> R) sm q khat k w :
  rotates L (B * P) ang R -> 0 <= sm ->
  (forall b, (b < B)%nat -> band_norm L P (fun i => khat i - k i) b <= w b) ->
  Rabs (sm * dot (2 * (B * P)) q (R khat) - sm * dot (2 * (B * P)) q (R k))
    <= sm * sum B (fun b => band_norm L P q b * w b).
Proof.
  intros Hrot Hsm Hw.
  replace (sm * dot (2 * (B * P)) q (R khat) - sm * dot (2 * (B * P)) q (R k))
    with (sm * dot (2 * (B * P)) q (fun i => R khat i - R k i))
    by (unfold dot; rewrite <- Rmult_minus_distr_l, <- sum_minus; f_equal;
        apply sum_ext; intros; ring).
  eapply Rle_trans; [apply logit_band_bound; exact Hsm|].
  apply Rmult_le_compat_l; [exact Hsm|]. apply sum_le. intros b Hb.
  rewrite (band_norm_residual_rotate L B P ang R Hrot khat k b Hb).
  apply Rmult_le_compat_l; [apply sqrt_pos|]. apply Hw. exact Hb.
Qed.

End Theorem2.

(** Theorem 2 for the two layouts the code supports. *)
Corollary tier_a_sound_interleaved B P ang sm q khat k w :
  0 <= sm ->
  (forall b, (b < B)%nat -> band_norm interleaved P (fun i => khat i - k i) b <= w b) ->
  Rabs (sm * dot (2 * (B * P)) q (rope_interleaved ang khat)
        - sm * dot (2 * (B * P)) q (rope_interleaved ang k))
    <= sm * sum B (fun b => band_norm interleaved P q b * w b).
Proof.
  intros. apply (tier_a_sound interleaved B P (interleaved_splits _) ang); try assumption.
  apply rope_interleaved_rotates.
Qed.

Corollary tier_a_sound_neox B P ang sm q khat k w :
  0 <= sm ->
  (forall b, (b < B)%nat -> band_norm (neox (B * P)) P (fun i => khat i - k i) b <= w b) ->
  Rabs (sm * dot (2 * (B * P)) q (rope_neox (B * P) ang khat)
        - sm * dot (2 * (B * P)) q (rope_neox (B * P) ang k))
    <= sm * sum B (fun b => band_norm (neox (B * P)) P q b * w b).
Proof.
  intros. apply (tier_a_sound (neox (B * P)) B P (neox_splits _) ang); try assumption.
  apply rope_neox_rotates.
Qed.

Corollary band_norm_rotate_interleaved B P ang x b :
  (b < B)%nat ->
  band_norm interleaved P (rope_interleaved ang x) b = band_norm interleaved P x b.
Proof.
  intros. apply (band_norm_rotate interleaved B P ang);
    [apply rope_interleaved_rotates|assumption].
Qed.

Corollary band_norm_rotate_neox B P ang x b :
  (b < B)%nat ->
  band_norm (neox (B * P)) P (rope_neox (B * P) ang x) b = band_norm (neox (B * P)) P x b.
Proof.
  intros. apply (band_norm_rotate (neox (B * P)) B P ang);
    [apply rope_neox_rotates|assumption].
Qed.
