#!/usr/bin/env bash
# Rejects unfinished proofs and axioms beyond the standard library's real numbers.
#  1. No .v file here may use a command that adds an unproved statement (Admitted, admit,
#     Axiom, Parameter, Hypothesis, Conjecture, Variable, ...).  There is no exception.
#  2. `Print Assumptions` of every main theorem (Assumptions.v) may list only the axioms on
#     which the standard library builds the real numbers (Reals).
set -euo pipefail
cd "$(dirname "$0")"
COQC=${COQC:-coqc}

allowed=(
  ClassicalDedekindReals.sig_forall_dec
  ClassicalDedekindReals.sig_not_dec
  FunctionalExtensionality.functional_extensionality_dep
  Classical_Prop.classic
)

status=0
words='Admitted|Admit|admit|give_up|Axiom|Axioms|Parameter|Parameters|Hypothesis|Hypotheses|Conjecture|Variable|Variables'
if grep -nwE "$words" ./*.v; then
  echo "check.sh: FAIL: the lines above use a command that leaves a statement unproved" >&2
  status=1
fi

out=$("$COQC" -Q . WitCert Assumptions.v)
echo "$out"
printed=$(grep -cE '^(Axioms:|Closed under the global context)' <<<"$out" || true)
expected=$(grep -cE '^Print Assumptions ' Assumptions.v)
if [ "$printed" -ne "$expected" ]; then
  echo "check.sh: FAIL: expected $expected assumption reports, got $printed" >&2
  status=1
fi
# An axiom is a line that starts in column 0 and is no header (its type continues indented).
names=$(grep -vE '^(Axioms:|Closed under the global context|[[:space:]]|$)' <<<"$out" | awk '{print $1}' | sort -u)
for name in $names; do
  ok=0
  for a in "${allowed[@]}"; do [ "$name" = "$a" ] && ok=1; done
  if [ $ok -eq 0 ]; then
    echo "check.sh: FAIL: axiom outside the standard library's Reals: $name" >&2
    status=1
  fi
done

if [ $status -eq 0 ]; then
  echo "check.sh: OK: $expected theorems, no unproved statements, axioms only: ${names//$'\n'/ }"
fi
exit $status
