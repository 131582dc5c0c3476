#!/usr/bin/env bash
# Rejects unfinished proofs and axioms beyond the standard library's real numbers.
#  1. No .v file here may contain a command that leaves a statement unproved or assumes one
#     (Admitted, admit, give_up, Axiom, Parameter, Hypothesis, Conjecture, Variable, ...).
#     There is no exception and no allowed place: section parameters are declared with
#     `Context` and are discharged as ordinary arguments when their section closes.
#  2. `Print Assumptions` of every main theorem listed in Assumptions.v may name only the
#     axioms on which the standard library builds the real numbers (Reals).
# Prints one line per main theorem with the axioms it rests on; exits non-zero on violation.
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
fail() { echo "check.sh: FAIL: $*" >&2; status=1; }

words='Admitted|Admit|admit|give_up|Axiom|Axioms|Parameter|Parameters|Hypothesis|Hypotheses|Conjecture|Variable|Variables'
if grep -nwE "$words" ./*.v >&2; then
  fail "the lines above leave a statement unproved or assume one"
fi

mapfile -t names < <(sed -n 's/^Print Assumptions \([^ ]*\)\.$/\1/p' Assumptions.v)
out=$("$COQC" -Q . WitCert Assumptions.v)
# One line "k<TAB>axiom" per axiom of the k-th report, "k<TAB>-" for a closed theorem; an
# axiom's name starts in column 0, its type continues on indented lines.
report=$(awk '
  /^Axioms:$/ { b++; next }
  /^Closed under the global context/ { b++; print b "\t-"; next }
  /^[^[:space:]]/ { print b "\t" $1 }
' <<<"$out")
reports=$(grep -cE '^(Axioms:|Closed under the global context)' <<<"$out" || true)
if [ "$reports" -ne "${#names[@]}" ]; then
  echo "$out" >&2
  fail "expected ${#names[@]} assumption reports from Assumptions.v, got $reports"
fi
if awk -F'\t' '$1 == 0 { found = 1 } END { exit !found }' <<<"$report"; then
  echo "$out" >&2
  fail "unexpected output before the first assumption report"
fi

for i in "${!names[@]}"; do
  axioms=$(awk -F'\t' -v k=$((i + 1)) '$1 == k && $2 != "-" { print $2 }' <<<"$report")
  echo "${names[$i]}: ${axioms:-closed under the global context}" | tr '\n' ' ' | sed 's/ $//'
  echo
  for a in $axioms; do
    ok=0
    for w in "${allowed[@]}"; do [ "$a" = "$w" ] && ok=1; done
    [ $ok -eq 1 ] || fail "${names[$i]} rests on $a, which is not a standard-library Reals axiom"
  done
done

if [ $status -eq 0 ]; then
  echo "check.sh: OK: ${#names[@]} main theorems, no unproved statements, no axioms beyond the standard library's Reals"
fi
exit $status
