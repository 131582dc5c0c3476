# Sourced by the benchmark scripts: prompt_text L prints about L tokens of plain English text
# (a repeated paragraph, 4.8 characters a token on the test model's tokenizer).
prompt_text() {
  local paragraph="The river town kept its records in a long stone hall by the water, and every spring the \
clerks counted the boats, the nets, the bales of wool and the barrels of salted fish that came \
down from the hills. "
  local chars=$(($1 * 48 / 10)) text=""
  while ((${#text} < chars)); do text+=$paragraph; done
  printf '%s' "${text:0:chars}"
}
