(** Block repair ("WitCert: Sound Runtime Risk Observability and Gating for KV-Cache
    Quantization", Wei and Liu, Sec. 6.3.5): paging a block of tokens back to exact keys sets
    c_t := 0 on the block, which removes exactly the block's term Σ_{t ∈ block} p̃_t (e^{c_t} − 1)
    from A (with p̃ held fixed, as the repair planner holds it); likewise exact values set
    ρ^v_t := 0 and remove Σ_{t ∈ block} p̃_t ρ^v_t from the value term.  Terms of disjoint
    blocks add up, so the planner may subtract them one block at a time. *)

From Coq Require Import Reals Lra Lia Bool.
From WitCert Require Import Sums Defs.
Open Scope R_scope.

(** A block is a set of tokens, given by its indicator. *)
Definition repair (inb : nat -> bool) (c : nat -> R) (t : nat) : R :=
  if inb t then 0 else c t.

(** Page j of size P: tokens [j·P, (j+1)·P). *)
Definition page (P j : nat) (t : nat) : bool := ((j * P <=? t) && (t <? (j + 1) * P))%nat.

(** The block's term of A and of the value term. *)
Definition block_term_A (n : nat) (inb : nat -> bool) (pt c : nat -> R) : R :=
  sum n (fun t => if inb t then pt t * (exp (c t) - 1) else 0).

Definition block_term_rho (n : nat) (inb : nat -> bool) (pt rho : nat -> R) : R :=
  sum n (fun t => if inb t then pt t * rho t else 0).

Theorem repair_A n inb pt c :
  A n pt (repair inb c) = A n pt c - block_term_A n inb pt c.
Proof.
  unfold A, block_term_A. rewrite <- sum_minus. apply sum_ext. intros t _.
  unfold repair. destruct (inb t); [rewrite exp_0|]; ring.
Qed.

Theorem repair_Am n inb pt c :
  Am n pt (repair inb c) = Am n pt c + sum n (fun t => if inb t then pt t * (1 - exp (- c t)) else 0).
Proof.
  unfold Am. rewrite <- sum_plus. apply sum_ext. intros t _.
  unfold repair. destruct (inb t); [rewrite Ropp_0, exp_0|]; ring.
Qed.

Theorem repair_rho n inb pt rho :
  sum n (fun t => pt t * repair inb rho t) = sum n (fun t => pt t * rho t) - block_term_rho n inb pt rho.
Proof.
  unfold block_term_rho. rewrite <- sum_minus. apply sum_ext. intros t _.
  unfold repair. destruct (inb t); ring.
Qed.

(** Disjoint blocks: their terms add. *)
Theorem block_term_A_disjoint n b1 b2 pt c :
  (forall t, b1 t && b2 t = false) ->
  block_term_A n (fun t => b1 t || b2 t) pt c = block_term_A n b1 pt c + block_term_A n b2 pt c.
Proof.
  intros Hd. unfold block_term_A. rewrite <- sum_plus. apply sum_ext. intros t _.
  specialize (Hd t). destruct (b1 t), (b2 t); simpl in *; try discriminate; ring.
Qed.

(** Repairing block b2 after block b1 removes b2's term computed with the original c. *)
Theorem repair_twice_A n b1 b2 pt c :
  (forall t, b1 t && b2 t = false) ->
  A n pt (repair b2 (repair b1 c)) = A n pt c - block_term_A n b1 pt c - block_term_A n b2 pt c.
Proof.
  intros Hd. rewrite repair_A, repair_A. f_equal. unfold block_term_A. apply sum_ext.
  intros t _. specialize (Hd t). unfold repair.
  destruct (b1 t), (b2 t); simpl in *; try discriminate; reflexivity.
Qed.

(** The block's term is non-negative when p̃ ≥ 0 and c ≥ 0, so repair never raises A. *)
Theorem repair_A_le n pt eps c inb :
  cell n pt eps c -> A n pt (repair inb c) <= A n pt c.
Proof.
  intros H. rewrite repair_A. assert (0 <= block_term_A n inb pt c); [|lra].
  unfold block_term_A. apply sum_nonneg. intros t Ht. destruct (inb t); [|lra].
  apply Rmult_le_pos; [apply (pt_nonneg n pt eps c H t Ht)|].
  pose proof (exp_ge_1 _ (c_nonneg n pt eps c H t Ht)). lra.
Qed.

(** Repaired tokens carry no logit error (exact keys), so the repaired bounds are valid. *)
Theorem repair_cell n pt eps c inb :
  cell n pt eps c -> cell n pt (repair inb eps) (repair inb c).
Proof.
  intros [Hd Hc]. split; [exact Hd|]. intros t Ht. unfold repair.
  destruct (inb t); [rewrite Rabs_R0; lra|apply Hc; exact Ht].
Qed.
