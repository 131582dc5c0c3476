(** The axioms each main theorem rests on.  check.sh compiles this file and fails unless
    every axiom printed here is one of the standard library's real-number axioms. *)

From WitCert Require Import Sums Defs EForm.

Print Assumptions eform_sound.
Print Assumptions eform_meter_sound.
