#!/usr/bin/env python3
"""Writes src/model/tokenizer_test_cases.inc: expected token ids of SmolLM2-135M-Instruct for a
set of strings, computed by an implementation independent of ours, HuggingFace `tokenizers`,
built from the GGUF's vocabulary and merges the way the model's own tokenizer.json is set up:
pre-tokenizer Sequence[Digits(individual_digits=True), ByteLevel(add_prefix_space=False,
use_regex=True)], ByteLevel decoder, control tokens as special added tokens, and the GGUF's
unknown token for bytes the vocabulary lacks.

Usage: pip install tokenizers gguf
       tools/gen_tokenizer_cases.py [GGUF] [OUTPUT]
       (defaults: models/SmolLM2-135M-Instruct.Q4_1.gguf, src/model/tokenizer_test_cases.inc)
"""
import pathlib
import random
import sys
import unicodedata

import gguf

CONTROL = 3

CASES = [
    # English, contractions, case
    "Hello world",
    "Hello, we can use",
    "The quick brown fox jumps over the lazy dog.",
    "I'm sure you've seen what they'll do, haven't you? We'd... She's right.",
    "DON'T SHOUT: IT'S LOUD",
    "'s 's 'S ''' 'll've 're'd rock 'n' roll",
    "\u2018curly\u2019 quotes \u201cdouble\u201d",
    "supercalifragilisticexpialidocious aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa",
    # digits and numbers
    "1234567890",
    "Pi is 3.14159, e \u2248 2.71828; 1,000,000 and 1e-9",
    "The year 2024 had 366 days.",
    "abc123def 4five 6 7  8",
    "\u216b \u00bd \u00b2\u00b3 \u0663 \u0967\u0968\u0969 \u0e51\u0e52 \uff10\uff11\uff12",
    # punctuation
    "Hello!!! What?! (yes) [no] {maybe} <tag> a+b=c; x->y && z || w",
    "....!!!???---___===***",
    # whitespace runs and newlines
    "   leading spaces",
    "trailing spaces   ",
    "multiple   spaces   between   words",
    "line one\nline two\n\nline four\r\nwindows",
    "\ttab\tseparated\t\tvalues",
    "",
    " ",
    "\n\n\n",
    "a\u00a0b\u3000c\u2003d \u0085e\u2028f  \u00a0g",
    "a\x1cb\x1fc",
    # code and markup
    "def fib(n):\n    if n < 2:\n        return n\n    return fib(n - 1) + fib(n - 2)\n",
    "int main() {\n\tstd::vector<int> v{1, 2, 3};\n\treturn v.size() > 0 ? 0 : 1;\n}",
    '{"key": "value", "n": [1, 2.5, -3e10], "ok": true}',
    "Visit https://huggingface.co/HuggingFaceTB?x=1&y=2 or mail bob@example.com",
    "# Title\n\n- item 1\n- item 2\n\n**bold** _it_ `code`",
    # emoji, CJK, other scripts
    "I love pizza \U0001f355\U0001f355! \U0001f600\U0001f44d\U0001f3fd \U0001f468\u200d\U0001f469\u200d\U0001f467 family",
    "\u4f60\u597d\uff0c\u4e16\u754c\uff01\u4eca\u5929\u5929\u6c14\u5f88\u597d\u3002",
    "\u65e5\u672c\u8a9e\u306e\u30c6\u30ad\u30b9\u30c8\u3068\u30ab\u30bf\u30ab\u30ca\u3001\u3072\u3089\u304c\u306a\u3002",
    "\uc548\ub155\ud558\uc138\uc694 \uc138\uacc4",
    "Caf\u00e9 d\u00e9j\u00e0 vu \u2014 na\u00efve fa\u00e7ade, \u00c5ngstr\u00f6m, Stra\u00dfe, \u0141\u00f3d\u017a",
    "\u0645\u0631\u062d\u0628\u0627 \u0628\u0627\u0644\u0639\u0627\u0644\u0645! \u0627\u0644\u0639\u062f\u062f \u0661\u0662\u0663 \u0647\u0646\u0627",
    "\u041f\u0440\u0438\u0432\u0435\u0442, \u043c\u0438\u0440! \u0393\u03b5\u03b9\u03ac \u03c3\u03bf\u03c5 \u039a\u03cc\u03c3\u03bc\u03b5. \u05e9\u05dc\u05d5\u05dd \u05e2\u05d5\u05dc\u05dd",
    "\u0928\u092e\u0938\u094d\u0924\u0947 \u0926\u0941\u0928\u093f\u092f\u093e",
    "\u2200x\u2208\u211d: x\u00b2 \u2265 0 \u21d2 \u221a(x\u00b2) = |x|",
    "zero\u200bwidth\u200d join\ufeff bom",
    "\U0001d518\U0001d52b\U0001d526\U0001d520\U0001d52c\U0001d521\U0001d522 \U0001d544\U0001d552\U0001d565\U0001d559 \U00010348",
    "Mix: English, Fran\u00e7ais, \u4e2d\u6587, \u0627\u0644\u0639\u0631\u0628\u064a\u0629, 123, \U0001f642.",
    # control characters, including bytes the vocabulary has no token for (-> unknown token)
    "a\x00b\x07c\x1bd\x7f",
    "x\x04y\x06z\x1d",
    # special tokens inside text
    "<|im_start|>user\nHello<|im_end|>\n<|im_start|>assistant\n",
    "<|im_start|><|im_end|><|im_start",
    "a<|endoftext|>b<file_sep>c <repo_name>d<reponame>",
]

# The same strings with special-token parsing off: their text is ordinary text.
CASES_NO_SPECIAL = [
    "<|im_start|>user\nHello<|im_end|>\n<|im_start|>assistant\n",
    "a<|endoftext|>b",
]

# Random strings over a pool mixing scripts, digits, blanks, apostrophes and special tokens.
POOL = (list("abcXYZ'’ \t\n0123456789.,!?-_()<>|") + [" ", "  ", "'s", "'ll", "<|im_start|>", "<|im_end|>"] +
        list("éßŁ中文日本語한국어العربيةПриветΓειάनमस्ते١٢٣½Ⅻ") + ["\U0001f600", "\u00a0", "\u3000", "\u200d"])
RANDOM_COUNT = 24


def read_vocab(path):
    reader = gguf.GGUFReader(path)

    def strings(key):
        field = reader.fields[key]
        return [bytes(field.parts[i]).decode("utf-8") for i in field.data]

    def ints(key):
        field = reader.fields[key]
        return [int(field.parts[i][0]) for i in field.data]

    def scalar(key):
        field = reader.fields[key]
        return int(field.parts[field.data[0]][0])

    return (strings("tokenizer.ggml.tokens"), ints("tokenizer.ggml.token_type"),
            strings("tokenizer.ggml.merges"), scalar("tokenizer.ggml.unknown_token_id"))


def reference_tokenizer(tokens, types, merges, unk):
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    vocab = {}
    for i, t in enumerate(tokens):
        vocab.setdefault(t, i)
    bpe = models.BPE(vocab=vocab, merges=[tuple(m.split(" ")) for m in merges], unk_token=tokens[unk])
    tk = Tokenizer(bpe)
    tk.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
    ])
    tk.decoder = decoders.ByteLevel()
    tk.add_special_tokens([AddedToken(t, special=True, normalized=False)
                           for t, ty in zip(tokens, types) if ty == CONTROL])
    return tk


def cpp_string(s):
    """A C++ string_view literal: printable characters as themselves, the rest as octal escapes."""
    out = []
    for i, ch in enumerate(s):
        if ch == "\\" or ch == '"' or ch == "?" and i > 0 and s[i - 1] == "?":  # no trigraph warnings
            out.append("\\" + ch)
        elif ch == "\n":
            out.append("\\n")
        elif ch == "\t":
            out.append("\\t")
        elif unicodedata.category(ch)[0] in "CZ" and ch != " " or unicodedata.category(ch) == "Mn":
            out.extend(f"\\{b:03o}" for b in ch.encode("utf-8"))
        else:
            out.append(ch)
    return '"' + "".join(out) + '"sv'


def random_cases():
    rng = random.Random(20240917)
    return ["".join(rng.choice(POOL) for _ in range(rng.randint(4, 30))) for _ in range(RANDOM_COUNT)]


def main():
    model = sys.argv[1] if len(sys.argv) > 1 else "models/SmolLM2-135M-Instruct.Q4_1.gguf"
    output = pathlib.Path(sys.argv[2] if len(sys.argv) > 2 else "src/model/tokenizer_test_cases.inc")
    tk = reference_tokenizer(*read_vocab(model))
    rows = [(text, True) for text in CASES + random_cases()] + [(text, False) for text in CASES_NO_SPECIAL]
    lines = ["// Generated by tools/gen_tokenizer_cases.py (HuggingFace tokenizers, see there). Do not edit.",
             "// {text, parse_special, expected ids, decode(expected ids) where it is not the text}"]
    for text, parse_special in rows:
        tk.encode_special_tokens = not parse_special
        ids = tk.encode(text, add_special_tokens=False).ids
        decoded = tk.decode(ids, skip_special_tokens=False)
        lines.append(f"{{{cpp_string(text)}, {'true' if parse_special else 'false'},\n"
                     f" {{{', '.join(map(str, ids))}}}"
                     + (f",\n {cpp_string(decoded)}}}," if decoded != text else "},"))
    output.write_text("\n".join(lines) + "\n")
    print(f"{len(rows)} cases -> {output}")


if __name__ == "__main__":
    main()
