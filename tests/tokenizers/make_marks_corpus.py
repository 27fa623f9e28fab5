#!/usr/bin/env python3
"""Writes marks_corpus.json: 300 strings (seed 11) where the newer pre-tokenizers differ from the old ones:
combining marks on their letters (Devanagari, Bengali, Tamil, Thai, Arabic harakat, Hebrew niqqud, decomposed
Latin and Vietnamese, stacked diacritics), case changes inside words (CamelCase, ALLCaps, titlecase ǅ, modifier
letters), contractions in any case, CJK with kana and Hangul, full-width punctuation, digit runs, emoji with
variation selectors and skin tones, trailing and inner whitespace."""
import json
import os
import random
import unicodedata

rng = random.Random(11)
marks = ["नमस्ते दुनिया", "हिन्दी में लिखा", "বাংলা ভাষা", "தமிழ் மொழி", "ภาษาไทยง่ายนิดเดียว", "العَرَبِيَّة",
         "שָׁלוֹם עוֹלָם", unicodedata.normalize("NFD", "Tiếng Việt có dấu"), "Tiếng Việt có dấu",
         unicodedata.normalize("NFD", "crème brûlée à São Paulo"), "Z̸̢a̵l̶g̷o̴ t̵e̸x̷t", "q̣̇ ḱṷṓn ɑ̃ ɛ̃",
         "ὙΜΝΟΣ ἀρχῇ", "Приве́т, ми́р", "e\u0301e\u0300e\u0302", "a\u20dd b\u20e3"]
cased = ["HelloWorldFOOBar", "parseHTTPResponse", "XMLHttpRequest", "iPhone iOS macOS", "ǅungla ǈudi ǋovi",
         "ʰaspirated ʷlabial", "McDonald's", "snake_case_Name", "ALLCAPS WORDS", "camelCase123Digits",
         "ÉCOLE Über ÅSA", "getX getY setZ"]
contr = ["DON'T", "we'LL", "I'M", "You'Re", "it's", "THEY'VE", "she'D", "o'clock", "rock'n'roll"]
cjk = ["日本語のテキストとカタカナ", "漢字とかなカナ混じり文", "中文标点。！？", "你好，世界！", "한국어 문장입니다",
       "ＡＢＣ　全角１２３", "「かぎ括弧」『二重』", "ヴァイオリン", "龥龦", "ࠀࠁ Samaritan"]
punct = ["！？", "...!!!", "—–-", "«»‹›", "‘quoted’ “double”", "#$%&", "@user", "C++/C#", "a/b/c", "1,000.5%"]
emoji = ["❤️", "👍🏽", "👩‍💻", "1️⃣2️⃣", "🇯🇵", "☺︎ ☺️", "✌🏿 ok"]
ws = [" ", "  ", "\t", "\n", "\r\n", "\n\n", " \n", "   "]
digits = ["12345678", "3.14159", "٠١٢٣٤٥", "१२३", "Ⅻ ⅷ", "½ ¾"]
pools = [marks, cased, contr, cjk, punct, emoji, digits]
out = []
for pool in pools:
    out += pool
while len(out) < 300:
    n = rng.randint(1, 5)
    s = ""
    for _ in range(n):
        s += rng.choice(rng.choice(pools)) + rng.choice(ws + [""] * 4)
    out.append(s)
with open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "marks_corpus.json"), "w", encoding="utf-8") as f:
    json.dump(out[:300], f, ensure_ascii=False, indent=0)
