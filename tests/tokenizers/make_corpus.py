#!/usr/bin/env python3
"""Writes the tokenizer test corpus (corpus.json): 2,400 varied strings, deterministic (seed 7): prose,
source code, digit runs, runs of spaces/tabs/newlines, punctuation clusters, accented Latin, Cyrillic, CJK,
emoji with ZWJ sequences, very long words, contractions in any case, words that are JavaScript object
properties, and the empty string."""
import json
import os
import random
import subprocess

rng = random.Random(7)
out = [""]
try:
    kjv = [l.split(" ", 1)[1] for l in subprocess.run(["bible", "-f", "Gen1:1-Gen50:26"], capture_output=True,
                                                      text=True, check=True).stdout.splitlines() if " " in l]
except Exception:
    kjv = ["In the beginning God created the heaven and the earth."]
out += rng.sample(kjv, 400)
code = ["int main(int argc, char** argv) { return 0; }", "for (size_t i = 0; i < n; ++i) x[i] += y[i];",
        "def f(x):\n    return x ** 2  # square", "const a = {b: [1, 2, 3]};", "#include <vector>\n",
        "if (a && b || !c) { throw std::runtime_error(\"bad\"); }", "SELECT * FROM t WHERE id = 42;",
        "    \tindented\twith\ttabs", "x=>x*2", "git commit -m 'fix: off-by-one'", "<div class=\"a\">hi</div>"]
for _ in range(250):
    out.append(rng.choice(code) + rng.choice(["", " ", "\n", "\n\n", "  "]) + rng.choice(code))
for _ in range(200):
    n = rng.randint(1, 40)
    out.append(rng.choice(["", "v", "x ", "id=", "$"]) + "".join(rng.choice("0123456789") for _ in range(n)) +
               rng.choice(["", ".5", ",000", " km", "%"]))
ws = [" ", "  ", "   ", "\t", "\n", "\r\n", "\n\n\n", " \n ", "\t\t", "    "]
for _ in range(200):
    out.append("".join(rng.choice(ws) + rng.choice(["a", "word", "", "x y", "END"]) for _ in range(rng.randint(1, 6))))
punct = "!@#$%^&*()_+-=[]{};':\",./<>?`~|\\…—–«»¿¡"
for _ in range(150):
    out.append("".join(rng.choice(punct) for _ in range(rng.randint(1, 12))) + rng.choice(["", " ok", "word", "1"]))
latin = ["café", "naïve", "Ångström", "déjà vu", "façade", "jalapeño", "Zürich", "crème brûlée", "São Paulo",
         "Łódź", "İstanbul", "œuvre", "straße", "ÆØÅ", "ĳssel"]
cyr = ["Привет, мир!", "Съешь же ещё этих мягких французских булок", "ёлка", "Москва 2024", "ЖЖ"]
cjk = ["你好，世界", "日本語のテキスト", "한국어 문장입니다", "漢字とかなカナ", "中文标点。！？"]
emoji = ["👍", "👩‍👩‍👧", "🏳️‍🌈", "👨🏽‍💻", "🇫🇷🇩🇪", "❤️", "😀😃😄", "🧑‍🤝‍🧑", "1️⃣"]
for pool in (latin, cyr, cjk, emoji):
    for _ in range(150):
        out.append(" ".join(rng.choice(pool) for _ in range(rng.randint(1, 4))) + rng.choice(["", ".", " ok", "\n"]))
for _ in range(50):
    out.append("".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(30, 300))))
for _ in range(100):
    out.append(rng.choice(["it", "We", "THEY", "you", "She"]) + rng.choice(["'s", "'S", "'re", "'VE", "'ll", "'D", "'m", "'t"]) +
               rng.choice(["", " fine", "!"]))
for w in ["constructor", "toString", "hasOwnProperty", "__proto__", "valueOf", "prototype", "isPrototypeOf"]:
    out += [w, " " + w, w + " " + w, "the " + w + " of"]
while len(out) < 2400:  # mixtures
    out.append(rng.choice(out) + rng.choice(["", " ", "\n"]) + rng.choice(out))
with open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "corpus.json"), "w") as f:
    json.dump(out, f, ensure_ascii=False, indent=0)
print(len(out), "strings")
