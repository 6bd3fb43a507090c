"""Write corpus.json: >= 2000 multilingual test strings for the tokenizer
(English, code, Chinese/Japanese/Korean incl. long Han runs, Cyrillic,
Arabic, Hindi, emoji and ZWJ sequences, CRLF, tabs, long whitespace runs,
digits, contractions in mixed case, unusual Unicode). Deterministic."""
import json
import random

rng = random.Random(20261129)
seeds = [
    "The quick brown fox jumps over the lazy dog.", "I'm sure you'll see it's fine, isn't it? They've said we'd go.",
    "DON'T SHOUT, it's LOUD; We'Re HeRe, You'LL see, I'M ok, THEY'VE gone, he'D know.",
    "def fib(n):\n    return n if n < 2 else fib(n-1) + fib(n-2)\n", "fn main() { println!(\"{}\", 1 + 2); }",
    "for (int i = 0; i < 10; ++i) { sum += a[i] * b[i]; }", "SELECT id, name FROM users WHERE age >= 21 ORDER BY name;",
    "<div class=\"x\">Hello &amp; welcome</div>", "https://example.com/path/to/file.html?q=1&r=2#frag", "a/b/c//d///e",
    "人工智能正在改变世界，我们需要认真思考它的影响。", "中华人民共和国成立于一九四九年十月一日北京天安门广场举行了盛大的开国大典",
    "東京都は日本の首都です。ひらがなとカタカナと漢字を混ぜて書きます。", "今日はいい天気ですね！コーヒーを飲みましょう。",
    "한국어는 한글로 씁니다. 안녕하세요, 만나서 반갑습니다!", "Привет, как дела? Это тест на русском языке.",
    "Съешь же ещё этих мягких французских булок, да выпей чаю.", "مرحبا بالعالم، هذه جملة باللغة العربية.",
    "الذكاء الاصطناعي يغير العالم", "नमस्ते दुनिया, यह हिंदी में एक वाक्य है।", "Γειά σου Κόσμε! Αυτό είναι ελληνικά.",
    "שלום עולם, זה משפט בעברית.", "สวัสดีชาวโลก นี่คือภาษาไทย", "Xin chào thế giới, đây là tiếng Việt.",
    "👍🏽 👨‍👩‍👧‍👦 🏳️‍🌈 ❤️‍🔥 🧑🏿‍💻 😀😃😄😁", "emoji mid-word: ab😀cd, flags 🇫🇷🇯🇵🇺🇸, keycap 1️⃣ #️⃣",
    "line one\r\nline two\r\n\r\nline four", "tabs\tand\t\tmore\t\t\ttabs", "          ten spaces before", "trailing spaces          ",
    "mixed \t \r\n \n\n\n   whitespace", "numbers 1 12 123 1234 12345 123456 1234567 3.14159 -42 1e10 0x1F 1,000,000",
    "2026-11-29T07:58:17Z and 12:34:56.789", "$100.00 €50 ¥1000 £20 ₹500", "math: ∑ᵢ xᵢ² ≤ ∫₀^∞ e^{-x} dx ≈ 1; α β γ δ",
    "zero\u200bwidth\u200cjoin\u200dhere\ufeffbom", "combining: e\u0301 a\u0308 n\u0303 \u0915\u094d\u0937", "NFD vs NFC: caf\u00e9 cafe\u0301",
    "replacement \ufffd char and private \ue000 use", "supplementary: 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 𝟘𝟙𝟚 𠀀𠀁 𪚥", "fullwidth ＡＢＣ１２３ and halfwidth ｱｲｳ",
    "Ελληνικά + 中文 + English + русский in one line", "CamelCaseIdentifierWithHTTPServer and snake_case_name and kebab-case-name",
    "!!!??? ... --- *** ### @@@ %%% ^^^ &&& ((( ))) [[[ ]]] {{{ }}}", "'s 't 're 've 'm 'll 'd 'S 'T 'RE 'VE 'M 'LL 'D",
    "<|open|>message role=\"user\"<|sep|>hi<|close|><|end_of_msg|>", "\n\n\n\n", " ", "", "a", "\t", "\r\n",
]
words = sum((s.split() for s in seeds), [])
out = list(seeds)
while len(out) < 2100:
    k = rng.randint(1, 12)
    parts = []
    for _ in range(k):
        w = rng.choice(words)
        r = rng.random()
        if r < 0.1:
            w = w.upper()
        elif r < 0.2:
            w = w.capitalize()
        parts.append(w)
        parts.append(rng.choice([" ", " ", " ", "  ", "\t", "\n", "\r\n", "", ", ", "   ", "/"]))
    if rng.random() < 0.1:
        parts.append(str(rng.randint(0, 10**12)))
    if rng.random() < 0.05:
        parts.append("中" * rng.randint(20, 200))
    if rng.random() < 0.05:
        parts.append(" " * rng.randint(5, 80))
    out.append("".join(parts))
with open("corpus.json", "w", encoding="utf-8") as f:
    json.dump(out, f, ensure_ascii=False, indent=0)
print(len(out), "strings")
